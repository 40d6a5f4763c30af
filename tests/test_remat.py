"""Remat 'dots' (`mtrain/models/remat.py`) keeps the outputs of the kernels that do a matmul's
work, so that the backward pass does not run their forward again: flash attention (cuDNN's
masked and packed calls, splash, context parallelism's ring) and every grouped matmul of
the experts (XLA's ``ragged_dot``, tokamax's, Megablox's, the tiles). jax's own
`checkpoint_dots` keeps only ``dot_general`` and convolutions, and each case here is
checked against it too: under it the kernel's forward is in the backward pass, so the test
can tell the two apart.

The count is of kernel calls in the traced program (``jax.make_jaxpr``: nothing compiled or
run). The backward pass of a rematerialised function is the ``remat`` block of the traced
gradient; the forward calls in it are what remat recomputes. cuDNN is traced on this CPU
with its version and compute capability checks answered as a Hopper GPU's would be; it is
not lowered. The values are unchanged by a policy: `test_speed_levers` trains under each
policy against no remat, `test_grouped_kernels` checks tokamax's gradients (now through
mtrain's own backward pass, `grouped._tokamax_matmul`) against a per-group reference.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jax_core

from mtrain.models import grouped, kernels
from mtrain.models.remat import REMAT_POLICIES
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.training.trainer import Trainer

DOTS = REMAT_POLICIES["dots"]
JAX_DOTS = jax.checkpoint_policies.checkpoint_dots


def calls(jaxpr, counts=None, inside_remat=False):
    """(all primitive calls, those inside a ``remat`` block) of `jaxpr` and its sub-jaxprs."""
    counts = counts if counts is not None else (collections.Counter(), collections.Counter())
    for eqn in jaxpr.eqns:
        counts[0][eqn.primitive.name] += 1
        if inside_remat:
            counts[1][eqn.primitive.name] += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = sub.jaxpr if isinstance(sub, jax_core.ClosedJaxpr) else sub
                if isinstance(sub, jax_core.Jaxpr):
                    calls(sub, counts, inside_remat or eqn.primitive.name == "remat2")
    return counts


def recomputed(layer, policy, *args, kernel_names) -> int:
    """How many of `kernel_names`' calls the backward pass of `layer` rematerialised by
    `policy` makes beyond those of the same gradient without remat."""
    def with_policy(p):
        f = layer if p is None else jax.checkpoint(layer, policy=p)
        everything, _ = calls(jax.make_jaxpr(jax.grad(lambda *a: f(*a).sum()))(*args).jaxpr)
        return sum(everything[n] for n in kernel_names)
    return with_policy(policy) - with_policy(None)


GROUPED = {"ragged_dot": ("ragged_dot_general",), "tokamax": ("custom_vmap_call",),
           "megablox": ("pallas_call",), "tiles": ("while",)}


@pytest.mark.parametrize("kernel", sorted(GROUPED))
def test_dots_keeps_the_grouped_matmuls_out_of_the_backward_pass(kernel):
    """Two grouped matmuls with an activation between them, as an expert's feed-forward."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 8, 8)), jnp.float32)
    sizes = jnp.array([16, 0, 30, 10], jnp.int32)

    def experts(w, x):
        h = jax.nn.silu(grouped.grouped_matmul(x, w, sizes, kernel))
        return grouped.grouped_matmul(h, w, sizes, kernel)

    assert recomputed(experts, DOTS, w, x, kernel_names=GROUPED[kernel]) == 0
    assert recomputed(experts, JAX_DOTS, w, x, kernel_names=GROUPED[kernel]) > 0


@pytest.fixture
def traced_as_on_a_hopper_gpu(monkeypatch):
    """cuDNN's attention traced here: its version and compute capability checks answered as
    on an H100 with cuDNN 9.10, the kernels told the backend is a GPU (nothing is lowered)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


ATTENTION = {"splash": ("pallas_call",), "cudnn": ("dot_product_attention_fwd_wrapper",),
             "cudnn_segments": ("dot_product_attention_fwd_wrapper",),
             "cudnn_causal": ("dot_product_attention_fwd_wrapper",)}


@pytest.mark.parametrize("kernel", sorted(ATTENTION))
def test_dots_keeps_flash_attention_out_of_the_backward_pass(kernel, request):
    """A projection, a flash kernel over two packed examples a row, and a projection."""
    if kernel != "splash":
        request.getfixturevalue("traced_as_on_a_hopper_gpu")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 128, 2, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.bfloat16)
    ids = jnp.asarray(np.repeat([[1] * 64 + [2] * 64], 2, axis=0), jnp.int32)

    def attend(w, x):
        q = x @ w
        return kernels.KERNELS[kernel](q, q, q, ids, ids, True) @ w

    forward = ATTENTION[kernel]
    assert recomputed(attend, DOTS, w, x, kernel_names=forward) == 0
    assert recomputed(attend, JAX_DOTS, w, x, kernel_names=forward) > 0


def test_dots_keeps_the_rings_pass_out_of_the_backward_pass():
    """Ring attention (``length`` split 4 ways, `models.ring`): its forward passes the keys
    and values round the ring (``ppermute``); under 'dots' the backward pass goes round
    once more for its gradients (as without remat), not twice."""
    from mtrain.models import context

    layout = Layout("model:4", "length:model")
    mesh = layout.make_mesh(jax.devices()[:4])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 32, 4, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 8)) / 3, jnp.float32)
    ids = jnp.ones((2, 32), jnp.int32)
    index = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (2, 32))

    def attend(w, x):
        q = x @ w
        with layout.activate(mesh):
            out = context.attend(q, q, q, context.Places(ids, ids, index, index),
                                 context.Options(causal=True, scale=0.5, mode="ring"))
        return out @ w

    assert recomputed(attend, DOTS, w, x, kernel_names=("ppermute",)) == 0
    assert recomputed(attend, JAX_DOTS, w, x, kernel_names=("ppermute",)) > 0


def test_a_scanned_stack_under_dots_runs_splash_forward_once():
    """The train step of a scanned 2-layer LM with splash attention and remat 'dots' over
    ``batch:4;model:2``: one forward call of the kernel (the scan's body) and its backward
    pass's two (queries' gradient, keys' and values'), none of them in the remat block's
    forward part; the step's program as the trainer builds it, traced."""
    config = TransformerConfig(vocab_size=128, d_model=32, d_ff=64, num_heads=2, d_kv=16,
                               num_layers=2, max_length=128, attention="flash",
                               flash_kernel="splash", scan_layers=True, remat_policy="dots",
                               activation_dtype="bfloat16")
    layout = Layout("batch:4;model:2", "batch:batch;d_ff:model;heads:model;vocab:model")
    t = Trainer(model=DecoderLM(config), optimizer=optax.sgd(0.1), layout=layout,
                mesh=layout.make_mesh(), batch_size=8, sequence_length=128)
    everything, _ = calls(jax.make_jaxpr(t._train_step)(
        t.sharded_abstract_state(), t.abstract_batch(), *t.objective.abstract_arguments()).jaxpr)
    assert everything["pallas_call"] == 3


@pytest.mark.slow  # (about 20 s: two trainers; the fast tier traces the kernels above)
def test_dropless_experts_train_under_dots_as_without_remat():
    """`moe_tiny` dropless with 'tokamax' (its reference implementation here, through
    mtrain's own backward pass), the experts over `batch` (all-to-all) and `d_ff` over
    `model`: 3 steps under remat 'dots' take the losses of no remat (remat changes what is
    kept, not what is computed: float32 sums in other fusions, test_dropless's 1e-5)."""
    from test_dropless import moe_tiny_losses

    run = [("tokamax", {"grouped_kernel": "tokamax"}, "batch:4;model:2",
            "batch:batch;experts:batch;d_ff:model", "")]
    losses = {policy: moe_tiny_losses(["moe.dispatch='dropless'",
                                       f"transformer.remat_policy='{policy}'"], run)["tokamax"][0]
              for policy in ("none", "dots")}
    assert len(set(losses["none"])) == 3  # (the steps change the model)
    np.testing.assert_allclose(losses["dots"], losses["none"], rtol=1e-5)
