"""What a rematerialised layer keeps for its backward pass (``transformer.remat_policy``):
'none' keeps everything (no remat), 'full' only the layer's input, and 'dots' the outputs
of its matmuls and of the kernels that do a matmul's work.

jax's own `checkpoint_dots` knows only ``dot_general``, convolutions and cuDNN's scaled
matmul. Under it the backward pass ran again, in every layer, the forward of each kernel
that is not one of those. That is flash attention (cuDNN's forward, splash's) and every
grouped matmul of the experts (XLA's ``ragged_dot``, tokamax's, Megablox's, the tiles).
These are a matmul's work each, and what they return is what their backward pass reads.
For the 1B at 16 x 2048 on an H100, cuDNN's forward and backward take 2.2-4.7 ms a layer
(README), the forward about a quarter to a third of that: some 10-20 ms of a ~350 ms step,
done twice. (Estimated from those figures; not yet measured with this policy.)

So 'dots' here keeps, beside jax's:

- the outputs of cuDNN's attention forward (`KERNEL_PRIMITIVES`: its output and
  log-sum-exp, what its backward reads, bound inside jax's own function);
- the values named `KERNEL_OUTPUTS` (``jax.ad_checkpoint.checkpoint_name``): splash's
  output and log-sum-exp (its ``residual_checkpoint_name``) and the ring's (context
  parallelism's ring attention, whose forward passes the keys and values round the
  devices), and every grouped matmul's output (`grouped.grouped_matmul`: each kernel's
  backward pass reads its inputs alone).

They are the size of the matmul outputs kept beside them: the plan counts them
(`mtrain.planning.step_model`, a flash kernel's output and log-sum-exp). MaxText's
policies keep attention's output the same way (``checkpoint_name(..., 'context')``).
"""

from __future__ import annotations

import jax

# The name a kernel's outputs carry where the kernel is not one primitive.
KERNEL_OUTPUTS = "kernel_outputs"
# The primitives whose outputs are what their backward pass reads, where no name can reach
# them (inside jax's own function).
KERNEL_PRIMITIVES = ("dot_product_attention_fwd_wrapper",)

_named = jax.checkpoint_policies.save_only_these_names(KERNEL_OUTPUTS)


def dots_and_kernels(prim, *args, **params) -> bool:
    """The 'dots' policy: jax's `checkpoint_dots`, and the kernels' outputs (module doc)."""
    return (jax.checkpoint_policies.checkpoint_dots(prim, *args, **params)
            or prim.name in KERNEL_PRIMITIVES or _named(prim, *args, **params))


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": dots_and_kernels,
}
