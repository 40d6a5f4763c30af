"""Stochastic Gradient Push (Assran et al., ICML 2019): data parallelism by PushSum gossip.

Each replica along the data axis keeps its own parameters x, PushSum weight w and optimizer
state. A step computes the gradient of its rows of the batch at the de-biased parameters
z = x / w, takes a local optimizer step on x, and mixes (x, w) with one out-peer (hop 2^k,
k cycling through log2(n) phases; `mtrain.parallel.pushsum`). No all-reduce of gradients: each
replica sends one copy of its parameters per step (the compiled step holds a
collective-permute for each of the log2(n) hops, of which one runs), and the replicas agree
only approximately (`consensus_distance`); `average` gives the mean of z, which is what
evaluation uses.

The model runs inside `mtrain.parallel.replica.replicate` over the data axis; the other mesh axes
keep the layout's model parallelism.
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mtrain.parallel import pushsum
from mtrain.parallel.layout import Layout
from mtrain.parallel.replica import replicate
from mtrain.training.state import TrainState, step_metrics, with_shardings
from mtrain.training.trainer import Trainer


@flax.struct.dataclass
class SGPState:
    step: jax.Array
    params: Any  # every leaf stacked: [replicas, *shape]
    opt_state: Any
    weight: jax.Array  # [replicas]
    # Overlap SGP: the (params, weight) messages received but not yet added, oldest first:
    # [replicas, overlap, ...]; () without overlap.
    inflight: Any = ()


class SGPTrainer:
    """Stochastic Gradient Push around a `Trainer` (its model, optimizer, layout, batch,
    microbatches).

    `overlap` = tau > 0 is overlap SGP: a message is added tau steps after it was sent, so
    its transfer can overlap tau steps of compute (the mass in flight is kept in the state,
    so nothing is lost). `average_every` = H > 0 replaces the gossip of every H-th step by an
    exact average over all replicas (an all-reduce of the parameters), which brings them
    back to consensus.
    """

    def __init__(self, trainer: Trainer, overlap: int = 0, average_every: int = 0):
        self.trainer = t = trainer
        if overlap < 0 or average_every < 0:
            raise ValueError(f"SGP overlap ({overlap}) and average_every ({average_every}) "
                             f"must be >= 0")
        self.overlap, self.average_every = overlap, average_every
        self.axis = t.layout.mesh_dim_for("batch")
        if self.axis is None:
            raise ValueError("SGP needs the batch split over a mesh dimension (batch:batch)")
        self.num_replicas = t.mesh.shape[self.axis]
        pushsum.num_phases(self.num_replicas)  # a power of two
        for tensor_dim, mesh_dim in t.layout.parameter_rules:
            if mesh_dim == self.axis:
                raise ValueError(
                    f"parameter layout rule '{tensor_dim}:{mesh_dim}' splits the parameters "
                    f"over the gossip mesh dimension {mesh_dim!r}, where every replica keeps "
                    f"its own parameters; drop it or use data_parallel='allreduce'")
        # Inside a replica the data axis is manual: the model's constraints use the layout
        # without the batch rule, over the other (automatic) mesh axes.
        self.inner = Layout(t.layout.mesh_shape,
                            [r for r in t.layout.layout_rules if r[0] != "batch"],
                            t.layout.parameter_rules)

        def stacked(sharding, extra=()):
            return NamedSharding(t.mesh, PartitionSpec(self.axis, *extra, *sharding.spec))

        params = jax.tree_util.tree_map(stacked, t.state_shardings.params)
        weight = NamedSharding(t.mesh, PartitionSpec(self.axis))
        inflight = () if not overlap else (
            jax.tree_util.tree_map(lambda s: stacked(s, (None,)), t.state_shardings.params),
            NamedSharding(t.mesh, PartitionSpec(self.axis, None)))
        self.state_shardings = SGPState(
            step=t.state_shardings.step, params=params,
            opt_state=jax.tree_util.tree_map(stacked, t.state_shardings.opt_state),
            weight=weight, inflight=inflight)
        self._step = jax.jit(
            replicate(self._replica_step, t.mesh, self.axis, jit=False,
                      split_inputs=(False, True, True, True, True, True),
                      split_outputs=(False, True, True, True, True, False)),
            donate_argnums=(1, 2, 3, 4))

    def init_state(self, state: TrainState | None = None) -> SGPState:
        """Every replica starts from `state` (a `Trainer` state, e.g. a restored checkpoint;
        default: the trainer's fresh state) with weight 1 and nothing in flight."""
        state = state or self.trainer.init_state()
        n, tau = self.num_replicas, self.overlap

        def copies(x, sharding):
            return jax.device_put(jnp.broadcast_to(x, (n, *x.shape)), sharding)

        inflight = () if not tau else (
            jax.tree_util.tree_map(lambda x, s: jax.device_put(
                jnp.zeros((n, tau, *x.shape), x.dtype), s), state.params,
                self.state_shardings.inflight[0]),
            jax.device_put(jnp.zeros((n, tau)), self.state_shardings.inflight[1]))
        return SGPState(
            step=jnp.array(state.step),  # its own buffer: the trainer's step donates state
            params=jax.tree_util.tree_map(copies, state.params, self.state_shardings.params),
            opt_state=jax.tree_util.tree_map(copies, state.opt_state,
                                             self.state_shardings.opt_state),
            weight=jax.device_put(jnp.ones(n), self.state_shardings.weight), inflight=inflight)

    def _replica_step(self, ctx, step, params, opt_state, weight, inflight, batch):
        t = self.trainer
        first = lambda tree: jax.tree_util.tree_map(lambda v: v[0], tree)  # noqa: E731
        x, opt, w, inflight = first(params), first(opt_state), weight[0], first(inflight)
        z = pushsum.debias(x, w)
        with self.inner.activate(t.mesh):
            key = jax.random.fold_in(jax.random.fold_in(t.dropout_key, step), ctx.replica_id)
            grads, loss, xent, tokens, stats = t.gradients(z, batch, key)
            updates, opt = t.optimizer.update(grads, opt, z)
            # The update moves x; the de-biased value moves by it divided by w.
            x = jax.tree_util.tree_map(lambda v, u: v + u * w, x, updates)
        gossip = functools.partial(self._gossip, ctx, step)
        if self.average_every:
            x, w, inflight = jax.lax.cond((step + 1) % self.average_every == 0,
                                          functools.partial(self._exact_average, ctx), gossip,
                                          x, w, inflight)
        else:
            x, w, inflight = gossip(x, w, inflight)
        # This replica's metrics; only scalars are reduced over the replicas: a metric must
        # not cost the all-reduce SGP avoids. Tokens add up, `finite` holds on every replica.
        metrics = {k: ctx.all_mean(v) for k, v in step_metrics(grads, loss, xent, tokens,
                                                                 stats).items()}
        metrics["num_tokens"] = ctx.all_sum(tokens)
        metrics["finite"] = (metrics["finite"] == 1.0).astype(jnp.float32)
        expand = lambda tree: jax.tree_util.tree_map(lambda v: v[None], tree)  # noqa: E731
        return step + 1, expand(x), expand(opt), w[None], expand(inflight), metrics

    def _gossip(self, ctx, step, x, w, inflight):
        """One PushSum round with this step's peer; with overlap the received half waits in
        `inflight` and the one received `overlap` steps ago is added instead."""
        kept, received = pushsum.push(ctx, (x, w), step % pushsum.num_phases(ctx.num_replicas))
        if not self.overlap:
            return (*jax.tree_util.tree_map(jnp.add, kept, received), inflight)
        oldest = jax.tree_util.tree_map(lambda v: v[0], inflight)
        x, w = jax.tree_util.tree_map(jnp.add, kept, oldest)
        inflight = jax.tree_util.tree_map(lambda q, r: jnp.concatenate([q[1:], r[None]]),
                                          inflight, received)
        return x, w, inflight

    def _exact_average(self, ctx, x, w, inflight):
        """All replicas to the exact average of all the mass, in flight included: (sum of x)
        / (sum of w) everywhere, w = 1, nothing in flight."""
        if self.overlap:
            x, w = jax.tree_util.tree_map(lambda v, q: v + q.sum(0), (x, w), inflight)
        total_x, total_w = ctx.all_sum((x, w))
        x = jax.tree_util.tree_map(lambda v: v / total_w.astype(v.dtype), total_x)
        return x, jnp.ones_like(w), jax.tree_util.tree_map(jnp.zeros_like, inflight)

    def train_step(self, state: SGPState, batch) -> tuple[SGPState, dict]:
        """One SGP step; metrics as `Trainer.train_step`'s (loss, cross-entropy, gradient
        norm: means over replicas; tokens: the sum; finite: on every replica)."""
        step, params, opt_state, weight, inflight, metrics = self._step(
            state.step, state.params, state.opt_state, state.weight, state.inflight, batch)
        return SGPState(step, params, opt_state, weight, inflight), metrics

    def compile_train_step(self):
        """The SGP step compiled ahead of time from abstract shapes (for the planner)."""
        t = self.trainer
        state = with_shardings(jax.eval_shape(self.init_state, t.sharded_abstract_state()),
                               self.state_shardings)
        return self._step.lower(state.step, state.params, state.opt_state, state.weight,
                                state.inflight, t.abstract_batch()).compile()

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

    def train_state(self, state: SGPState) -> TrainState:
        """A `Trainer` state: the average parameters, the replicas' mean optimizer statistics
        (integer leaves, i.e. counts, from replica 0). What checkpoints hold, so that an SGP
        checkpoint restores into an all-reduce run and the other way round."""
        def mean(x, sharding):
            x = x.mean(0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x[0]
            return jax.device_put(x, sharding)

        return TrainState(step=jnp.array(state.step), params=self.average(state),
                          opt_state=jax.tree_util.tree_map(
                              mean, state.opt_state, self.trainer.state_shardings.opt_state))

    # ---- what the training loop needs of a stepper (`training.loop.Stepper`) ----

    def start(self, state: TrainState) -> SGPState:
        """Every replica from the same train state (a resumed run starts from consensus)."""
        return self.init_state(state)

    def place_batch(self, batch: dict):
        return self.trainer.place_batch(batch)

    def eval_params(self, state: SGPState):
        """The replicas' average parameters: what evaluation uses."""
        return self.average(state)

    def log_metrics(self, state: SGPState) -> dict:
        """How far the replicas are from consensus, and what each sends per step."""
        distance = jax.device_get(self.consensus_distance(state))
        return {"train/consensus_distance_max": float(distance["max"]),
                "train/consensus_distance_mean": float(distance["mean"]),
                "train/bytes_sent_per_replica_per_step": self.bytes_sent_per_step()}

    def describe(self) -> str:
        return (f"SGP over {self.num_replicas} replicas (overlap {self.overlap}, exact average "
                f"every {self.average_every or 'no'} steps): each sends "
                f"{self.bytes_sent_per_step() / 1e6:.3g} MB per step")

    def bytes_sent_per_step(self) -> int:
        """What each replica sends per gossip step: one copy of its parameters and its
        weight (an exact-averaging step all-reduces the parameters instead)."""
        leaves = jax.tree_util.tree_leaves(self.trainer.abstract_state.params)
        return sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves) + 4


def _debias_stacked(params, weight):
    """z_i = x_i / w_i for every replica i of stacked parameters [replicas, ...]."""
    return jax.tree_util.tree_map(
        lambda x: x / weight.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype), params)
