"""lm-evaluation-harness's requests as ids, made the way its Hugging Face backend (``--model
hf``, lm-eval 0.4) makes them, so that mtrain's backend (`harness`) scores and generates
what that backend would (../shared/oracles/README.md, "lm-evaluation-harness", lists the
rules; lm-eval's own helpers do what they can: rolling windows, stop strings, the cut at
them).

- Encoding leaves special tokens to the published tokenizer (Llama 3's adds its BOS, Qwen's
  nothing: `Vocabulary.encode_published`), except for a text that already begins with the
  prefix token's text (a rendered chat), which gets no second one (`encode`).
- A loglikelihood request (context ids, continuation ids) is scored as one row: the last
  ``max_length + 1`` ids of both, read up to the last, predicting from the second on; its
  continuation's ids are the ones summed (`Row.of`).
- A rolling request is split into windows of ``max_length`` predictions after the prefix
  token (`rolling_rows`), each a loglikelihood request.
- A generation runs greedy (or sampled) for ``max_gen_toks`` ids after the prompt's last
  ``max_length - max_gen_toks``; the Hugging Face backend stops once a stop string appears
  in the decoded last few ids (`kept_ids`) and cuts the text before the first stop string
  (`generated_text`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lm_eval.models.utils import has_bos_prefix, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window


def encode(vocab, text: str, prefix_id: int, add_special_tokens: bool | None = None
           ) -> list[int]:
    """`text`'s ids as the Hugging Face backend's `tok_encode`: the published tokenizer's
    special tokens (None: as it adds them), none where `text` starts with the prefix
    token's text already."""
    if add_special_tokens is None:
        add_special_tokens = not has_bos_prefix(
            text, vocab.decode_published([prefix_id], skip_special_tokens=False))
    return vocab.encode_published(text, add_special_tokens=add_special_tokens)


def prefix_id(vocab) -> int:
    """The id an empty context and a rolling window's first prediction read: the BOS, else
    the EOS (Qwen's <|endoftext|>)."""
    return vocab.bos_id if vocab.bos_id is not None else vocab.eos_id


@dataclasses.dataclass(frozen=True)
class Row:
    """One row the model reads: `inputs` (what each position reads) and `targets` (what
    it predicts), of which the last `scored` are summed."""

    inputs: tuple[int, ...]
    targets: tuple[int, ...]
    scored: int

    @classmethod
    def of(cls, context: Sequence[int], continuation: Sequence[int], max_length: int) -> "Row":
        """The row of a loglikelihood request: the last `max_length` + 1 ids of context and
        continuation (a long context loses its start), read up to the last one."""
        whole = (list(context) + list(continuation))[-(max_length + 1):]
        return cls(tuple(whole[:-1]), tuple(whole[1:]), min(len(continuation), len(whole) - 1))

    def __len__(self) -> int:
        return len(self.inputs)


def rolling_rows(ids: Sequence[int], prefix: int, max_length: int) -> list[Row]:
    """The windows a document of `ids` is scored in (lm-eval's disjoint rolling windows,
    each predicting at most `max_length` ids; the first after `prefix`); its
    log-likelihood is their sum."""
    windows = map(make_disjoint_window, get_rolling_token_windows(
        token_list=list(ids), prefix_token=prefix, max_seq_len=max_length, context_len=1))
    return [Row.of(context, continuation, max_length) for context, continuation in windows]


def kept_ids(vocab, new: Sequence[int], stops: Sequence[str]) -> list[int]:
    """The generated ids the Hugging Face backend would have made before stopping: it checks
    after each id whether a stop string is in the decoded last ``len(encoded stop) + 2``
    new ids (special tokens written out: the EOS's text is one of the stops), and stops at
    the first that holds."""
    lookback = [(stop, len(vocab.encode_published(stop, add_special_tokens=False)) + 2)
                for stop in stops if stop]
    for n in range(1, len(new) + 1):
        for stop, back in lookback:
            if stop in vocab.decode_published(new[max(0, n - back):n], skip_special_tokens=False):
                return list(new[:n])
    return list(new)


def generated_text(vocab, new: Sequence[int], stops: Sequence[str]) -> str:
    """What the Hugging Face backend returns for generated ids `new`: those it kept,
    decoded without special tokens, cut before the first of `stops` (inside a token too)."""
    text = vocab.decode_published(kept_ids(vocab, new, stops), skip_special_tokens=True)
    return postprocess_generated_text(generation=text, stop=list(stops), think_end_token=None)
