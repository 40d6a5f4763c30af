"""Stochastic Gradient Push (Assran et al., ICML 2019): data parallelism by PushSum gossip.

Each replica along the data axis keeps its own parameters x, PushSum weight w and optimizer
state. A step computes the gradient of its rows of the batch at the de-biased parameters
z = x / w, takes a local optimizer step on x, and mixes (x, w) with one out-peer (hop 2^k,
k cycling through log2(n) phases; `mtrain.pushsum`). No all-reduce of gradients: each
replica sends one copy of its parameters per step (the compiled step holds a
collective-permute for each of the log2(n) hops, of which one runs), and the replicas agree
only approximately (`consensus_distance`); `average` gives the mean of z, which is what
evaluation uses.

The model runs inside `mtrain.replica.replicate` over the data axis; the other mesh axes
keep the layout's model parallelism.
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mtrain import pushsum
from mtrain.layout import Layout
from mtrain.replica import replicate
from mtrain.trainer import Trainer


@flax.struct.dataclass
class SGPState:
    step: jax.Array
    params: Any  # every leaf stacked: [replicas, *shape]
    opt_state: Any
    weight: jax.Array  # [replicas]


class SGPTrainer:
    """Stochastic Gradient Push around a `Trainer` (its model, optimizer, layout, batch)."""

    def __init__(self, trainer: Trainer):
        self.trainer = t = trainer
        self.axis = t.layout.mesh_dim_for("batch")
        if self.axis is None:
            raise ValueError("SGP needs the batch split over a mesh dimension (batch:batch)")
        self.num_replicas = t.mesh.shape[self.axis]
        pushsum.num_phases(self.num_replicas)  # a power of two
        # Inside a replica the data axis is manual: the model's constraints use the layout
        # without the batch rule, over the other (automatic) mesh axes.
        self.inner = Layout(t.layout.mesh_shape,
                            [r for r in t.layout.layout_rules if r[0] != "batch"])

        def stacked(sharding):
            return NamedSharding(t.mesh, PartitionSpec(self.axis, *sharding.spec))

        self.state_shardings = SGPState(
            step=t.state_shardings.step,
            params=jax.tree_util.tree_map(stacked, t.state_shardings.params),
            opt_state=jax.tree_util.tree_map(stacked, t.state_shardings.opt_state),
            weight=NamedSharding(t.mesh, PartitionSpec(self.axis)))
        self._step = jax.jit(
            replicate(self._replica_step, t.mesh, self.axis, jit=False,
                      split_inputs=(False, True, True, True, True),
                      split_outputs=(False, True, True, True, False)),
            donate_argnums=(1, 2, 3))

    def init_state(self, state=None) -> SGPState:
        """Every replica starts from `state` (default: the trainer's fresh state), w = 1."""
        state = state or self.trainer.init_state()
        n = self.num_replicas

        def copies(x, sharding):
            return jax.device_put(jnp.broadcast_to(x, (n, *x.shape)), sharding)

        return SGPState(
            step=jnp.array(state.step),  # its own buffer: the trainer's step donates state
            params=jax.tree_util.tree_map(copies, state.params, self.state_shardings.params),
            opt_state=jax.tree_util.tree_map(copies, state.opt_state,
                                             self.state_shardings.opt_state),
            weight=jax.device_put(jnp.ones(n), self.state_shardings.weight))

    def _replica_step(self, ctx, step, params, opt_state, weight, batch):
        t = self.trainer
        x = jax.tree_util.tree_map(lambda v: v[0], params)
        opt = jax.tree_util.tree_map(lambda v: v[0], opt_state)
        w = weight[0]
        z = pushsum.debias(x, w)
        with self.inner.activate(t.mesh):
            rngs = {"dropout": jax.random.fold_in(jax.random.fold_in(t.dropout_key, step),
                                                  ctx.replica_id)}

            def loss_fn(z):
                loss, _, tokens = t._loss_sums(z, batch, rngs)
                return loss / jnp.maximum(tokens, 1.0)

            loss, grads = jax.value_and_grad(loss_fn)(z)
            updates, opt = t.optimizer.update(grads, opt, z)
            # The update moves x; the de-biased value moves by it divided by w.
            x = jax.tree_util.tree_map(lambda v, u: v + u * w, x, updates)
        x, w = pushsum.mix(ctx, x, w, step % pushsum.num_phases(ctx.num_replicas))
        # Only scalars are reduced: a metric must not cost the all-reduce SGP avoids.
        metrics = {"loss": ctx.all_mean(loss)}
        expand = lambda v: v[None]  # noqa: E731
        return (step + 1, jax.tree_util.tree_map(expand, x), jax.tree_util.tree_map(expand, opt),
                w[None], metrics)

    def train_step(self, state: SGPState, batch) -> tuple[SGPState, dict]:
        step, params, opt_state, weight, metrics = self._step(
            state.step, state.params, state.opt_state, state.weight, batch)
        return SGPState(step, params, opt_state, weight), metrics

    def consensus_distance(self, state: SGPState) -> dict:
        """How far the replicas are from agreeing: the max and mean over replicas of
        |z_i - mean z| (L2 over all parameters). It gathers every replica's parameters: call
        it when logging, not every step."""
        return self._consensus(state.params, state.weight)

    @functools.partial(jax.jit, static_argnums=0)
    def _consensus(self, params, weight):
        squares = 0.0
        for z in jax.tree_util.tree_leaves(_debias_stacked(params, weight)):
            squares = squares + jnp.sum(jnp.square(z - z.mean(0)), axis=tuple(range(1, z.ndim)))
        distance = jnp.sqrt(squares)
        return {"max": distance.max(), "mean": distance.mean()}

    def average(self, state: SGPState):
        """The mean over replicas of the de-biased parameters, laid out as the trainer's."""
        return jax.tree_util.tree_map(lambda z, sharding: jax.device_put(z.mean(0), sharding),
                                      _debias_stacked(state.params, state.weight),
                                      self.trainer.state_shardings.params)

    def bytes_sent_per_step(self) -> int:
        """What each replica sends per step: one copy of its parameters and its weight."""
        leaves = jax.tree_util.tree_leaves(self.trainer.abstract_state.params)
        return sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves) + 4


def _debias_stacked(params, weight):
    """z_i = x_i / w_i for every replica i of stacked parameters [replicas, ...]."""
    return jax.tree_util.tree_map(
        lambda x: x / weight.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype), params)
