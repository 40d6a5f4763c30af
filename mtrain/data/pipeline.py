"""Batches for training and evaluation, on Grain: read by index, shuffle, tokenise, pack.

    batches = lm_batches(BibleLM("en"), vocab, "train", sequence_length=128,
                         batch_size=32, seed=0, train=True, workers=2)
    batch = next(batches)   # {"targets", "targets_segment_ids", "targets_positions"}
    batches.save(directory); ...; batches.restore(directory)

`batches(source, vocab, split, BatchSettings(...))` takes any `streams.DataSource`; a corpus
packed as translation pairs (``source.packs({"inputs": "en", "targets": "fr"})``) puts the
inputs and targets of an example in segment i of the same row in both keys.
Every batch is a dict of int32 numpy arrays of shape [batch_size // shard count,
sequence_length] (see packing.py for the three arrays of each key).

**The global batch depends neither on the number of processes nor on the workers.**
Training uses "lanes" (lanes.py): row r of every global batch (r = 0 .. B-1) is its own
endless stream, a Grain `MapDataset` over shard r of B of the split, shuffled every epoch,
cut into windows of `window` examples, each window tokenised and packed by a Grain map, so
that window w of lane r is a pure function of (r, w), read by index. The
process feeding shard i of n of the batch builds only its lanes, rows [i*B/n, (i+1)*B/n),
and takes one row from each in turn (`LaneRows`): it reads and tokenises only its share and
yields exactly its rows of the batch that a single process would have made.

Workers: with `workers` = W > 0 (at most one per lane), Grain's `mp_prefetch` runs the
lanes in W processes, each its slice of them (lanes k, k+W, ...) making one row of each of
its lanes per step, and takes one step from each process in turn; the rows go to their
lanes' places in the batch. W = 0 makes the rows in a background thread of this process.
The batches are the same either way.

Resuming: a lane's position is (window w, row k): row k of window w comes next. Every row
carries the position it was taken at, so this process knows each lane's position after the
last batch it yielded, whatever the workers had made ahead; `save` writes them as JSON
(``input_pipeline.process-p-of-P.json``, through orbax with the checkpoint), `restore` reads
the files of every process that saved and starts each lane at its position, making one
window again. That is exact for any number of processes and workers.

Evaluation makes one deterministic pass over the split: examples in order, packed, batched
by batch_size, the last batch filled up with all-zero rows, so every held-out token is seen
exactly once. To give every process the same number of batches without talking to the
others, each process tokenises and packs the whole (small) held-out split and keeps its
rows of each global batch.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
from typing import Iterator

import grain
import numpy as np
from absl import flags
from etils import epath

from mtrain.data.lanes import LaneRows, Mixture, PackWindow, Rows, lane_windows, num_rows
from mtrain.data.sources import TextSource
from mtrain.data.streams import DataSource, Stream
from mtrain.data.vocabulary import Vocabulary
from mtrain.errors import DataError, IncompatibleRun
from mtrain.io.textfiles import write_atomically

LM_FEATURES = {"targets": "text"}  # packed key <- source feature
LAST_TF_DATA_COMMIT = "fc8be58"  # the last mtrain whose pipeline was tf.data


def default_workers() -> int:
    """`run.data_workers` when not set: a quarter of the host's cores, at most 8, so that
    a small machine (the 2-core CI) packs in process and a GPU host's cores feed the step."""
    return max(0, min(8, (os.cpu_count() or 1) // 4))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchSettings:
    """How `batches` makes batches. train=True: endless, shuffled by `seed`; train=False:
    one pass in order (stream after stream), the last batch padded with all-zero rows.
    `shard` (i, n): yield rows [i*B/n, (i+1)*B/n) of each global batch of B rows. `process`
    (p, P) names the state the iterator saves (default: as `shard`). `window`: how many
    examples are encoded and packed together. `workers`: Grain worker processes (0: a
    thread of this process). `start_id`: what an example reads first where it reads
    nothing of its own (the model's start token)."""

    sequence_length: int
    batch_size: int
    seed: int = 0
    train: bool = True
    shard: tuple[int, int] = (0, 1)
    process: tuple[int, int] | None = None
    window: int = 256
    workers: int = 0
    start_id: int = 0


def batches(source: DataSource, vocab: Vocabulary, split: str,
            settings: BatchSettings) -> "BatchIterator":
    """Packed batches of the split `split` of `source` (its streams; several: a mixture by
    their weights): for each packed key k (e.g. "inputs" and "targets"), the arrays k,
    k_segment_ids and k_positions; with a fine-tuning format (`formats`), also the targets'
    loss weights and the tokens read before them."""
    s = settings
    index, count = s.shard
    if s.batch_size % count:
        raise DataError(f"batch_size {s.batch_size} is not divisible into {count} shards "
                        f"(one per process feeding its own rows)")
    if not 0 <= index < count:
        raise ValueError(f"shard {index} is not in [0, {count})")
    streams = source.streams(split)
    if s.train:
        for stream in streams:
            _check_enough_examples(stream, split, s.batch_size)
    with_inputs = any(stream.format.reads_first for stream in streams)
    config = dict(source.input_config(split), split=split, vocabulary=vocab.digest,
                  sequence_length=s.sequence_length, batch_size=s.batch_size, seed=s.seed,
                  train=s.train, window=s.window)
    if len(streams) > 1:
        config["mixture"] = {stream.name: stream.weight for stream in streams}
    if with_inputs:
        config["start_id"] = s.start_id
    pack = PackWindow(streams, vocab, s.sequence_length, start_id=s.start_id,
                      with_inputs=with_inputs)
    mixture = Mixture([stream.weight for stream in streams]) if len(streams) > 1 and s.train \
        else None
    return BatchIterator(pack, config, s.shard, s.process or s.shard, s.workers, mixture)


def lm_batches(source: TextSource, vocab: Vocabulary, split: str, sequence_length: int,
               batch_size: int, seed: int = 0, **settings) -> "BatchIterator":
    """Language-model batches {"targets", "targets_segment_ids", "targets_positions"} of a
    source with the feature "text" (`settings`: the rest of `BatchSettings`)."""
    return batches(source.packs(LM_FEATURES), vocab, split, BatchSettings(
        sequence_length=sequence_length, batch_size=batch_size, seed=seed, **settings))


def _check_enough_examples(stream: Stream, split: str, batch_size: int) -> None:
    """Every lane needs at least one example, or training would stop at once."""
    size = len(stream.records)
    if size < batch_size:
        raise DataError(f"split {split!r} of {stream.name} has {size} examples, fewer than "
                        f"the batch size {batch_size}: some batch rows would have nothing to "
                        f"train on")


class BatchIterator:
    """This process's rows of each global batch, whose position can be saved and restored.

    A restored iterator yields exactly the batches the saved one would have yielded next.
    The state of process p of P is written under `directory` with the process in its name,
    so every process of a run can save into the same (e.g. the checkpoint's) directory.
    `config` (JSON-able) describes the pipeline; it is saved with the lanes' positions and
    the batch count, and restoring into a pipeline with a different config is an error.
    """

    def __init__(self, pack: PackWindow, config: dict, shard: tuple[int, int] = (0, 1),
                 process: tuple[int, int] = (0, 1), workers: int = 0,
                 mixture: Mixture | None = None):
        self._pack, self._mixture = pack, mixture
        self.config = dict(config)
        self.train = bool(config["train"])
        self.shard, self.process = tuple(shard), tuple(process)
        batch_size = config["batch_size"]
        self.rows = batch_size // self.shard[1]
        self.first_row = self.shard[0] * self.rows
        self.workers = min(workers, self.rows) if self.train else workers  # (one per lane)
        self._iterator = None
        lanes = range(self.first_row, self.first_row + self.rows)
        self._start(0, {lane: (0, 0) for lane in lanes})

    # --- making batches -------------------------------------------------------------------

    def _start(self, position: int, lanes: dict[int, tuple[int, int]]) -> None:
        self.close()
        self.position = position  # batches yielded
        self.lanes = dict(lanes)  # lane -> (window, row) of its next row
        self._iterator = self._train_batches() if self.train else self._eval_batches()

    def _prefetched(self, dataset: grain.IterDataset, buffer: int) -> grain.IterDataset:
        """`dataset` made ahead, in the workers or (training) in a thread of this process."""
        if self.workers:
            _absl_flags_parsed()
            # Rows travel pickled, not in a shared memory block per array: a few hundred kB
            # per step, and no blocks left behind when a run stops with rows in flight.
            dataset = grain.experimental.WithOptionsIterDataset(
                dataset, grain.experimental.DatasetOptions(min_shm_size=sys.maxsize))
            return dataset.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=self.workers, per_worker_buffer_size=buffer),
                worker_init_fn=_exit_with_parent)
        if not self.train:
            return dataset
        return grain.experimental.ThreadPrefetchIterDataset(dataset,
                                                            prefetch_buffer_size=buffer)

    def _train_batches(self) -> Iterator[Rows]:
        """One row of every lane of this process per batch; each worker makes the rows of
        its slice of the lanes, which go back to their places (lane order) in the batch."""
        c = self.config
        order = sorted(self.lanes)
        sizes = [len(stream.records) for stream in self._pack.streams]
        lanes = [(lane, lane_windows(sizes, lane, c["batch_size"], c["seed"], c["window"],
                                     self._pack, self._mixture)) for lane in order]
        groups = iter(self._prefetched(LaneRows(lanes, self.lanes), buffer=2))
        self._open = groups
        place = {lane: i for i, lane in enumerate(order)}
        while True:
            batch, filled = None, 0
            for _ in range(max(self.workers, 1)):
                group_lanes, taken, rows = next(groups)
                where = [place[lane] for lane in group_lanes]
                if batch is None:
                    batch = {key: np.empty((self.rows, *value.shape[1:]), value.dtype)
                             for key, value in rows.items()}
                for key, value in rows.items():
                    batch[key][where] = value
                for lane, (w, k) in zip(group_lanes, taken):
                    self.lanes[lane] = (w, k + 1)
                filled += len(where)
            if filled != self.rows:  # the workers' slices of the lanes did not cover them
                raise RuntimeError(f"input pipeline: {filled} rows of {self.rows} made")
            yield batch

    def _eval_batches(self) -> Iterator[Rows]:
        """One pass: the split's windows in order, their rows batched by batch_size, the last
        batch padded with zeros; this process's rows of each."""
        c = self.config
        windows = (grain.MapDataset.range(self._pack.size)
                   .batch(c["window"]).map(self._pack)
                   .to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))
        windows = iter(self._prefetched(windows, buffer=2))
        self._open = windows
        size, pending = c["batch_size"], None  # rows made but not yet batched
        for packed in windows:
            pending = packed if pending is None else {
                key: np.concatenate([pending[key], value]) for key, value in packed.items()}
            while num_rows(pending) >= size:
                yield self._rows({key: value[:size] for key, value in pending.items()})
                pending = {key: value[size:] for key, value in pending.items()}
        if pending is not None and num_rows(pending):
            yield self._rows({key: np.pad(value, [(0, size - len(value)), (0, 0)])
                              for key, value in pending.items()})

    def _rows(self, batch: Rows) -> Rows:
        return {key: value[self.first_row:self.first_row + self.rows]
                for key, value in batch.items()}

    def __iter__(self) -> Iterator[Rows]:
        return self

    def __next__(self) -> Rows:
        batch = next(self._iterator)
        self.position += 1
        return batch

    def close(self) -> None:
        """Stops the worker processes or thread (also done when the iterator is collected)."""
        if getattr(self, "_open", None) is not None:
            self._open.close()
            self._open = None

    # --- saving and restoring the position ------------------------------------------------

    def taken(self) -> dict[str, int]:
        """A mixture's position in each of its sources: the examples this process's lanes
        have taken from each (those of the windows they are in included)."""
        windows = np.array([w + 1 for w, _ in self.lanes.values()], np.int64)
        taken = self._mixture.taken(windows * self.config["window"]).sum(axis=0)
        return {s.name: int(n) for s, n in zip(self._pack.streams, taken)}

    def mixture_fractions(self) -> dict[str, float]:
        """A mixture's realised proportions: each source's share of the examples this
        process's lanes have taken (`taken`); empty for one source."""
        if self._mixture is None:
            return {}
        taken = self.taken()
        total = max(sum(taken.values()), 1)
        return {name: n / total for name, n in taken.items()}

    def state_prefix(self, directory: str | os.PathLike, process=None) -> str:
        """Where a process's state lives: `directory/input_pipeline.process-p-of-P.json`."""
        p, count = process or self.process
        return os.path.join(os.fspath(directory), f"input_pipeline.process-{p}-of-{count}")

    def save(self, directory: str | os.PathLike) -> str:
        """Writes this process's lanes' positions, the batch count and the config under
        `directory` (local or a bucket) as ``<prefix>.json``; returns the prefix."""
        if not self.train:
            raise DataError("an evaluation pass has no position to save")
        epath.Path(directory).mkdir(parents=True, exist_ok=True)
        prefix = self.state_prefix(directory)
        state = dict(self.config, shard=list(self.shard), position=self.position,
                     lanes={str(lane): list(p) for lane, p in sorted(self.lanes.items())})
        if self._mixture is not None:
            state["sources"] = self.taken()
        write_atomically(prefix + ".json", json.dumps(state, sort_keys=True))
        return prefix

    def restore(self, directory: str | os.PathLike) -> None:
        """Moves the iterator to the position saved under `directory` by `save`, by the
        processes of a run with any number of processes."""
        files = sorted(epath.Path(directory).glob("input_pipeline.*.json"))
        if not files:
            raise DataError(f"no input pipeline state under {directory}")
        try:
            saved = [json.loads(f.read_text()) for f in files]
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read the input pipeline state under {directory}: "
                            f"{type(e).__name__}") from None
        if any("lanes" not in s for s in saved):
            raise IncompatibleRun(
                f"the input position under {directory} was saved by the tf.data pipeline of "
                f"mtrain {LAST_TF_DATA_COMMIT} or older, which this one cannot continue: finish "
                f"that run with it, or start a new model dir from these weights with "
                f"run.init_from")
        first = saved[0]
        config = self.config
        differences = [f"{key}={first.get(key)!r} there, {config.get(key)!r} here"
                       for key in sorted(config) if first.get(key) != config.get(key)]
        if differences:
            raise IncompatibleRun(f"the input pipeline state under {directory} was saved by "
                                  f"another pipeline: {'; '.join(differences)}")
        lanes = {int(lane): tuple(p) for s in saved for lane, p in s["lanes"].items()}
        positions = {s["position"] for s in saved}
        missing = sorted(set(range(self.first_row, self.first_row + self.rows)) - set(lanes))
        if missing or len(positions) != 1:
            raise DataError(f"the input pipeline state under {directory} is incomplete: "
                            + (f"no position of lanes {missing[:3]}..." if missing else
                               "its processes saved different batch counts"))
        self._start(positions.pop(), {lane: lanes[lane] for lane in self.lanes})


def _absl_flags_parsed() -> None:
    """Grain's worker start-up reads an absl flag, which fails unless a program parsed its
    flags with absl (mtrain parses its own): take absl's defaults."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _exit_with_parent(worker: int, count: int) -> None:
    """Run in each Grain worker as it starts: it exits when the process it works for ends,
    even killed with SIGKILL (which closes nothing), instead of waiting forever, orphaned,
    to hand over rows nobody reads."""
    del worker, count
    parent = multiprocessing.parent_process()

    def watch():
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    if parent is not None:
        threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()
