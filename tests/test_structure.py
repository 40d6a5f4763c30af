"""The shape of the code base, checked from its source (AST only: nothing is imported).

- The packages are layers, each importing only its own and the ones below it (`LAYERS`,
  lowest first; docs/architecture.md draws them).
- Gin stays at the edge: only `mtrain.config`, `mtrain.run` and `mtrain.__main__` import it.
- A model dir's layout is named in one place: no module but `mtrain.io.model_dir` spells one
  of its file names (`MODEL_DIR_NAMES`) as a string.
- No module of `mtrain/` is over 400 lines.
- The imports between `mtrain`'s modules form no cycle (imports inside functions count).
- No module uses another module's underscored names: neither ``from m import _x`` nor
  ``something._x`` where ``_x`` is defined only in another mtrain module.
- The GPU benchmarks (benchmarks/gpu.sh's scripts) reach neither gin nor TensorFlow through
  what they import: a GPU machine's image may have neither.
"""

import ast
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "mtrain"
GIN_EDGE = {"mtrain.config", "mtrain.run", "mtrain.__main__"}
# The layers, lowest first: a module may import its own layer's modules and lower ones.
LAYERS = [
    ("core", ("mtrain", "mtrain.errors")),
    ("parallel", ("mtrain.parallel",)),  # devices, meshes, layouts, processes, replicas
    ("models", ("mtrain.models",)),  # Flax modules with named dimensions
    ("io", ("mtrain.io",)),  # files, the model dir, its lock, checkpoints, metrics
    ("data", ("mtrain.data",)),  # tasks, corpora, TFDS, vocabularies, the input pipeline
    ("huggingface", ("mtrain.huggingface",)),  # Hugging Face folders: families, weights, tokenizers
    ("training", ("mtrain.training",)),  # the sharded state and steps, optimizer, loop, hooks
    ("evaluation", ("mtrain.evaluation",)),  # held-out metrics, BLEU, decoding, translation
    ("planning", ("mtrain.planning",)),  # --mode=plan's analysis of a compiled step
    ("modes", ("mtrain.modes",)),  # what each --mode does with a built experiment
    ("edge", ("mtrain.config", "mtrain.run", "mtrain.__main__", "mtrain.harness_cli")),  # gin,
    # the build, the command lines
]
MODEL_DIR_OWNER = "mtrain.io.model_dir"
MODEL_DIR_NAMES = ("checkpoints", "vocabulary.model", "config.gin", "metrics.jsonl",
                   "decodes", "profile", "mtrain.lock", "before-restart", "events.out.tfevents")
# benchmarks/gpu.sh's scripts, and a module each must reach (the walk finds their imports).
GPU_BENCHMARKS = {ROOT.parent / "benchmarks" / "attention.py": "mtrain.models.attention",
                  ROOT.parent / "benchmarks" / "throughput.py": "mtrain.training.trainer",
                  ROOT.parent / "benchmarks" / "moe.py": "mtrain.models.moe",
                  ROOT.parent / "benchmarks" / "quantized_matmul.py":
                      "mtrain.models.quantization"}
NOT_ON_A_GPU = ("gin", "tensorflow", "tensorflow_datasets")
MAX_LINES = 400


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _imports(tree: ast.AST) -> list[tuple[str, str | None]]:
    """(module, name) for every import: name None for ``import module``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.module, a.name) for a in node.names]
    return out


def _defined_private(tree: ast.AST) -> set[str]:
    """Underscored names a module defines: functions, classes, methods, assigned names and
    attributes (``self._x = ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or (p != "mtrain" and module.startswith(p + ".")) for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_structure.py's LAYERS")


def test_each_layer_imports_only_its_own_and_lower_ones():
    found = []
    for name, tree in TREES.items():
        for module, imported in _imports(tree):
            if not module.startswith("mtrain"):
                continue
            target = f"{module}.{imported}" if f"{module}.{imported}" in MODULES else module
            if _layer(target) > _layer(name):
                found.append(f"{name} ({LAYERS[_layer(name)][0]}) imports {target} "
                             f"({LAYERS[_layer(target)][0]})")
    assert not found, "imports of a higher layer: " + "; ".join(found)


def _strings(tree: ast.AST):
    """(line, text) of every string constant, f-strings' literal parts included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_the_model_dir_layout_is_named_by_its_owner_alone():
    found = [f"{name}:{line}: {text!r}" for name, tree in TREES.items() if name != MODEL_DIR_OWNER
             for line, text in _strings(tree)
             if text in MODEL_DIR_NAMES or text.startswith(MODEL_DIR_NAMES[-2:])]
    assert not found, f"model dir paths spelled outside {MODEL_DIR_OWNER}: " + ", ".join(found)


def test_gin_is_imported_only_at_the_edge():
    users = {name for name, tree in TREES.items()
             if any(m == "gin" or m.startswith("gin.") for m, _ in _imports(tree))}
    assert users <= GIN_EDGE, f"gin imported by library modules {sorted(users - GIN_EDGE)}"


def test_no_module_is_over_400_lines():
    """mtrain's modules, the benchmarks' scripts and the tests."""
    scripts = {f"{d}.{p.stem}": p for d in ("benchmarks", "tests")
               for p in (ROOT.parent / d).glob("*.py")}
    long = {name: n for name, path in {**MODULES, **scripts}.items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, tree in TREES.items():
        edges = set()
        for module, imported in _imports(tree):
            if f"{module}.{imported}" in MODULES:  # from mtrain.data import sources
                edges.add(f"{module}.{imported}")
            elif module in MODULES:
                edges.add(module)
        graph[name] = edges - {name}
    return graph


def test_imports_form_no_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _reached(tree: ast.AST) -> set[str]:
    """The mtrain modules that `tree`'s imports (inside functions too) reach, transitively."""
    graph, todo, seen = _graph(), [], set()
    for module, imported in _imports(tree):
        todo += [m for m in (f"{module}.{imported}", module) if m in MODULES]
    while todo:
        if (name := todo.pop()) not in seen:
            seen.add(name)
            todo += graph[name]
    return seen


def test_the_gpu_benchmarks_import_neither_gin_nor_tensorflow():
    found = []
    for script, used in GPU_BENCHMARKS.items():
        tree = ast.parse(script.read_text())
        assert used in _reached(tree), (script.name, sorted(_reached(tree)))
        for name, t in [(script.name, tree)] + [(m, TREES[m]) for m in sorted(_reached(tree))]:
            found += [f"{script.name}: {name} imports {m}" for m, _ in _imports(t)
                      if m.split(".")[0] in NOT_ON_A_GPU]
    assert not found, "; ".join(found)


def test_no_module_uses_another_modules_private_names():
    private = {name: _defined_private(tree) for name, tree in TREES.items()}
    everywhere = set().union(*private.values())
    found = []
    for name, tree in TREES.items():
        own = private[name]
        for module, imported in _imports(tree):
            if module.startswith("mtrain") and imported and imported.startswith("_"):
                found.append(f"{name}: from {module} import {imported}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in everywhere
                    and node.attr not in own):
                found.append(f"{name}:{node.lineno}: .{node.attr}")
    assert not found, "uses of other modules' private names: " + ", ".join(found)


@pytest.mark.parametrize("bad, check", [
    ("import gin\n", test_gin_is_imported_only_at_the_edge),
    ("from mtrain.training import trainer\n", test_each_layer_imports_only_its_own_and_lower_ones),
    ("def f(d):\n    return os.path.join(d, 'metrics.jsonl')\n",
     test_the_model_dir_layout_is_named_by_its_owner_alone),
    ("LOCK = f'before-restart-{1}'\n", test_the_model_dir_layout_is_named_by_its_owner_alone),
    ("x = 1\n" * (MAX_LINES + 1), test_no_module_is_over_400_lines),
    ("from mtrain import run\n", test_imports_form_no_cycle),
    ("def f(t):\n    return t._train_step_fn\n", test_no_module_uses_another_modules_private_names),
    ("def f():\n    import tensorflow\n", test_the_gpu_benchmarks_import_neither_gin_nor_tensorflow),
])
def test_the_checks_catch_what_they_check(monkeypatch, bad, check, tmp_path):
    """Each check fails on a module that breaks its rule (here: mtrain.parallel.layout, which every
    other module's imports reach, given the offending source)."""
    path = tmp_path / "layout.py"
    path.write_text(MODULES["mtrain.parallel.layout"].read_text() + "\n" + bad)
    monkeypatch.setitem(MODULES, "mtrain.parallel.layout", path)
    monkeypatch.setitem(TREES, "mtrain.parallel.layout", ast.parse(path.read_text()))
    with pytest.raises(AssertionError):
        check()


def test_the_package_is_where_the_checks_look():
    assert {"mtrain.config", "mtrain.training.trainer", "mtrain.data.pipeline"} <= set(MODULES)
    assert os.path.isfile(MODULES["mtrain.models.transformer"])
