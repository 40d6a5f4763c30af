"""mtrain's model for EleutherAI's lm-evaluation-harness (lm-eval 0.4): a `TemplateLM`
registered as ``mtrain``, which computes with a trained or imported model in the layout it
was given, one device or many.

    lm = MtrainLM(model=Model(trainer=..., params=..., vocab=...))
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

or from a model dir: ``python -m mtrain --mode=lm_eval`` (`modes.lm_eval`), lm-eval's own
command line through ``mtrain-lm-eval`` and ``simple_evaluate(model="mtrain",
model_args="model_dir=runs/x")`` once `mtrain.harness_cli` is imported.

Every request is made into ids as the harness's own Hugging Face backend makes it
(`harness_requests`): loglikelihood (batched and sorted by length: `harness_scoring`),
loglikelihood_rolling (windows of `max_length`) and generate_until (`generation.Generator`
with its prefill: greedy, or sampled at the request's temperature; stop strings, also
inside a token, and ``max_gen_toks``); ``--apply_chat_template`` renders with the model
dir's chat template. `max_length` is the model's ``transformer.max_length`` (Hugging Face's
``max_position_embeddings``) unless given.

Several processes (``python -m mtrain --mode=lm_eval`` started on each host) all read every
request; each feeds its rows of every batch (the batch is split over the hosts as a training
batch is) and every process gets every result.
"""

from __future__ import annotations

import dataclasses
import json

import lm_eval.models  # noqa: F401  (lm-eval's models registered before ours: harness_cli)
import jax
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (Collator, handle_stop_sequences, has_bos_prefix,
                                  normalize_gen_kwargs)
from tqdm import tqdm

from mtrain.errors import ConfigError
from mtrain.evaluation import harness_requests as requests_lib
from mtrain.evaluation.generation import Generator, Prompt
from mtrain.evaluation.harness_requests import Row
from mtrain.evaluation.harness_scoring import Scorer
from mtrain.evaluation.translation import DecodingConfig

NAME = "mtrain"
# The attention scores a scoring call holds per batch shard on a CPU (`harness_scoring`):
# two rows of 512 (measured on 2 cores: 13 ms a row of 512 in calls of 2, 31 ms in calls of 8).
CPU_SCORES = 2 * 512 ** 2
DEFAULT_MAX_GEN_TOKS = 256  # as the Hugging Face backend's


@dataclasses.dataclass
class Model:
    """What the harness's model computes with: a trainer (model, layout, mesh) and its
    parameters, the vocabulary and chat template (None: none), `rows` a batch, positions
    `max_length` a row at most, and the seed of sampled generations."""

    trainer: object
    params: object
    vocab: object
    template: object = None
    rows: int = 8
    max_length: int = 2048
    seed: int = 0


class MtrainLM(TemplateLM):
    """lm-eval's model backed by mtrain (module doc), around a loaded `Model`; from a model
    dir with lm-eval's model_args: `mtrain.harness_cli.ModelArgsLM`."""

    def __init__(self, model: Model):
        super().__init__()
        self.model = model
        self.vocab = model.vocab
        self.scorer = Scorer(model.trainer, rows=model.rows, max_length=model.max_length,
                             scores_per_call=CPU_SCORES if jax.default_backend() == "cpu"
                             else None)
        self._generators: dict[tuple, Generator] = {}
        self._eos_text = self.vocab.decode_published([self.vocab.eos_id],
                                                     skip_special_tokens=False)

    # ---- tokens, as the Hugging Face backend makes them ----

    @property
    def eot_token_id(self) -> int:
        return self.vocab.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and a document's first window read first: the token the
        model reads before every sequence (`TransformerConfig.start_id`: an import's BOS,
        else its EOS, as lm-eval's hf backend reads them; mtrain's own models' 0)."""
        start = getattr(self.model.trainer.model.config, "start_id", None)
        return requests_lib.prefix_id(self.vocab) if start is None else start

    @property
    def max_length(self) -> int:
        return self.model.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        ids = requests_lib.encode(self.vocab, string, self.prefix_token_id, add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.vocab.decode_published(tokens, skip_special_tokens=skip_special_tokens)

    # ---- the three request types ----

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """(log-likelihood, is greedy) of each ((context, continuation), context ids,
        continuation ids)."""
        rows = [Row.of(context, continuation, self.max_length)
                for _, context, continuation in requests]
        out = self.scorer(self.model.params, rows)
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood: the sum over its windows (`rolling_rows`)."""
        windows = [requests_lib.rolling_rows(self.tok_encode(string), self.prefix_token_id,
                                             self.max_length)
                   for (string,) in (r.args for r in requests)]
        scores = iter(self.scorer(self.model.params, [w for doc in windows for w in doc]))
        out = [sum(next(scores)[0] for _ in doc) for doc in windows]
        for request, total in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each (context, generation kwargs) continued and cut at its stop strings; the
        requests with the same kwargs go together, longest first, a batch at a time."""
        order = Collator([r.args for r in requests], group_by="gen_kwargs",
                         group_fn=lambda args: args[1],
                         sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]))
        out = []
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for chunk in order.get_batched(n=self.model.rows):
            contexts, kwargs = zip(*chunk)
            out += self._generate(list(contexts), kwargs[0])
            progress.update(len(chunk))
        progress.close()
        out = order.get_original(out)
        for request, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self._eos_text)
        max_gen_toks = kwargs.pop("max_gen_toks")
        if not 0 < max_gen_toks < self.max_length:
            raise ConfigError(f"max_gen_toks={max_gen_toks} leaves no room for a prompt in "
                              f"{self.max_length} positions (max_length)")
        sampled = kwargs.get("do_sample") and kwargs.get("temperature", 0.0) > 0
        generator = self._generator(max_gen_toks, float(kwargs["temperature"]) if sampled else 0.0,
                                    int(kwargs.get("top_k") or 0) if sampled else 0,
                                    float(kwargs.get("top_p") or 1.0) if sampled else 1.0)
        prompts = [Prompt(tuple(self._prompt(c, max_gen_toks)), self.vocab.eos_id)
                   for c in contexts]
        new = generator.continuations(self.model.params, *generator.encode_batch(prompts))
        return [requests_lib.generated_text(self.vocab, ids, until) for ids in new]

    def _prompt(self, context: str, max_gen_toks: int) -> list[int]:
        """The ids a generation reads (the backend's `tok_batch_encode`: no special tokens
        for a text that starts with the BOS's), the last `max_length - max_gen_toks`."""
        bos = self.vocab.bos_id
        starts = bos is not None and has_bos_prefix(
            context, self.vocab.decode_published([bos], skip_special_tokens=False))
        ids = self.vocab.encode_published(context, add_special_tokens=not starts)
        return ids[-(self.max_length - max_gen_toks):] or [self.prefix_token_id]

    def _generator(self, max_gen_toks: int, temperature: float, top_k: int,
                   top_p: float) -> Generator:
        key = (max_gen_toks, temperature, top_k, top_p)
        if key not in self._generators:
            config = DecodingConfig(beam_size=1, max_decode_length=max_gen_toks,
                                    batch_size=self.scorer.rows, temperature=temperature,
                                    top_k=top_k, top_p=top_p, prefill=True)
            self._generators[key] = Generator(self.model.trainer, self.vocab, config,
                                              self.model.seed, length=self.max_length)
        return self._generators[key]

    # ---- chat templates ----

    @property
    def tokenizer_name(self) -> str:
        return f"mtrain-{self.vocab.digest}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        template = self.model.template
        return template.source if chat_template and template is not None else None

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the model dir's chat template, as text."""
        if self.model.template is None:
            raise ConfigError("--apply_chat_template: the model dir has no chat template "
                              "(an import keeps its folder's; or train from one that has)")
        return self.model.template.render(chat_history, add_generation_prompt)[0]


def flat_metrics(results: dict) -> dict[str, float]:
    """lm-eval's ``results`` ({task: {"acc,none": 0.5, "acc_stderr,none": 0.1, ...}}) as
    ``lm_eval/<task>/<metric>`` numbers (a filter other than "none" after the metric:
    ``exact_match/strict-match``); what is not a number is left out."""
    out = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
                continue
            name = metric if filter_name in ("", "none") else f"{metric}/{filter_name}"
            out[f"lm_eval/{task}/{name}"] = float(value)
    return out


def dumps(results: dict, indent: int | None = 2) -> str:
    """lm-eval's results (or a sample) as JSON (what is not JSON as its text)."""
    return json.dumps(results, indent=indent, default=str, ensure_ascii=False)
