"""Write a step for one replica; run it on every replica of a mesh axis (TF-Replicator).

    def step(ctx, params, batch):              # runs on each replica, with its slice of batch
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = ctx.all_mean(grads)            # the cross-replica primitives are on ctx
        return params - 0.1 * grads, ctx.all_mean(loss)

    train_step = replicate(step, mesh, axis="batch", split_inputs=(False, True))
    params, loss = train_step(params, batch)

`replicate` is `jax.shard_map` over one axis of an mtrain mesh: the step is traced once, for
one replica, and XLA runs it on every device of that axis, on CPU, GPU or TPU alike. The
other mesh axes stay automatic, so a replica may itself be model-parallel: its arrays are
split over them by their shardings, and XLA partitions the step's maths as it does outside.

Arguments are passed whole to every replica (replicated) unless `split_inputs` says to split
them along their leading dimension, one slice per replica. Outputs are declared the same
way by `split_outputs`: a replicated output must be the same on every replica (reduce it
with `all_sum`/`all_mean` first; it is not checked), a split one is concatenated. As in
TF-Replicator, everything inside the step is per replica: the gradient of a replicated
argument is the replica's own until the step reduces it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec


@dataclasses.dataclass(frozen=True)
class ReplicaContext:
    """What a replica's step knows about the others, and how it talks to them. Every
    method takes and returns pytrees."""

    axis: str
    num_replicas: int

    @property
    def replica_id(self) -> jax.Array:
        """This replica's index, 0 .. num_replicas - 1."""
        return jax.lax.axis_index(self.axis)

    def all_sum(self, tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda x: jax.lax.psum(x, self.axis), tree)

    def all_mean(self, tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda x: jax.lax.pmean(x, self.axis), tree)

    def all_gather(self, tree: Any) -> Any:
        """Every replica's value, stacked along a new leading dimension (replica order)."""
        return jax.tree_util.tree_map(lambda x: jax.lax.all_gather(x, self.axis), tree)

    def broadcast(self, tree: Any, source: int = 0) -> Any:
        """Replica `source`'s value, on every replica."""
        def one(x):
            mine = jnp.where(self.replica_id == source, x, jnp.zeros_like(x))
            return jax.lax.psum(mine, self.axis)
        return jax.tree_util.tree_map(one, tree)

    def send_to(self, tree: Any, shift: int) -> Any:
        """Sends this replica's value to replica (id + shift) mod n, and returns the value
        that replica (id - shift) mod n sent here: a cyclic collective permute."""
        n = self.num_replicas
        pairs = [(i, (i + shift) % n) for i in range(n)]
        return jax.tree_util.tree_map(lambda x: jax.lax.ppermute(x, self.axis, pairs), tree)


def replicate(step: Callable[..., Any], mesh: Mesh, axis: str = "batch", *,
              split_inputs: Sequence[bool] = (), split_outputs: Sequence[bool] | bool = False,
              jit: bool = True) -> Callable[..., Any]:
    """`step(ctx, *args)` run on every replica along mesh axis `axis` (see the module
    docstring). `split_inputs[i]` splits positional argument i (a pytree) along its leading
    dimension over the replicas; `split_outputs` (one bool, or one per output of a tuple)
    concatenates outputs along it instead of returning the replicas' common value."""
    if axis not in mesh.shape:
        raise ValueError(f"mesh {dict(mesh.shape)} has no axis {axis!r} to replicate over")
    ctx = ReplicaContext(axis, mesh.shape[axis])
    spec = {True: PartitionSpec(axis), False: PartitionSpec()}

    def run(*args):
        flags = list(split_inputs) + [False] * (len(args) - len(split_inputs))
        outs = split_outputs
        if not isinstance(outs, bool):
            outs = tuple(spec[bool(s)] for s in outs)
        else:
            outs = spec[outs]
        mapped = jax.shard_map(
            lambda *a: step(ctx, *a), mesh=mesh,
            in_specs=tuple(spec[bool(f)] for f in flags), out_specs=outs,
            axis_names=frozenset({axis}),
            # Per-replica semantics, as TF-Replicator and pmap have them: the gradient of a
            # replicated argument is this replica's own, until the step reduces it. (With
            # JAX's varying-value checks on, it would come back already summed.)
            check_vma=False)
        return mapped(*args)

    return jax.jit(run) if jit else run
