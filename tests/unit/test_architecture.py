"""The import-layer rule of docs/ARCHITECTURE.md: imports go down the layers only,
and the package's import graph has no cycles (module-level and function-level
imports alike)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pycls_fast"

# Lowest first; a module may import its own layer and the layers below it. The
# longest matching prefix names a module's layer. Keep in step with ARCHITECTURE.md.
LAYERS = [
    ["pycls_fast.errors", "pycls_fast.storage"],
    ["pycls_fast.config", "pycls_fast.config_doc"],
    ["pycls_fast.models"],
    ["pycls_fast.datasets"],
    ["pycls_fast.core"],  # the components: distributed, precision, parallel, ...
    ["pycls_fast.core.preemption"],
    ["pycls_fast.core.checkpoint", "pycls_fast.core.distill"],
    ["pycls_fast.core.trainer"],
    ["pycls_fast.core.timing", "pycls_fast.core.evaluation"],  # use the trainer
    ["pycls_fast.core.launch"],
    ["pycls_fast.core.submit"],  # submits what launch runs, through submitit
    ["pycls_fast.core.cli"],
    ["pycls_fast.sweep"],
]


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


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in graph().items()
        if m != "pycls_fast"
        for t in targets
        if layer_of(t) > layer_of(m)
    ]
    assert upward == []


def test_import_graph_has_no_cycles():
    edges = graph()
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
    assert cycles == []


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
    a.write_text("from pycls_fast.core import b\n")
    b.write_text("def f():\n    from pycls_fast.core import a\n")
    known = {"pycls_fast.core.a", "pycls_fast.core.b", "pycls_fast.core"}
    both = {"pycls_fast.core", "pycls_fast.core.b"}
    assert imports_of(a, "pycls_fast.core.a", known) == both
    assert imports_of(b, "pycls_fast.core.b", known) == {
        "pycls_fast.core",
        "pycls_fast.core.a",
    }
    assert layer_of("pycls_fast.core.trainer") > layer_of("pycls_fast.core.parallel")


def test_every_module_is_on_the_architecture_map():
    """docs/ARCHITECTURE.md's module map names every module of the package."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "__init__.py" and path.name not in text
    ]
    assert missing == []
