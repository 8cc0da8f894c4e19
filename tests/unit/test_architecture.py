"""The import-layer rule of docs/ARCHITECTURE.md: imports go down the layers only,
and the package's import graph has no cycles (module-level and function-level
imports alike)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pycls_fast"

# The folders, lowest first: a module may import its own folder's modules and the
# folders below. The longest matching prefix names a module's layer. Stated once
# here; docs/ARCHITECTURE.md's layer table lists the same folders in the same order.
LAYERS = [
    ["pycls_fast.errors", "pycls_fast.storage", "pycls_fast.moved"],  # leaves
    ["pycls_fast.config", "pycls_fast.config_doc"],
    ["pycls_fast.models"],
    ["pycls_fast.datasets.images"],  # decoding and per-image transforms
    ["pycls_fast.datasets.formats"],  # on-disk formats and their preparation
    ["pycls_fast.datasets.modes", "pycls_fast.datasets.to_device"],
    ["pycls_fast.datasets"],  # loader.py: the builder over the folders above
    ["pycls_fast.runtime"],  # this process in the job: ranks, device, signals, lock
    ["pycls_fast.observe"],  # logs, sinks, plots, profiling
    ["pycls_fast.components"],  # parts of a step: precision, optimizer, EMA, ...
    ["pycls_fast.parallel"],  # mesh, DDP / FSDP, TP, PP, the planner
    ["pycls_fast.checkpoint"],
    ["pycls_fast.engine"],  # the loop: trainer, evaluation, timing, distillation
    ["pycls_fast.launch"],  # processes, SLURM, the command line
    ["pycls_fast.export"],  # checkpoints to timm / ONNX, model cards
    ["pycls_fast.sweep"],
]
MAX_MODULES_PER_FOLDER = 12


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts)
    return name.removesuffix(".__init__")


def package_modules() -> dict[str, pathlib.Path]:
    return {module_name(f): f for f in PACKAGE.rglob("*.py")}


def imports_of(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The package modules that `path` imports anywhere in its body."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports mod, and runs pkg's __init__ first;
            # `from mod import name` imports mod.
            targets = [base] + [
                f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known
            ]
        for t in targets:
            # The longest known prefix of a dotted name is the module imported.
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t != "pycls_fast":
                out.add(t)
    return out


def layer_of(name: str) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level is not None, f"{name} is in no layer: add it to LAYERS"
    return level


def graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {name: imports_of(path, name, known) for name, path in modules.items()}


def test_every_module_has_a_layer():
    for name in package_modules():
        if name != "pycls_fast":
            layer_of(name)


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in edges.items()
        if m != "pycls_fast"
        for t in targets
        if layer_of(t) > layer_of(m)
    ]


def test_no_module_imports_a_higher_layer():
    assert upward_imports(graph()) == []


def test_the_checker_sees_a_planted_upward_import(tmp_path):
    """The rule can fail: a component importing the trainer is reported."""
    planted = tmp_path / "ema.py"
    planted.write_text(
        "def f():\n    from pycls_fast.engine.trainer import train_step\n"
    )
    edges = graph()
    known = set(edges)
    name = "pycls_fast.components.ema"
    edges[name] = imports_of(planted, name, known)
    assert upward_imports(edges) == [
        f"{name} (layer {layer_of(name)}) imports pycls_fast.engine.trainer "
        f"(layer {layer_of('pycls_fast.engine.trainer')})"
    ]


def package_folders() -> list[pathlib.Path]:
    return sorted(
        d for d in PACKAGE.rglob("*") if d.is_dir() and (d / "__init__.py").exists()
    )


def test_every_folder_is_a_layer_of_its_own_name():
    """Each package folder is named in LAYERS (a folder shows one layer)."""
    named = {p for prefixes in LAYERS for p in prefixes}
    folders = {module_name(d / "__init__.py") for d in package_folders()}
    assert folders - {"pycls_fast"} <= named


def test_no_folder_holds_more_than_a_dozen_modules():
    crowded = {
        str(d.relative_to(ROOT)): n
        for d in [PACKAGE, *package_folders()]
        if (n := len([f for f in d.glob("*.py") if f.name != "__init__.py"]))
        > MAX_MODULES_PER_FOLDER
    }
    assert crowded == {}


def test_unit_tests_mirror_the_package_folders():
    """tests/unit/<folder>/ exists only for a package folder of that name."""
    unit = ROOT / "tests" / "unit"
    mirrored = {
        str(d.relative_to(unit))
        for d in unit.rglob("*")
        if d.is_dir() and d.name != "__pycache__"
    }
    folders = {str(d.relative_to(PACKAGE)) for d in package_folders()}
    assert mirrored and mirrored <= folders


def test_old_import_paths_give_the_moved_modules():
    """pycls_fast.moved: every pre-split path imports the module at its new place."""
    import importlib

    from pycls_fast.moved import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    old_trainer = importlib.import_module("pycls_fast.core.trainer")
    # The step left trainer.py for engine/step.py; trainer.py re-exports it.
    assert old_trainer.train_step.__module__ == "pycls_fast.engine.step"
    assert old_trainer is importlib.import_module("pycls_fast.engine.trainer")


def cycles_in(edges: dict[str, set[str]]) -> list[str]:
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t) :] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return cycles


def test_import_graph_has_no_cycles():
    assert cycles_in(graph()) == []


@pytest.mark.parametrize("folder", ["tools", "benchmarks", "tests"])
def test_package_never_imports_tools_benchmarks_or_tests(folder):
    offenders = [
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(
            n == folder or n.startswith(folder + ".")
            for n in (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
        )
    ]
    assert offenders == []


def test_the_checker_sees_a_planted_cycle(tmp_path):
    """The rule can fail: two modules importing each other are reported."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from pycls_fast.engine import b\n")
    b.write_text("def f():\n    from pycls_fast.engine import a\n")
    known = {"pycls_fast.engine.a", "pycls_fast.engine.b", "pycls_fast.engine"}
    edges = {
        "pycls_fast.engine.a": imports_of(a, "pycls_fast.engine.a", known),
        "pycls_fast.engine.b": imports_of(b, "pycls_fast.engine.b", known),
    }
    assert edges["pycls_fast.engine.a"] == {"pycls_fast.engine", "pycls_fast.engine.b"}
    assert edges["pycls_fast.engine.b"] == {"pycls_fast.engine", "pycls_fast.engine.a"}
    assert cycles_in(edges) == [
        "pycls_fast.engine.a -> pycls_fast.engine.b -> pycls_fast.engine.a"
    ]


def test_every_module_is_on_the_architecture_map():
    """docs/ARCHITECTURE.md's module map names every module of the package."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "__init__.py" and path.name not in text
    ]
    assert missing == []
