"""What a checkpoint's run must share with the run that restores it (`check_compatible`)."""

from __future__ import annotations

import json

import jax

from mtrain.errors import IncompatibleRun

ADVICE = ("resume with the saved settings, or start a new run in another --model_dir "
           "(with run.init_from to start from these parameters)")
_NAMES = {"vocab_size": "the model's vocabulary size", "vocabulary": "the vocabulary",
          "data": "the data"}


def _name(key: str) -> str:
    return _NAMES.get(key, key if "." in key else f"transformer.{key}")


def _differences(saved: dict, current: dict, skip=()) -> list[str]:
    """'name=saved there, current here' for each key of `saved` whose value differs (keys
    a checkpoint lacks, written by an older mtrain, are not compared; nor is
    ``max_length`` where this model has no learned position table to shape, as an older
    mtrain recorded it for every model)."""
    current = json.loads(json.dumps(current))  # tuples -> lists, as the saved JSON has them
    unshaped = {"max_length"} - set(current) if "d_model" in current else set()
    return [f"{_name(k)}={saved[k]!r} there, {current.get(k)!r} here"
            for k in sorted(saved)
            if saved[k] != current.get(k) and k not in unshaped and k not in skip]


def check_compatible(saved: dict, current: dict, where, resume: bool,
                     advice: str | None = None, model_only: bool = False,
                     data_may_change: bool = False) -> None:
    """Raises `IncompatibleRun` naming every setting that differs between the run that
    saved a checkpoint (its ``meta``, `saved`) and this one (`current`).

    ``meta`` holds ``model`` (shape settings and vocabulary: must match for any restore),
    ``task``, ``run`` (what decides the data and its order: batch size, sequence length,
    seed, data; must match to resume training), ``state`` (`state_signature` of the train
    state) and ``optimizer`` (its settings, to name the one that changed the state).
    Everything else (steps, schedules, mesh and layout, learning rate, ...) may change.
    `advice` replaces what the error tells a resuming run to do. `model_only`: only the
    model must match (a read of the parameters alone); `data_may_change`: the data is not
    compared (a run that continues on new data, its input from the start).
    """
    if model_only:
        current = {"model": current.get("model", {}), "task": saved.get("task"),
                   "state": saved.get("state")}
    diffs = []
    if "task" in saved and saved["task"] != current.get("task"):
        diffs.append(f"run.task={saved['task']!r} there, {current.get('task')!r} here")
    diffs += _differences(saved.get("model", {}), current.get("model", {}))
    model_differs = bool(diffs)
    if resume:
        diffs += _differences(saved.get("run", {}), current.get("run", {}),
                              skip=("data",) if data_may_change else ())
    if not model_differs and "state" in saved and saved["state"] != current.get("state"):
        named = _differences(saved.get("optimizer", {}), current.get("optimizer", {}))
        if not named:
            here = current.get("state", {})
            path = next(p for p in [*saved["state"], *here]
                        if saved["state"].get(p) != here.get(p))
            named = [f"train state {path}: {saved['state'].get(path) or 'absent'} there, "
                     f"{here.get(path) or 'absent'} here"]
        diffs += named
    if diffs:
        advice = advice or ("resume with the saved settings, or train a new model in another "
                            "--model_dir" if model_differs else ADVICE)
        raise IncompatibleRun(f"checkpoint {where} is of a run with other settings: "
                              f"{'; '.join(diffs)}; {advice}")


def data_differs(saved: dict, current: dict) -> bool:
    """Whether a checkpoint's run (its meta, `saved`) read other data than this one (a
    file's contents edited: `data.file_identity`; other files)."""
    theirs = saved.get("run", {}).get("data")
    return theirs is not None and theirs != current.get("run", {}).get("data")


def state_signature(abstract_state) -> dict[str, str]:
    """Every leaf of a (train) state as ``{path: "dtype[shape]"}``: what a checkpoint of it
    must hold for a restore into it."""
    return {jax.tree_util.keystr(path): f"{leaf.dtype}{list(leaf.shape)}"
            for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
