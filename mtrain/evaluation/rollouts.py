"""GRPO's steps (`training.grpo`): sample each prompt's group of completions with mtrain's
own generator, score them, and update the policy on them.

`GrpoStepper` is the training loop's stepper for a task of prompts or rollouts
(`data.prompts`). For each step's `StepPrompts` it:

1. makes the generation's `Rollout`, on its first step: the step's prompts, each
   ``grpo.num_generations`` times, continued by `Generator` (prefill, the current
   parameters, temperature / top-p / top-k, at most ``grpo.max_completion_length`` new ids,
   ended by EOS or the chat template's end of turn), each row with its own key
   ``fold_in(fold_in(key(run.seed), generation), row)``: a function of the step, so a
   resumed run samples the same; or the records' completions and rewards
   (``files.format='rollouts'``). Then the rewards (`rewards.score`) and advantages
   (`grpo.advantages`), and with ``grpo.num_iterations`` > 1 the generating policy's
   log-probabilities (computed once, as TRL's "old" ones);
2. lays it out as a batch (`rows`: a row is [what is read first] + prompt + completion, the
   completion's targets carrying loss, each token its completion's advantage) and takes
   the trainer's step;
3. reports TRL's metrics: ``reward``, ``reward_std``, ``rewards/<name>/mean|std``,
   ``frac_reward_zero_std``, ``completions/mean_length``, ``completions/clipped_ratio``,
   ``kl``, ``entropy``, ``clip_ratio/*`` and ``generation_share`` (of the step's time).

The later steps of a generation train on its rollout again (`StepPrompts.keep` holds its
`Rollout.arrays`; a checkpoint saves them).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtrain.data.chat import ChatTemplate
from mtrain.data.prompts import PromptRecord, StepPrompts
from mtrain.data.vocabulary import Vocabulary
from mtrain.errors import ConfigError, DataError
from mtrain.evaluation import rewards as rewards_lib
from mtrain.evaluation.generation import Generator, Prompt
from mtrain.evaluation.translation import DecodingConfig
from mtrain.models.base import LOSS_WEIGHTS, READ_INPUTS
from mtrain.training import grpo
from mtrain.training.trainer import Trainer

log = logging.getLogger("mtrain")


@dataclasses.dataclass
class Rollout:
    """A generation's completions laid out as a global batch (`batch`: host arrays of the
    GRPO objective's keys), with each row's `rewards`, each reward function's
    (`per_function` [k, rows]), the completions' `lengths` and whether each `ended` (by its
    stop id), and the `seconds` its sampling took."""

    batch: dict
    rewards: np.ndarray
    per_function: np.ndarray
    lengths: np.ndarray
    ended: np.ndarray
    seconds: float = 0.0

    def arrays(self) -> dict:
        """What a checkpoint saves of it (`from_arrays` reads it back)."""
        return {**{f"batch.{k}": v for k, v in self.batch.items()}, "rewards": self.rewards,
                "per_function": self.per_function, "lengths": self.lengths,
                "ended": self.ended, "seconds": np.float64(self.seconds)}

    @classmethod
    def from_arrays(cls, arrays: dict) -> "Rollout":
        return cls(batch={k[len("batch."):]: v for k, v in arrays.items()
                          if k.startswith("batch.")},
                   rewards=arrays["rewards"], per_function=arrays["per_function"],
                   lengths=arrays["lengths"], ended=arrays["ended"],
                   seconds=float(arrays["seconds"]))


def rows(prompts: list[list[int]], completions: list[list[int]], advantages: np.ndarray,
         length: int, feature: str = "targets") -> dict:
    """The host batch of rows prompt + completion ([batch, `length`] each key): a prompt's
    first id is read first (`READ_INPUTS`), the rest and the completion are the targets,
    the completion's carrying loss and its `advantages`; a prompt too long keeps its end."""
    n = len(prompts)
    out = {k: np.zeros((n, length), np.int32) for k in (
        feature, f"{feature}_segment_ids", f"{feature}_positions", READ_INPUTS, LOSS_WEIGHTS)}
    out[grpo.ADVANTAGES] = np.zeros((n, length), np.float32)
    out[grpo.OLD_LOGPS] = np.zeros((n, length), np.float32)
    for r, (prompt, completion) in enumerate(zip(prompts, completions)):
        completion = completion[:length]
        prompt = prompt[-(length - len(completion) + 1):]
        tokens = list(prompt) + list(completion)
        t = len(tokens) - 1
        out[feature][r, :t] = tokens[1:]
        out[READ_INPUTS][r, :t] = tokens[:-1]
        out[f"{feature}_segment_ids"][r, :t] = 1
        out[f"{feature}_positions"][r, :t] = np.arange(t)
        out[LOSS_WEIGHTS][r, t - len(completion):t] = 1
        out[grpo.ADVANTAGES][r, :t] = advantages[r]
    return out


class GrpoStepper:
    """The training loop's stepper of a GRPO run (module doc), around `trainer` (whose
    objective is `grpo.Grpo`); `reads_rollouts`: its records hold their completions and
    rewards (``files.format='rollouts'``), else its rewards score what it samples."""

    def __init__(self, *, trainer: Trainer, vocab: Vocabulary, config: grpo.GrpoConfig,
                 seed: int = 0, template: ChatTemplate | None = None,
                 reads_rollouts: bool = False):
        self.trainer, self.vocab, self.config, self.seed = trainer, vocab, config, seed
        self.template = template
        rows_, length = trainer.batch_shape
        if rows_ % config.num_generations:
            raise ConfigError(f"run.batch_size={rows_} is not a whole number of groups of "
                              f"grpo.num_generations={config.num_generations}")
        self.prompts_per_step = rows_ // config.num_generations
        first, stop = trainer.local_rows()
        if first % config.num_generations or stop % config.num_generations:
            raise ConfigError(f"this process's rows {first}..{stop} of the batch split a group "
                              f"of grpo.num_generations={config.num_generations}")
        self.local = (first, stop)
        if config.max_completion_length >= length:
            raise ConfigError(f"grpo.max_completion_length={config.max_completion_length} "
                              f"leaves no room for a prompt in run.sequence_length={length}")
        self.generator = Generator(trainer, vocab, DecodingConfig(
            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
            max_decode_length=config.max_completion_length, prefill=True), seed)
        self.rewards = [rewards_lib.resolve(f) for f in config.rewards]
        if not self.rewards and not reads_rollouts:
            raise ConfigError("files.format='prompts' samples completions for grpo.rewards to "
                              "score: name at least one (grpo.rewards = [@matches()], ...)")
        # (a rollouts file's rewards are each completion's total: no function's own)
        self.names = [] if reads_rollouts else [rewards_lib.name_of(f) for f in self.rewards]

    def describe(self) -> str:
        c = self.config
        return (f"GRPO: {self.prompts_per_step} prompts x {c.num_generations} completions a "
                f"step (at most {c.max_completion_length} ids, temperature {c.temperature}), "
                f"{c.num_iterations} update(s) per generation, loss {c.loss!r}, beta {c.beta}")

    # ---- the prompts and completions ----

    def prompt_ids(self, record: PromptRecord) -> tuple[list[int], int]:
        """(the ids the model reads, the first one first; the id besides EOS that ends its
        completion) of a record's prompt (`data.prompts`)."""
        prompt, eos = record.prompt, self.vocab.eos_id
        if isinstance(prompt, str):
            first = self.vocab.bos_id if self.vocab.bos_id is not None else getattr(
                self.trainer.model.config, "start_id", 0)
            return [first] + self.vocab.encode(prompt), eos
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if self.template is None:
                raise DataError(f"{record.where}: a conversation needs a chat template: import "
                                f"a model that has one, or name files.chat_template")
            return self.template.prompt(prompt, where=record.where), self.template.end_of_turn
        return list(prompt), eos

    def as_read(self, ids: list[int]) -> list[int]:
        """A prompt's ids as the generator reads them: its first id, then (a prompt too long
        for the row) the last `Generator.kept` of the others, which leave room for the
        completion; the rows the update reads are the same."""
        kept = self.generator.kept
        return ids if len(ids) - 1 <= kept else [ids[0]] + ids[1:][-kept:]

    def completion_ids(self, completion, stop: int) -> list[int]:
        """A rollout file's completion: ids as given; a text encoded and ended by `stop`."""
        return list(completion) if isinstance(completion, list) else (
            self.vocab.encode(completion) + [stop])

    def text(self, ids: list[int], stop: int) -> str:
        """A completion's text for the rewards: without the id that ended it."""
        return self.vocab.decode([i for i in ids if i not in (stop, self.vocab.eos_id)])

    def sample(self, params, prompts: list[Prompt], generation: int) -> list[list[int]]:
        """The completions of the rows' `prompts` (the whole batch), by this generation's
        keys (module doc)."""
        ids, lengths, starts, stops = self.generator.encode_batch(prompts)
        key = jax.random.fold_in(jax.random.key(self.seed), generation)
        keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(len(prompts)))
        return self.generator.continuations(params, ids, lengths, starts, stops, keys=keys)

    def rollout(self, params, step: StepPrompts) -> Rollout:
        """The generation's `Rollout` of `step`'s records (module doc, 1)."""
        c, group = self.config, self.config.num_generations
        tick = time.perf_counter()
        read = [(self.as_read(p), stop) for p, stop in map(self.prompt_ids, step.records)]
        prompts = [p for p, _ in read for _ in range(group)]
        stops = [s for _, s in read for _ in range(group)]
        if step.records[0].completions is not None:  # rollouts from a file
            completions = [self.completion_ids(x, s) for r, (_, s) in zip(step.records, read)
                           for x in r.completions]
            total = np.array([x for r in step.records for x in r.rewards], np.float32)
            per = total[None, :]
        else:
            completions = self.sample(params, [Prompt(tuple(p), s) for p, s in
                                               zip(prompts, stops)], step.generation)
            texts = [self.text(x, s) for x, s in zip(completions, stops)]
            total, per = rewards_lib.score(
                self.rewards, c.weights, step.records,
                [texts[g * group:(g + 1) * group] for g in range(len(step.records))])
        ended = np.array([bool(x) and x[-1] in (s, self.vocab.eos_id)
                          for x, s in zip(completions, stops)])
        advantages = grpo.advantages(total, group, c.scale_rewards)
        batch = rows(prompts, completions, advantages, self.trainer.batch_shape[1])
        rollout = Rollout(batch, total, per, np.array([len(x) for x in completions]), ended,
                          time.perf_counter() - tick)
        if c.num_iterations > 1:  # the generating policy's log-probabilities, once
            logps = self.trainer.token_log_likelihoods(params, self.place(batch))
            rollout.batch[grpo.OLD_LOGPS] = np.asarray(jax.device_get(logps), np.float32)
        return rollout

    def place(self, batch: dict):
        first, stop = self.local
        return self.trainer.place_batch({k: v[first:stop] for k, v in batch.items()})

    # ---- the training loop's stepper (`training.loop.Stepper`) ----

    def start(self, state):
        return state

    def place_batch(self, batch: StepPrompts) -> StepPrompts:
        return batch  # (placed once its completions are made: `train_step`)

    def train_step(self, state, step: StepPrompts):
        began = time.perf_counter()
        if step.fresh:
            rollout = self.rollout(state.params, step)
            step.keep(rollout.arrays())
        elif step.pending is None:
            raise DataError(f"step {step.number + 1} trains on the rollout of step "
                            f"{step.number + 1 - step.number % self.config.num_iterations}, "
                            f"which the checkpoint does not hold")
        else:
            rollout = Rollout.from_arrays(step.pending)
        state, metrics = self.trainer.train_step(state, self.place(rollout.batch))
        metrics = grpo.token_means(metrics)
        jax.block_until_ready(metrics["loss"])
        seconds = rollout.seconds if step.fresh else 0.0
        return state, {**metrics, **self.reward_metrics(rollout),
                       "generation_share": seconds / max(time.perf_counter() - began, 1e-9)}

    def reward_metrics(self, rollout: Rollout) -> dict:
        """TRL's reward and completion metrics of a rollout."""
        group = self.config.num_generations
        r = rollout.rewards.astype(np.float64)
        out = {"reward": r.mean(), "reward_std": r.std(ddof=1) if r.size > 1 else 0.0,
               "frac_reward_zero_std": float(np.mean(
                   r.reshape(-1, group).std(axis=1) == 0)),
               "completions/mean_length": float(rollout.lengths.mean()),
               "completions/clipped_ratio": float(1.0 - rollout.ended.mean())}
        for name, values in zip(self.names, rollout.per_function.astype(np.float64)):
            out[f"rewards/{name}/mean"] = values.mean()
            out[f"rewards/{name}/std"] = values.std(ddof=1) if values.size > 1 else 0.0
        return out

    def train_state(self, state):
        return state

    def eval_params(self, state):
        return state.params

    def log_metrics(self, state) -> dict:
        return {}
