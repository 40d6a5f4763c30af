"""Where metrics go: the console, ``<model_dir>/metrics.jsonl`` and TensorBoard event files
(in a gs:// model dir too, through etils.epath like the model dir's other files).

Every record is a step and a flat dict of named metrics (``train/loss``, ``eval/perplexity``,
...). Only process 0 writes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys

import jax
from etils import epath

from mtrain.io.model_dir import metrics_file
from mtrain.io.textfiles import append_text, is_remote, write_atomically

log = logging.getLogger("mtrain")


def setup_logging(verbose: bool = False) -> None:
    """Tidy one-line logs on stderr (process 0 only; other processes log warnings).

    Libraries that log through absl (orbax logs every failed background write with its
    traceback) are silenced unless `verbose`: mtrain reports their failures in one line.
    """
    level = logging.INFO if jax.process_index() == 0 else logging.WARNING
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(logging.DEBUG if verbose else level)
    log.propagate = False
    logging.getLogger("absl").setLevel(logging.DEBUG if verbose else logging.CRITICAL)


def _format(value) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class MetricsWriter:
    """Appends records to ``<directory>/metrics.jsonl`` and TensorBoard event files there,
    and logs them in one line each. `directory` None: the log only (a reader whose model
    dir cannot be written). A record that metrics.jsonl already holds (the same step and
    values: an evaluation repeated by a resume or by --mode=eval) is logged, not written
    again; the event file is made at the first record written.

    `resumed_from`: the step a training run starts from (its checkpoint's; 0 for a fresh
    run). The records of later steps that metrics.jsonl holds are of steps this run takes
    again (a run that stopped without checkpointing them: killed, out of memory): at the
    first record written they are dropped from metrics.jsonl (rewritten whole, atomically)
    and TensorBoard is told to hide their events (`purge_step`), so that every step is
    recorded once per kind, with the values of the run that the checkpoints continue."""

    def __init__(self, directory: str | None, resumed_from: int | None = None):
        self.enabled = jax.process_index() == 0 and directory is not None
        self.directory = directory
        self.path = metrics_file(directory) if directory else None
        self.resumed_from = resumed_from
        self._tb = None
        self._written = None  # the records already in metrics.jsonl, read at the first write

    def write(self, step: int, metrics: dict[str, float]) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        if jax.process_index() == 0:
            log.info("step %d  %s", step, "  ".join(f"{k} {_format(v)}"
                                                    for k, v in metrics.items()))
        if not self.enabled or self._already_written(step, metrics):
            return
        append_text(self.path, json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")
        for name, value in metrics.items():
            if math.isfinite(value):
                self._events().add_scalar(name, value, step)

    def _already_written(self, step: int, metrics: dict) -> bool:
        if self._written is None:
            path = epath.Path(self.path)
            lines = [line for line in (path.read_text().splitlines() if path.exists() else [])
                     if line.strip()]
            if self.resumed_from is not None:
                lines = self._drop_replayed(lines)
            self._written = set(lines)
        record = json.dumps({"step": step, **metrics}, allow_nan=True)
        if record in self._written:
            return True
        self._written.add(record)
        return False

    def _drop_replayed(self, lines: list[str]) -> list[str]:
        """`lines` of metrics.jsonl less the records of steps after `resumed_from`
        (rewritten without them, if there were any)."""
        def replayed(line: str) -> bool:
            try:
                return json.loads(line).get("step", 0) > self.resumed_from
            except (ValueError, AttributeError):  # (a line cut short: kept as it is)
                return False

        kept = [line for line in lines if not replayed(line)]
        if len(kept) < len(lines):
            write_atomically(self.path, "".join(line + "\n" for line in kept))
            log.info("%s: dropped %d records of the steps after %d, which this run takes "
                     "again", self.path, len(lines) - len(kept), self.resumed_from)
        return kept

    def _events(self):
        if self._tb is None:
            SummaryWriter, record_writer = _tensorboardx()
            if is_remote(self.directory):
                record_writer.register_writer_factory(os.fspath(self.directory).split("://")[0],
                                                      _BucketEventFiles())
            purge = None if self.resumed_from is None else self.resumed_from + 1
            self._tb = SummaryWriter(self.directory, flush_secs=10, purge_step=purge)
        return self._tb

    def close(self) -> None:
        if self._tb is None:
            return
        tb, self._tb = self._tb, None
        writers = list(tb.all_writers.values())
        try:
            tb.close()
        except OSError:
            # The events could not be written (a full disk). tensorboardX would try again at
            # exit, from an atexit handler per file, and print a traceback (as would its
            # writer thread, left running): give them up, and stop the thread.
            for events in (w.event_writer for w in writers):
                if not events._closed:
                    events._worker.stop()
                    events._closed = True
            raise


# What tensorboardX imports where it is installed, and mtrain never has it use: torch (its
# writer takes torch tensors; mtrain passes numbers), google-cloud-storage and boto3 (its
# writers to gs:// and s3://; mtrain writes a remote model dir's events itself,
# `_BucketEventFiles`). On a machine with all three they cost 4-7 s and ~0.5 GB in every
# run's process.
_UNUSED_BY_TENSORBOARDX = ("torch", "google.cloud.storage", "boto3")


def _tensorboardx():
    """tensorboardX's SummaryWriter and record_writer, imported without the modules it would
    not use here (`_UNUSED_BY_TENSORBOARDX`) unless something imported them already: a None
    in `sys.modules` makes their import raise ImportError, which tensorboardX expects. The
    entries go right after; a later import of any of them works as ever."""
    hidden = [name for name in _UNUSED_BY_TENSORBOARDX if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        from tensorboardX import SummaryWriter, record_writer
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    return SummaryWriter, record_writer


class _BucketEventFile:
    """An event file in a bucket, for tensorboardX: kept in memory and written whole at each
    flush (an object cannot be appended to), through epath. tensorboardX's own gs:// writer
    needs google-cloud-storage, and uploads again whenever it is garbage-collected."""

    def __init__(self, path: str):
        self.path, self.data = epath.Path(path), bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def flush(self) -> None:
        self.path.write_bytes(bytes(self.data))

    close = flush


class _BucketEventFiles:
    """tensorboardX's writer factory for a URL scheme (`record_writer.register_writer_factory`)."""

    open = staticmethod(_BucketEventFile)

    def directory_check(self, path: str) -> None:
        """A bucket has no directories to make."""
