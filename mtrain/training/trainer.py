"""Sharded training state and the jitted train and eval steps.

`Trainer` asks the layout for the sharding of every parameter (from the logical names the
model gave it, by the parameter layout rules on top of the layout rules), of every
optimizer-state leaf (from the parameter it belongs to) and of every batch feature
(``("batch", "length")``). The state is created already sharded by a jitted
init, so the full model never exists on one device, and the train step is jitted with those
shardings and donates the old state.

A batch placed on the devices (`Trainer.place_batch`) is a `PlacedBatch` (`placement`): its
arrays and, where the model asks for it (`models.base`: `uses_packing`), how its examples
are packed (`base.packing_of`), which the model's kernels see while it is traced
(`base.current_packing`). The packing is part of the batch's pytree structure, so the jitted
steps compile once per value, like once per shape. The trainer knows no kernel.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtrain.models import context, moe, parameters
from mtrain.training import dpo as dpo_lib
from mtrain.training import freezing, losses
from mtrain.training import optimizer as optimizer_lib
from mtrain.errors import ConfigError
from mtrain.parallel.layout import (Layout, constrain, is_names, logical_names,
                                   tree_shardings)
from mtrain.training.losses import LossConfig
from mtrain.models.base import LOSS_WEIGHTS, READ_INPUTS, batch_keys, packed_rows, packing_of
from mtrain.training.placement import PlacedBatch, local_rows, place
from mtrain.training.state import TrainState, step_metrics, with_shardings

Batch = dict[str, Any]
BATCH_NAMES = ("batch", "length")


class Trainer:
    """Builds the sharded state and the jitted steps for one model, optimizer and layout."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: optax.GradientTransformation,
        layout: Layout,
        mesh: Mesh,
        batch_size: int,
        sequence_length: int,
        seed: int = 0,
        loss_config: LossConfig | None = None,
        num_microbatches: int = 1,
        trainable: freezing.Predicate | None = None,
        dpo: dpo_lib.DpoConfig | None = None,
    ):
        """`num_microbatches` > 1 accumulates the gradient over that many slices of the
        batch (Mesh-TF's serialize_num_microbatches): the same update, a fraction of the
        activation memory. `optimizer` is told which parameters are a scanned stack's
        (`optimizer.for_parameters`), so that its per-tensor statistics are each layer's.
        `trainable` (a predicate of a parameter's path, `freezing`): the parameters that
        train, the others frozen (no gradient, no optimizer state); None: all. `dpo`: the
        batches are preference pairs, and the objective is DPO's (`training.dpo`) against
        a reference model (`dpo.Reference`)."""
        self.model, self.layout, self.mesh = model, layout, mesh
        # Whether the model's kernels want each batch's packing (`models.base`).
        self.uses_packing = bool(getattr(model, "uses_packing", False))
        self.loss_config = loss_config or LossConfig()
        if batch_size % num_microbatches:
            raise ConfigError(f"batch_size {batch_size} is not divisible into "
                              f"{num_microbatches} microbatches")
        self.num_microbatches = num_microbatches
        self.batch_shape = (batch_size, sequence_length)
        self.seed = seed
        init_key, self.dropout_key = jax.random.split(jax.random.key(seed))
        self.init_key = init_key

        boxed = jax.eval_shape(self._init_variables, init_key)
        self.param_names = param_names = nn.get_partition_spec(boxed)["params"]
        abstract_params = nn.unbox(boxed)["params"]
        self.trainable = trainable or (lambda path: True)
        self.frozen = trainable is not None
        if self.frozen and not any(map(trainable, parameters.paths(abstract_params))):
            raise ConfigError("no parameter of the model trains (run.trainable, or the LoRA "
                              "targets, match none)")
        # What the optimizer sees: the trainable parameters (all of them, unless frozen).
        self.trained_names = parameters.select(param_names, self.trainable)
        self.dpo = dpo
        trained = parameters.select(abstract_params, self.trainable)
        self.given_optimizer = optimizer  # (for `with_layout`)
        self.optimizer = optimizer_lib.for_parameters(optimizer, self.trained_names)
        # Parameters and optimizer state are stored by the parameter layout rules too.
        param_shardings = tree_shardings(layout, mesh, param_names, abstract_params, True)
        abstract_opt = jax.eval_shape(self.optimizer.init, trained)
        opt_names = optimizer_lib.state_names(abstract_opt, trained, self.trained_names)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.state_shardings = TrainState(
            step=replicated,
            params=param_shardings,
            opt_state=tree_shardings(layout, mesh, opt_names, abstract_opt, True),
        )
        self.abstract_state = TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=abstract_opt
        )
        self.batch_sharding = layout.sharding(mesh, BATCH_NAMES, self.batch_shape, tensor="batch")
        self.length_order = context.length_order(sequence_length, layout, model.features)
        layout.check_rules_used()  # every parameter and activation has been laid out above
        logits_per_device = math.prod(  # of one microbatch
            -(-size // layout.ways(name)) for name, size in
            [("batch", batch_size // num_microbatches), ("length", sequence_length),
             ("vocab", model.config.vocab_size)])
        self.loss_chunks = self.loss_config.num_chunks(sequence_length, logits_per_device)
        self._init_state = jax.jit(self._init_fn, out_shardings=self.state_shardings)
        self._start_from = jax.jit(
            lambda params: self._start_fn(jax.tree.map(
                lambda p, a: p.astype(a.dtype), params, self.abstract_state.params)),
            in_shardings=(param_shardings,), out_shardings=self.state_shardings)
        # DPO's reference model (its copy of the parameters a third argument of the steps)
        self.reference = dpo_lib.Reference(model, abstract_params, self.trainable,
                                           param_shardings) if dpo else None
        reference = self.reference.shardings if dpo else ()
        self._train_step = jax.jit(
            self._train_step_fn,
            in_shardings=(self.state_shardings, self.batch_sharding, *reference),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )
        self._eval_step = jax.jit(
            self._eval_step_fn,
            in_shardings=(self.state_shardings.params, self.batch_sharding, *reference),
            out_shardings=replicated,
        )
        self._token_log_likelihoods = jax.jit(
            self._token_log_likelihoods_fn,
            in_shardings=(self.state_shardings.params, self.batch_sharding),
            out_shardings=replicated,
        )

    # ---- pure functions (traced under the layout) ----

    def _dummy_batch(self, shape=None):
        ids = jnp.zeros(shape or self.batch_shape, jnp.int32)
        return {name: ids for name in batch_keys(self.model.features)}

    def apply_model(self, params, batch, deterministic, rngs=None, return_hidden=False,
               stats=False, model=None):
        """The model's logits for a packed batch (its `features`, each with segment ids and
        positions); with `return_hidden` its final hidden states and output kernel. The
        batch's packing, if it carries one, is the model's `current_packing()`. With
        `stats`, ``(out, statistics)``: its experts' (`moe.summary`; {} without).
        `model`: another than the trainer's (DPO's reference)."""
        args = [batch[name] for name in batch_keys(self.model.features)]
        kwargs = {"return_hidden": True} if return_hidden else {}
        if READ_INPUTS in batch:  # the tokens read before the targets, as the data gives
            kwargs["inputs"] = batch[READ_INPUTS]
        with packed_rows(getattr(batch, "packing", None)):
            out = (model or self.model).apply(
                {"params": params}, *args, deterministic=deterministic, rngs=rngs,
                mutable=[moe.STATS] if stats else False, **kwargs)
        if not stats:
            return out
        out, variables = out
        return out, moe.summary(variables.get(moe.STATS, {}))

    def _init_variables(self, key):
        with self.layout.activate(self.mesh):
            return self.model.init(key, *self._dummy_batch().values())

    def _init_fn(self, key):
        """The initial state. The model's forward pass, which `init` runs to create the
        parameters, runs on one token (the parameters' shapes and values do not depend on
        the batch; their shardings are the jit's `out_shardings`), so that compiling the
        initialisation costs little whatever the model; the key is an argument, not a
        constant folded into every parameter's random number generator."""
        variables = self.model.init(key, *self._dummy_batch((1, 1)).values())
        return self._start_fn(nn.unbox(variables)["params"])

    def _start_fn(self, params):
        """Step 0 at `params`, with the optimizer's state initialised from them."""
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=self.optimizer.init(self.split(params)[0]))

    def split(self, params) -> tuple[Any, Any]:
        """(the trainable parameters, the frozen ones) of `params` (`freezing`)."""
        return freezing.split(params, self.trainable) if self.frozen else (params, {})

    def _losses(self, params, batch, deterministic, rngs=None):
        """(loss, xent, weights, logits) per token; see `losses.cross_entropy`."""
        return losses.token_losses(self.apply_model(params, batch, deterministic, rngs), batch,
                                   self.loss_config, self.classes)

    @property
    def classes(self) -> int:
        """The model's real vocabulary rows (its config's `real_vocab_size`; 0: all)."""
        return getattr(self.model.config, "real_vocab_size", 0)

    def _loss_sums(self, params, batch, rngs, reference=None):
        """(loss, cross-entropy, count, tokens, statistics) summed over the training
        `batch` (`losses.token_sums`; with DPO, `dpo.sums`), to add up over microbatches."""
        if self.dpo:
            return dpo_lib.sums(self, params, batch, rngs, reference)
        out, stats = self.apply_model(params, batch, False, rngs, self.loss_chunks > 1, stats=True)
        return losses.token_sums(out, stats, batch, self.loss_config, self.loss_chunks,
                                 self.classes)

    def _gradients(self, params, batch: Batch, rngs, normalize: bool, frozen=None,
                   reference=None):
        """(gradient, loss, cross-entropy, count, tokens, statistics) of `batch`: of the
        mean loss (per token; DPO's per pair: `count` of them) with `normalize`
        (statistics: means), else of the sums (to add up). `params` are the trainable
        parameters, `frozen` the others (none: `params` are all); `reference` DPO's copy."""
        def loss_fn(params):
            if frozen:
                params = parameters.merge(frozen, params)
            loss, xent, count, tokens, stats = self._loss_sums(params, batch, rngs, reference)
            scale = 1.0 / jnp.maximum(count, 1.0) if normalize else 1.0
            stats = {k: v * scale for k, v in stats.items()}
            return loss * scale, (xent * scale, count, tokens, stats)

        (loss, (xent, count, tokens, stats)), grads = jax.value_and_grad(
            loss_fn, has_aux=True)(params)
        # Laid out as the parameters are stored: under parameter layout rules (FSDP) each
        # device keeps (and accumulates over microbatches) only its shard of the sum.
        grads = jax.tree_util.tree_map(
            lambda names, g: constrain(g, logical_names(names, g.ndim), "gradient", parameter=True),
            self.trained_names, grads, is_leaf=is_names)
        return grads, loss, xent, count, tokens, stats

    def gradients(self, params, batch: Batch, dropout_key, frozen=None, reference=None):
        """The gradient of the mean token loss of `batch` (and the loss, cross-entropy, token
        count and the model's statistics: `_loss_sums`), accumulated over `num_microbatches`
        slices of it, one at a time. Microbatch j holds rows j, j + k, j + 2k, ... so that
        every device keeps working on its own rows. With `frozen` parameters, `params` are
        the trainable ones (`split`), and the gradient is theirs. `reference`: DPO's copy of
        the reference model's parameters, where it keeps one."""
        k = self.num_microbatches
        if k == 1:
            grads, loss, xent, _, tokens, stats = self._gradients(
                params, batch, {"dropout": dropout_key}, True, frozen, reference)
            return grads, loss, xent, tokens, stats
        micro = {name: constrain(x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1),
                                 (None, *BATCH_NAMES))
                 for name, x in batch.items()}
        micro = batch.like(micro) if isinstance(batch, PlacedBatch) else micro

        def step(total, inputs):
            i, microbatch = inputs
            out = self._gradients(params, microbatch,
                                  {"dropout": jax.random.fold_in(dropout_key, i)}, False,
                                  frozen, reference)
            return jax.tree_util.tree_map(jnp.add, total, out), None

        zeros = jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(
            lambda p, b: self._gradients(p, b, {"dropout": dropout_key}, False, frozen,
                                         reference), params,
            jax.tree_util.tree_map(lambda x: x[0], micro)))
        (grads, loss, xent, count, tokens, stats), _ = jax.lax.scan(
            step, zeros, (jnp.arange(k), micro))
        # The mean over the batch's tokens (pairs), however it was sliced.
        scale = 1.0 / jnp.maximum(count, 1.0)
        grads, stats = jax.tree_util.tree_map(lambda g: g * scale, (grads, stats))
        return grads, loss * scale, xent * scale, tokens, stats

    def _train_step_fn(self, state: TrainState, batch: Batch, reference=None):
        with self.layout.activate(self.mesh):
            dropout_key = jax.random.fold_in(self.dropout_key, state.step)
            trained, frozen = self.split(state.params)
            grads, loss, xent, tokens, stats = self.gradients(trained, batch, dropout_key,
                                                              frozen, reference)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, trained)
            params = optax.apply_updates(trained, updates)
            if frozen:
                params = parameters.merge(state.params, params)
        metrics = step_metrics(grads, loss, xent, tokens, stats)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def _eval_step_fn(self, params, batch: Batch, reference=None):
        if self.dpo:  # sums over the pairs, for the mean over the split
            with self.layout.activate(self.mesh):
                return dpo_lib.eval_sums(self, params, batch, reference)
        with self.layout.activate(self.mesh):
            _, xent, weights, logits = self._losses(params, batch, True)
            correct = (jnp.argmax(logits, axis=-1) == batch["targets"]) & weights
        return {
            "xent_sum": xent.sum(),
            "correct": correct.sum().astype(jnp.float32),
            "num_tokens": weights.sum().astype(jnp.float32),
        }

    def _token_log_likelihoods_fn(self, params, batch: Batch):
        with self.layout.activate(self.mesh):
            _, xent, weights, _ = self._losses(params, batch, True)
        return jnp.where(weights, -xent, 0.0)

    # ---- the public API ----

    def sharded_abstract_state(self) -> TrainState:
        """The state as shapes with their shardings: what checkpoints restore into and
        ahead-of-time compilation takes, with nothing allocated."""
        return with_shardings(self.abstract_state, self.state_shardings)

    def abstract_batch(self, batch: PlacedBatch | None = None) -> PlacedBatch:
        """A batch as shapes with its sharding (for ahead-of-time compilation): that of `batch`
        (placed, with its packing), else the model's features (and DPO's) unpacked."""
        if batch is not None:
            return jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
        ids = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)
        keys = batch_keys(self.model.features) + ([READ_INPUTS, LOSS_WEIGHTS] if self.dpo else [])
        return PlacedBatch({name: ids for name in keys})

    def with_layout(self, layout: Layout) -> "Trainer":
        """The same model, optimizer, batch, seed and settings on another layout (over the
        first `layout.size` devices)."""
        return Trainer(self.model, self.given_optimizer, layout,
                       layout.make_mesh(jax.devices()[:layout.size]), *self.batch_shape,
                       seed=self.seed, loss_config=self.loss_config,
                       num_microbatches=self.num_microbatches,
                       trainable=self.trainable if self.frozen else None, dpo=self.dpo)

    def init_state(self) -> TrainState:
        """A freshly initialised state, created directly in its shards."""
        return self._init_state(self.init_key)

    def start_from(self, params) -> TrainState:
        """Step 0 at `params` (an import's, another run's: a tree of arrays shaped as the
        model's, wherever they lie, converted to its dtypes) with a fresh optimizer state,
        laid out as the state is: fine-tuning's start. The arrays given are not consumed."""
        shapes = lambda tree: {jax.tree_util.keystr(p): tuple(np.shape(x)) for p, x in  # noqa: E731
                               jax.tree_util.tree_leaves_with_path(tree)}
        given, model = shapes(params), shapes(self.abstract_state.params)
        if given != model:
            name = min(k for k in given.keys() | model.keys() if given.get(k) != model.get(k))
            raise ValueError(f"start_from: parameter {name} is {given.get(name, 'missing')}, "
                             f"the model's is {model.get(name, 'not there')}")
        return self._start_from(jax.device_put(params, self.state_shardings.params))

    def local_rows(self) -> tuple[int, int]:
        """The rows [start, stop) of the global batch that this process's devices hold, and
        so the rows it must feed: all of them with one process, or when the hosts split only
        the model; 1/P of them each when P hosts lie along the batch dimension."""
        return local_rows(self.batch_sharding, self.batch_shape)

    def place_batch(self, batch: dict[str, np.ndarray]) -> PlacedBatch:
        """This process's rows of a global batch (`local_rows`) -> global arrays sharded
        along ``batch``, with its packing where the model asks for it. The model may refuse
        a batch first (its `check_batch`: a `DataError`). Rows in `length_order` (`place`)."""
        if hasattr(self.model, "check_batch"):
            self.model.check_batch(batch)
        return place(batch, self.batch_sharding, self.batch_shape,
                     packing_of(batch) if self.uses_packing else None, self.length_order,
                     getattr(self.model.config, "start_id", 0))

    def _reference(self) -> tuple:
        """The steps' arguments after the batch: DPO's reference copy, where it keeps one."""
        return self.reference.arguments() if self.dpo else ()

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        return self._train_step(state, batch, *self._reference())

    # ---- what the training loop needs of a stepper (`training.loop.Stepper`) ----

    def start(self, state: TrainState) -> TrainState:
        return state

    def train_state(self, state: TrainState) -> TrainState:
        return state

    def eval_params(self, state: TrainState):
        return state.params

    def log_metrics(self, state: TrainState) -> dict:
        return {}

    def lower_train_step(self, batch: PlacedBatch | None = None):
        """The train step lowered from abstract state and batch (nothing allocated; the
        batch's shapes and packing are `batch`'s if given): its `.as_text()` is the HLO, its
        `.compile()` the program the planner measures."""
        state = self.sharded_abstract_state()  # (and DPO's copy of the parameters, shaped so)
        return self._train_step.lower(state, self.abstract_batch(batch), *(
            (state.params,) if self.dpo and self.reference.needs_copy else ()))

    def compile_train_step(self, batch: PlacedBatch | None = None):
        """The train step compiled ahead of time from abstract shapes (see
        `lower_train_step`)."""
        return self.lower_train_step(batch).compile()

    def eval_step(self, params, batch: Batch) -> dict:
        return self._eval_step(params, batch, *self._reference())

    def token_log_likelihoods(self, params, batch: Batch) -> jax.Array:
        """log p(target token) at every position of `batch` [batch, length] (0 at padding),
        the same numbers whose negated sum is `eval_step`'s ``xent_sum``; on every process."""
        out = self._token_log_likelihoods(params, batch)
        return out if self.length_order is None else out[:, np.argsort(self.length_order)]
