"""Sharded training state and the jitted train and eval steps of an objective.

What the steps minimise and evaluate is the `objective` a `Trainer` is given
(`training.objective`: language modelling by default, DPO for preference pairs): it owns the
batch's keys, the sums over a batch, the metrics, and any state of its own that the steps
take as arguments after the batch. The trainer differentiates, steps, shards and loops
without knowing which objective it runs.

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

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtrain.errors import ConfigError
from mtrain.models import balancing, context, moe, parameters
from mtrain.models.base import READ_INPUTS, batch_keys, packed_rows, packing_of
from mtrain.models.quantization import is_meta, updated_meta, with_fresh_meta
from mtrain.parallel.layout import Layout, tree_shardings
from mtrain.training import freezing
from mtrain.training import optimizer as optimizer_lib
from mtrain.training.gradients import mean_gradient
from mtrain.training.language_modeling import LanguageModeling
from mtrain.training.objective import Objective, Setting, classes
from mtrain.training.placement import BATCH_NAMES, PlacedBatch, local_rows, place
from mtrain.training.state import TrainState, step_metrics, with_shardings

Batch = dict[str, Any]


class Trainer:
    """Builds the sharded state and the jitted steps for one model, optimizer, objective and
    layout."""

    def __init__(self, *, model: nn.Module, optimizer: optax.GradientTransformation,
                 layout: Layout, mesh: Mesh, batch_size: int, sequence_length: int,
                 objective: Objective | None = None, seed: int = 0, num_microbatches: int = 1,
                 trainable: freezing.Predicate | None = None):
        """`objective` (`training.objective`; default `LanguageModeling()`): what the steps
        minimise and evaluate, bound to this trainer (`objective`). `num_microbatches` > 1
        accumulates the gradient over that many slices of the batch (Mesh-TF's
        serialize_num_microbatches): the same update, a fraction of the activation memory.
        `optimizer` is told which parameters are a scanned stack's
        (`optimizer.for_parameters`), so that its per-tensor statistics are each layer's.
        `trainable` (a predicate of a parameter's path, `freezing`): the parameters that
        train, the others frozen (no gradient, no optimizer state); None: all. The experts'
        choice biases are never the optimizer's: each step moves them by the experts' loads
        (`balancing`), which they change in training wherever the rate is set."""
        self.model, self.layout, self.mesh = model, layout, mesh
        # Whether the model's kernels want each batch's packing (`models.base`).
        self.uses_packing = bool(getattr(model, "uses_packing", False))
        if batch_size % num_microbatches:
            raise ConfigError(f"batch_size {batch_size} is not divisible into "
                              f"{num_microbatches} microbatches")
        self.num_microbatches = num_microbatches
        self.batch_shape = (batch_size, sequence_length)
        self.seed = seed
        self.init_key, self.dropout_key = jax.random.split(jax.random.key(seed))
        boxed = jax.eval_shape(self._init_variables, self.init_key)
        self.param_names = nn.get_partition_spec(boxed)["params"]
        abstract_params = nn.unbox(boxed)["params"]
        self.bias_update_rate = balancing.update_rate(model)
        trains, optimized = balancing.optimized(trainable or (lambda path: True),
                                                self.bias_update_rate)
        # Delayed fp8 scaling's state changes in training (a checkpoint keeps it) but is
        # no optimizer's: each step writes its new value over it (`_train_step_fn`).
        self.trainable = lambda path: trains(path) or is_meta(path)
        self.optimized = lambda path: optimized(path) and not is_meta(path)
        self.frozen = trainable is not None
        paths = parameters.paths(abstract_params)
        if self.frozen and not any(map(self.optimized, paths)):
            raise ConfigError("no parameter of the model trains (run.trainable, or the LoRA "
                              "targets, match none)")
        # Whether the optimizer sees a part of the parameters (frozen ones, choice biases).
        self.partial = not all(map(self.optimized, paths))
        # What the optimizer sees: the trainable parameters (all of them, unless frozen).
        self.trained_names = parameters.select(self.param_names, self.optimized)
        self.given_optimizer = optimizer  # (for `with_layout`)
        self.optimizer = optimizer_lib.for_parameters(optimizer, self.trained_names)
        self._lay_out_state(abstract_params)
        self.batch_sharding = layout.sharding(mesh, BATCH_NAMES, self.batch_shape, tensor="batch")
        self.length_order = context.length_order(sequence_length, layout, model.features)
        layout.check_rules_used()  # every parameter and activation has been laid out above
        self.given_objective = objective or LanguageModeling()  # (unbound: `with_layout`)
        self.objective = self.given_objective.bind(Setting(
            model=model, layout=layout, mesh=mesh, batch_shape=self.batch_shape,
            num_microbatches=num_microbatches, abstract_params=abstract_params,
            param_shardings=self.state_shardings.params, trainable=trains,
            apply=self.apply_model))
        self.loss_chunks = self.objective.loss_chunks  # (the planner's)
        self._jit_steps()

    def _lay_out_state(self, abstract_params) -> None:
        """The state's shapes and shardings: parameters and optimizer state are stored by
        the parameter layout rules too."""
        trained = parameters.select(abstract_params, self.optimized)
        param_shardings = tree_shardings(self.layout, self.mesh, self.param_names,
                                         abstract_params, True)
        abstract_opt = jax.eval_shape(self.optimizer.init, trained)
        opt_names = optimizer_lib.state_names(abstract_opt, trained, self.trained_names)
        self.state_shardings = TrainState(
            step=NamedSharding(self.mesh, PartitionSpec()), params=param_shardings,
            opt_state=tree_shardings(self.layout, self.mesh, opt_names, abstract_opt, True))
        self.abstract_state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32),
                                         params=abstract_params, opt_state=abstract_opt)

    def _jit_steps(self) -> None:
        """The jitted init, start, train, eval and scoring steps; the train and eval steps
        take the objective's arguments after the batch (`Objective.arguments`)."""
        shardings, replicated = self.state_shardings, NamedSharding(self.mesh, PartitionSpec())
        extra = self.objective.argument_shardings()
        self._init_state = jax.jit(self._init_fn, out_shardings=shardings)
        self._start_from = jax.jit(
            lambda params: self._start_fn(jax.tree.map(
                lambda p, a: p.astype(a.dtype), params, self.abstract_state.params)),
            in_shardings=(shardings.params,), out_shardings=shardings)
        self._train_step = jax.jit(
            self._train_step_fn, in_shardings=(shardings, self.batch_sharding, *extra),
            out_shardings=(shardings, replicated), donate_argnums=0)
        self._eval_step = jax.jit(
            self._eval_step_fn, in_shardings=(shardings.params, self.batch_sharding, *extra),
            out_shardings=replicated)
        self._token_log_likelihoods = jax.jit(
            self._token_log_likelihoods_fn,
            in_shardings=(shardings.params, self.batch_sharding), out_shardings=replicated)

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
        `model`: another than the trainer's (one an objective keeps, as DPO's frozen model).
        The objective's `Setting.apply`."""
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
        """(the parameters the optimizer takes, the others) of `params` (`freezing`)."""
        return freezing.split(params, self.optimized) if self.partial else (params, {})

    @property
    def classes(self) -> int:
        """The model's real vocabulary rows (its config's `real_vocab_size`; 0: all)."""
        return classes(self.model)

    def gradients(self, params, batch: Batch, dropout_key, frozen=None, arguments=(),
                  meta=None):
        """The gradient of the objective's mean loss over `batch` (and the loss,
        cross-entropy, tokens and statistics: `Objective.loss_sums`), accumulated over
        `num_microbatches` slices of it (`gradients.mean_gradient`). With `frozen`
        parameters, `params` are the trainable ones (`split`), and the gradient is theirs.
        `arguments`: the objective's (`Objective.arguments`). With `meta` (delayed fp8
        scaling's state, out of `frozen`), its new value comes after the statistics."""
        out = mean_gradient(
            lambda params, batch, rngs: self.objective.loss_sums(params, batch, rngs, *arguments),
            params, batch, dropout_key, self.num_microbatches, self.trained_names, frozen, meta)
        return out if meta is not None else out[:-1]

    def _train_step_fn(self, state: TrainState, batch: Batch, *arguments):
        with self.layout.activate(self.mesh):
            dropout_key = jax.random.fold_in(self.dropout_key, state.step)
            trained, frozen = self.split(state.params)
            meta = parameters.select(frozen, is_meta)
            frozen = parameters.select(frozen, lambda path: not is_meta(path))
            grads, loss, xent, tokens, stats, new_meta = self.gradients(
                trained, batch, dropout_key, frozen, arguments, meta)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, trained)
            params = optax.apply_updates(trained, updates)
            if self.partial:
                params = parameters.merge(state.params, params)
            metrics = step_metrics(grads, loss, xent, tokens, stats)
            if meta:
                params = parameters.merge(params, updated_meta(meta, new_meta,
                                                               metrics["finite"] > 0))
            params = balancing.balance(params, stats, self.bias_update_rate,
                                       metrics["finite"] > 0)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def _eval_step_fn(self, params, batch: Batch, *arguments):
        with self.layout.activate(self.mesh):  # sums, for the means over the split
            return self.objective.eval_sums(params, batch, *arguments)

    def _token_log_likelihoods_fn(self, params, batch: Batch):
        with self.layout.activate(self.mesh):
            return self.objective.token_log_likelihoods(params, batch)

    # ---- the public API ----

    def sharded_abstract_state(self) -> TrainState:
        """The state as shapes with their shardings: what checkpoints restore into and
        ahead-of-time compilation takes, with nothing allocated."""
        return with_shardings(self.abstract_state, self.state_shardings)

    def abstract_batch(self, batch: PlacedBatch | None = None) -> PlacedBatch:
        """A batch as shapes with its sharding (for ahead-of-time compilation): that of `batch`
        (placed, with its packing), else the objective's keys (`Objective.batch_keys`)
        unpacked."""
        if batch is not None:
            return jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
        floats = self.objective.float_keys
        return PlacedBatch({name: jax.ShapeDtypeStruct(
            self.batch_shape, jnp.float32 if name in floats else jnp.int32,
            sharding=self.batch_sharding) for name in self.objective.batch_keys(
                self.model.features)})

    def with_layout(self, layout: Layout) -> "Trainer":
        """The same model, optimizer, objective, batch, seed and settings on another layout
        (over the first `layout.size` devices; the objective's own state fresh)."""
        batch_size, sequence_length = self.batch_shape
        return Trainer(model=self.model, optimizer=self.given_optimizer,
                       objective=self.given_objective, layout=layout,
                       mesh=layout.make_mesh(jax.devices()[:layout.size]),
                       batch_size=batch_size, sequence_length=sequence_length, seed=self.seed,
                       num_microbatches=self.num_microbatches,
                       trainable=self.trainable if self.frozen else None)

    def init_state(self) -> TrainState:
        """A freshly initialised state, created directly in its shards."""
        return self._init_state(self.init_key)

    def start_from(self, params) -> TrainState:
        """Step 0 at `params` (an import's, another run's: a tree of arrays shaped as the
        model's, wherever they lie, converted to its dtypes) with a fresh optimizer state,
        laid out as the state is: fine-tuning's start. The arrays given are not consumed."""
        params = with_fresh_meta(params, self.abstract_state.params)  # (an import has none)
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

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        return self._train_step(state, batch, *self.objective.arguments())

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
        return self._train_step.lower(self.sharded_abstract_state(), self.abstract_batch(batch),
                                      *self.objective.abstract_arguments())

    def compile_train_step(self, batch: PlacedBatch | None = None):
        """The train step compiled ahead of time from abstract shapes (see
        `lower_train_step`)."""
        return self.lower_train_step(batch).compile()

    def eval_step(self, params, batch: Batch) -> dict:
        """The objective's sums over `batch` (`Objective.eval_sums`), on every process."""
        return self._eval_step(params, batch, *self.objective.arguments())

    def token_log_likelihoods(self, params, batch: Batch) -> jax.Array:
        """log p(target token) at every position of `batch` [batch, length] (0 at padding;
        of a language model, the numbers whose negated sum is `eval_step`'s ``xent_sum``:
        `Objective.token_log_likelihoods`); on every process."""
        out = self._token_log_likelihoods(params, batch)
        return out if self.length_order is None else out[:, np.argsort(self.length_order)]
