"""The input iterator's position as an orbax checkpoint item (``data``): saved and restored
by the iterator itself (`data.pipeline.BatchIterator.save`), each file it wrote with a
SHA-256, verified before any is read."""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from mtrain.io import checksums


class DataIteratorHandler(ocp.CheckpointHandler):
    """Saves and restores an input iterator (``save(directory)`` returns the prefix of the
    files it wrote, named after its process; ``restore(directory)``), with a SHA-256 of
    each file in ``<prefix>.sha256``, verified before any is read."""

    def save(self, directory: epath.Path, args: DataIteratorSave):
        prefix = epath.Path(args.iterator.save(str(directory)))
        written = [p for p in prefix.parent.glob(prefix.name + ".*") if p.suffix != ".sha256"]
        checksums.write_file_checksums(written, f"{prefix}.sha256")

    def restore(self, directory: epath.Path, args: DataIteratorRestore):
        for listed in epath.Path(directory).glob("*.sha256"):  # (none: an older mtrain's)
            checksums.verify_files(listed)
        args.iterator.restore(str(directory))
        return args.iterator


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
    iterator: Any


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
    iterator: Any
