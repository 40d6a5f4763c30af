"""``--mode=infer``: a file of lines in, their translations (an LM: continuations) out, with
the latest checkpoint, written as they are made. It reads the model dir's vocabulary and no
training data (`run.build` prepares none).

An LM given a ``.jsonl`` file continues JSON objects instead, as the fine-tuning formats
read them, and writes them back with what it made: ``{"messages": [...]}`` rendered with
the model dir's chat template and its generation prompt, answered up to the template's end
of turn (the answer appended to ``messages`` as an assistant message); ``{"prompt": ...}``
continued up to EOS (the continuation as ``completion``, replacing any)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import jax

from mtrain.data.chat import ChatTemplate, prompt_completion
from mtrain.data.user_data import model_dir_template
from mtrain.evaluation.generation import Prompt
from mtrain.training.start import restore_for_reading
from mtrain.errors import ConfigError
from mtrain.modes.experiment import Experiment
from mtrain.io.textfiles import check_writable
from mtrain.io.metrics import log
from mtrain.io.model_dir import ModelDir
from mtrain.io.textfiles import read_lines


def check_output_file(output_file: str | None, input_file: str | None = None) -> None:
    """An --output_file can be written: its directory exists and takes a new file, and it
    is not the --input_file (which writing it would replace before it is read whole)."""
    if output_file in (None, "-"):
        return
    if input_file not in (None, "-") and os.path.realpath(input_file) == os.path.realpath(
            output_file):
        raise ConfigError(f"--output_file {output_file} is the --input_file: writing it would "
                          f"replace the lines being read; write to another file")
    if os.path.isdir(output_file):
        raise ConfigError(f"--output_file {output_file} is a directory")
    directory = os.path.dirname(os.path.abspath(output_file))
    if not os.path.isdir(directory):
        raise ConfigError(f"--output_file {output_file}: the directory {directory} does not exist")
    check_writable(directory, "the directory of --output_file")


def infer(exp: Experiment, input_file: str | None, output_file: str | None) -> int:
    """``--mode=infer``: translates the lines of `input_file` (or stdin) with the latest
    checkpoint (an LM continues each line instead: `generation.Generator`), one line out per
    line in and in order (`one_line`), to `output_file` (or stdout).

    Outputs are written as each batch of decoding.batch_size lines finishes, so a run
    stopped half-way keeps the lines it finished; a progress line (lines done, lines/s,
    time left) goes to the log at least every 10 seconds."""
    lines = read_lines(input_file)
    records = None
    texts = lines
    if exp.generator and input_file and ".jsonl" in os.path.basename(input_file):
        records = [_record(line, n + 1) for n, line in enumerate(lines)]
        texts = _prompts(exp, records)
    state, step = restore_for_reading(ModelDir(exp.model_dir).checkpoints,
                                      exp.trainer.sharded_abstract_state(),
                                      exp.reader_meta(exp.vocab))  # (no data: exp.source None)
    writing = jax.process_index() == 0
    out = None
    if writing:
        out = sys.stdout if output_file in (None, "-") else open(output_file, "w",
                                                                  encoding="utf-8")
    decoder = exp.translator or exp.generator
    verb = decoder.verb
    log.info("%sing %d lines with the checkpoint of step %d, %d at a time "
             "(decoding.batch_size)%s", verb, len(lines), step, decoder.batch_size,
             decoder.how())
    progress = _Progress(len(lines), f"{verb}ed")
    try:
        with progress:
            for batch in decoder.batches(state.params, texts):
                if records is not None:
                    batch = [_answered(r, t) for r, t in
                             zip(records[progress.done:progress.done + len(batch)], batch)]
                if writing:
                    out.write("".join((t if records is not None else one_line(t)) + "\n"
                                      for t in batch))
                    out.flush()
                progress.add(len(batch))
    finally:
        if out is not None and out is not sys.stdout:
            out.close()
    if decoder.truncated:
        log.warning("%d of %d input lines were longer than %d tokens (run.sequence_length) "
                    "%s", decoder.truncated, len(lines), decoder.length,
                    decoder.truncation_note())
    log.info("%sed %d lines in %.0f s", verb, len(lines), time.time() - progress.started)
    return len(lines)


def one_line(text: str) -> str:
    """`text` on one line, as --mode=infer writes a text output: a backslash as ``\\\\``,
    a newline as ``\\n`` and a carriage return as ``\\r`` (a model may generate them;
    written as they are, one continuation would take two lines and the output would no
    longer line up with the input). JSONL output needs none: JSON escapes them."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _record(line: str, number: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not (isinstance(record.get("messages"), list)
                                            or isinstance(record.get("prompt"), str)):
        raise ConfigError(f"--input_file line {number}: a .jsonl file to continue holds JSON "
                          f"objects with 'messages' (a conversation) or a 'prompt' (a string)")
    return record


def _prompts(exp: Experiment, records: list[dict]) -> list[Prompt]:
    """What the model reads for each JSONL record: a conversation rendered with the model
    dir's chat template and its generation prompt, ended at the template's end of turn; a
    prompt as a prompt/completion example begins ([BOS] + its ids), ended at EOS. Both are
    read as they are, as the fine-tuning formats read them."""
    template = None
    prompts = []
    for number, record in enumerate(records, 1):
        where = f"--input_file line {number}"
        if "messages" in record:
            if template is None:
                template = _chat_template(exp, where)
            ids, stop = template.prompt(record["messages"], where=where), template.end_of_turn
        else:
            ids, _ = prompt_completion(exp.vocab, record["prompt"], "")
            ids, stop = ids[:-1], exp.vocab.eos_id  # without the empty completion's EOS
        if not ids:
            raise ConfigError(f"{where}: an empty prompt (nothing for the model to read)")
        prompts.append(Prompt(tuple(ids), stop))
    return prompts


def _chat_template(exp: Experiment, where: str) -> ChatTemplate:
    template = model_dir_template(exp.model_dir, exp.vocab)
    if template is None:
        raise ConfigError(f"{where} holds 'messages', but the model dir has no chat template "
                          f"({ModelDir(exp.model_dir).chat_template}: --mode=import keeps a "
                          f"model's)")
    return template


def _answered(record: dict, text: str) -> str:
    """The JSON line of `record` with its continuation: the conversation with the
    assistant's answer appended, or the prompt with its `completion`."""
    if "messages" in record:
        record = {**record, "messages": record["messages"] + [
            {"role": "assistant", "content": text}]}
    else:
        record = {**record, "completion": text}
    return json.dumps(record, ensure_ascii=False)


class _Progress:
    """Logs lines done, lines/s and the time left every `every` seconds from a thread of its
    own, so that a line comes even while one batch takes longer than that."""

    def __init__(self, total: int, done_verb: str = "translated", every: float = 10.0):
        self.total, self.every, self.done, self.verb = total, every, 0, done_verb
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def add(self, n: int) -> None:
        self.done += n

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            elapsed = time.time() - self.started
            rate = self.done / elapsed
            left = f"{(self.total - self.done) / rate:.0f} s left" if rate else "time left unknown"
            log.info("%s %d of %d lines, %.2f lines/s, %s", self.verb, self.done, self.total,
                     rate, left)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
