"""Where a checkpoint's frozen parameters lie: its *base* (`Base`), for the runs that store
them once (`io.checkpoints`).

A run that freezes parameters (LoRA, ``run.trainable``) and started from a checkpoint (an
import, ``run.init_from``) saves its trainable parameters and optimizer state alone; its
checkpoints' meta names the base (the checkpoint holding the frozen ones: its directory and
step), and a digest of the checksums that the base's own meta records of them
(`base_digest`), so that a restore knows the base it reads is the one it was trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

from mtrain.models import parameters


@dataclasses.dataclass(frozen=True)
class Base:
    """Where a checkpoint's frozen parameters lie (module doc): checkpoint `step` of the
    directory `checkpoints` ("": the checkpoint's own), their paths (`frozen`), and the
    digest of their checksums there (`base_digest`)."""

    checkpoints: str
    step: int
    frozen: list
    digest: str

    def without_frozen(self, params):
        frozen = set(self.frozen)
        return parameters.select(params, lambda path: path not in frozen)


def base_digest(meta: dict, frozen) -> str:
    """A digest of the checksums that a checkpoint's `meta` records of the parameters
    `frozen` (their paths): the same for the same values."""
    wanted, sums = set(frozen), {}
    for key, value in meta.get("checksums", {}).items():
        if (path := param_path(key)) in wanted:
            sums[path] = value
    if set(sums) != wanted:
        return "incomplete"  # (a checkpoint that does not hold them all: not this base)
    return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()[:16]


def stored_params(meta: dict) -> set[str] | None:
    """The paths of the parameters a checkpoint holds, from the checksums of its meta."""
    if "checksums" not in meta:
        return None
    return {path for key in meta["checksums"] if (path := param_path(key))}


def param_path(key: str) -> str | None:
    """A state's array path (``.params['layer_0']['mlp']['wi']``, or ``['params']...`` of
    an import) as a parameter's ("layer_0/mlp/wi"); None for the other arrays."""
    match = re.fullmatch(r"(?:\.params|\['params'\])((?:\['[^']*'\])+)", key)
    return "/".join(re.findall(r"\['([^']*)'\]", match.group(1))) if match else None
