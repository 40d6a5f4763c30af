"""The files of each split of a folder laid out as a Hugging Face dataset on the Hub
(`hf_dataset_splits`), read without the Hub: the split names a README.md's ``configs:``
gives them, else those their names carry."""

from __future__ import annotations

import re

from etils import epath

from mtrain.data import files as files_lib
from mtrain.errors import DataError

# Split names a file or folder may start with, outside the Hub's sharded names.
_SPLIT_WORDS = ("train", "training", "validation", "valid", "val", "dev", "test", "testing",
                "eval", "evaluation")
_HUB_SHARD = re.compile(r"^(\w+(?:\.\w+)*)-\d+-of-\d+(?:-[0-9a-f]+)?\.")
_WORD = re.compile(r"^(" + "|".join(_SPLIT_WORDS) + r")(?:[-_.].*)?$")
_DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".txt", ".array_record",
                  ".arrayrecord")


def hf_dataset_splits(folder) -> dict[str, list[epath.Path]] | None:
    """The files of each split of a folder laid out as a Hugging Face dataset on the Hub, by
    split name as the files name it (e.g. {"train": [...], "test": [...]}), or None if the
    folder is not laid out so. A README.md whose YAML front matter has `configs:` with
    `data_files` decides; else data/ (or the folder itself) holds `<split>-00000-of-00002.ext`,
    `<split>.ext`, `<split>-*.ext` or (under data/) `<split>/*.ext`. Read without the Hub."""
    folder = epath.Path(folder)
    if not folder.is_dir():
        return None
    splits = _readme_splits(folder)
    if splits is None and (folder / "data").is_dir():
        splits = _layout_splits(folder / "data", any_name=True)
    return splits or _layout_splits(folder, any_name=False) or None


def _is_data_file(path: epath.Path) -> bool:
    try:
        return path.is_file() and files_lib.name_parts(path)[1] in _DATA_SUFFIXES
    except DataError:
        return False


def _layout_splits(where: epath.Path, any_name: bool) -> dict[str, list[epath.Path]]:
    splits: dict[str, list[epath.Path]] = {}
    for path in sorted(where.iterdir(), key=str):
        if path.name.startswith((".", "_")):
            continue
        if path.is_dir():
            if any_name or _WORD.match(path.name):
                files = [p for p in sorted(path.iterdir(), key=str) if _is_data_file(p)]
                if files:
                    splits.setdefault(path.name, []).extend(files)
            continue
        if not _is_data_file(path):
            continue
        match = _HUB_SHARD.match(path.name) or _WORD.match(path.name)
        if match:
            splits.setdefault(match[1], []).append(path)
    return splits


def _readme_splits(folder: epath.Path) -> dict[str, list[epath.Path]] | None:
    """The splits a README.md's `configs:` names (the config marked default, else the one
    named "default", else the first), or None if it names none."""
    readme = folder / "README.md"
    if not readme.is_file():
        return None
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", readme.read_text(), re.S)
    if not match:
        return None
    import yaml

    try:
        meta = yaml.safe_load(match[1])
    except yaml.YAMLError:
        return None
    configs = meta.get("configs") if isinstance(meta, dict) else None
    configs = [c for c in configs if isinstance(c, dict)] if isinstance(configs, list) else []
    if not configs:
        return None
    defaults = [c for c in configs if c.get("default")] or [
        c for c in configs if c.get("config_name") == "default"]
    if (data_files := (defaults or configs)[0].get("data_files")) is None:
        return None
    if isinstance(data_files, list) and all(isinstance(d, dict) for d in data_files):
        data_files = {d.get("split", "train"): d.get("path") for d in data_files}
    elif not isinstance(data_files, dict):
        data_files = {"train": data_files}
    if not data_files or not all(data_files.values()):
        raise DataError(f"{readme}: cannot read its configs' data_files ({data_files!r})")
    splits = {}
    for split, globs in data_files.items():
        globs = [globs] if isinstance(globs, str) else list(globs)
        splits[str(split)] = files_lib.expand([str(folder / g) for g in globs])
    return splits
