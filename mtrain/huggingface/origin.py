"""Where a model dir's model came from: the record ``--mode=import`` writes into it
(`ModelDir.huggingface`: the family it was imported as, the Hugging Face folder it read, the
adapter folder), which export reads, never guessing: the model goes back out as that family,
and an exported adapter names that folder as its base (``base_model_name_or_path``, which
PEFT loads).

A model dir without such a record is read as follows (`read`):

- imported by an older mtrain: its step-0 checkpoint's meta says ``imported`` (family,
  folder, adapter) and is the record;
- a run started from another (``run.init_from``: a fine-tune or DPO run beside its import):
  that model dir's record;
- trained here from scratch: none. Export then writes the model as the first family whose
  settings it has (`families.of_model`), and an adapter names the model dir as its base
  (one line says so).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from etils import epath

from mtrain.io.checkpoints import Checkpoints
from mtrain.io.model_dir import ModelDir
from mtrain.io.textfiles import write_atomically

log = logging.getLogger("mtrain")


@dataclasses.dataclass(frozen=True)
class Origin:
    """An import's record: `architecture` (config.json's, a `records` family), `source`
    (the folder it read: absolute, or a bucket's URL) and `adapter` (the PEFT adapter
    folder imported with it, if any)."""

    architecture: str
    source: str
    adapter: str | None = None


def location(path: str) -> str:
    """`path` as a record keeps it: absolute where local, a URL as it is."""
    return path if "://" in path else os.path.abspath(path)


def write(model_dir: str, origin: Origin) -> None:
    write_atomically(ModelDir(model_dir).huggingface,
                     json.dumps(dataclasses.asdict(origin), indent=2) + "\n")


def _own(model_dir: str) -> Origin | None:
    """The record of `model_dir` itself: its huggingface.json, else its step-0 import's meta."""
    path = epath.Path(ModelDir(model_dir).huggingface)
    if path.exists():
        try:
            record = json.loads(path.read_text())
            return Origin(record["architecture"], record["source"], record.get("adapter"))
        except (ValueError, KeyError, TypeError):
            log.warning("%s cannot be read: the model's origin is unknown", path)
            return None
    if not epath.Path(ModelDir(model_dir).checkpoints).is_dir():
        return None
    checkpoints = Checkpoints(ModelDir(model_dir).checkpoints, read_only=True)
    try:
        if 0 not in checkpoints.all_steps():
            return None
        imported = checkpoints.meta(0).get("imported") or {}
    except Exception as e:  # (damaged or of another version: no record, as said)
        log.debug("the meta of step 0 in %s cannot be read: %s", model_dir, e)
        return None
    finally:
        checkpoints.close()
    if "architecture" not in imported or "from" not in imported:
        return None
    return Origin(imported["architecture"], imported["from"], imported.get("adapter"))


def read(model_dir: str, init_from: str | None = None) -> Origin | None:
    """The record of `model_dir`, else of the run it started from (`init_from`: a model dir
    or its checkpoints/), else None (a model trained here)."""
    origin = _own(model_dir)
    if origin is None and init_from:
        where = init_from.rstrip("/")
        if os.path.basename(where) == os.path.basename(ModelDir(where).checkpoints):
            where = os.path.dirname(where)  # (init_from may name the checkpoints)
        origin = _own(where)
    return origin
