"""What `make demo` and `make test` install: the demo the runtime pins only
(requirements-runtime.lock, closed under the packages' own requirements), the tests
everything (requirements.lock) on top, both from nothing."""

import importlib.metadata as md
import os
import re
import shutil
import subprocess

import pytest
from packaging.requirements import Requirement

from tests.helpers import ROOT

# The package's requirements, the demo's dataset (scikit-learn), and what the
# after-training section of GETTING_STARTED runs after `make demo` (the ONNX export
# and onnxruntime).
RUNTIME = ["torch", "timm", "spdl", "yacs", "numpy", "pillow", "pyyaml", "psutil",
           "tqdm", "matplotlib", "submitit", "fsspec", "scikit-learn",
           "torchao", "onnx", "onnxscript", "onnxruntime"]  # fmt: skip


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(name):
    with open(os.path.join(ROOT, name)) as f:
        lines = [x.strip() for x in f if x.strip() and not x.startswith("#")]
    return {_norm(x.split("==")[0]): x.split("==")[1] for x in lines}


def _closure(roots):
    """The installed distributions that `roots` need (extras followed)."""
    seen, done, stack = set(), set(), [(r, frozenset()) for r in roots]
    while stack:
        name, extras = stack.pop()
        if (_norm(name), extras) in done:
            continue
        done.add((_norm(name), extras))
        seen.add(_norm(name))
        for text in md.distribution(name).requires or []:
            req = Requirement(text)
            wanted = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker and not any(req.marker.evaluate(env) for env in wanted):
                continue
            stack.append((req.name, frozenset(req.extras)))
    return seen


def test_runtime_pins_are_the_full_locks_and_closed():
    runtime, full = _pins("requirements-runtime.lock"), _pins("requirements.lock")
    assert all(full.get(k) == v for k, v in runtime.items())  # same versions
    # setuptools comes with the venv; everything else the runtime needs is pinned.
    assert _closure(RUNTIME) - {"setuptools"} <= set(runtime)
    for test_only in ("pytest", "ruff", "moto", "cfn-lint", "docker", "flask"):
        assert test_only not in runtime, test_only


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_demo_installs_the_runtime_and_make_test_everything():
    def commands(target):
        out = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, text=True,
                             capture_output=True, check=True).stdout  # fmt: skip
        return [x for x in out.splitlines() if "pip install" in x or "venv" in x]

    demo = commands("demo")
    assert demo[0].endswith("-m venv .venv")
    assert any("-r requirements-runtime.lock" in x for x in demo)
    assert not any("-r requirements.lock" in x for x in demo)
    test = commands("test")
    assert test[0].endswith("-m venv .venv")  # from nothing
    runtime = next(i for i, x in enumerate(test) if "requirements-runtime.lock" in x)
    full = next(i for i, x in enumerate(test) if "-r requirements.lock" in x)
    assert runtime < full


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("status,code", [(130, 0), (143, 0), (1, 2)])
def test_make_demo_ends_quietly_after_a_stop(tmp_path, status, code):
    """A stopped training (Ctrl-C: 130, SIGTERM: 143) ends `make demo` with status 0
    and no "Error 130" (train_net said how to resume); a failure is make's error."""
    fake = tmp_path / "python"
    fake.write_text(
        '#!/bin/sh\ncase "$*" in *train_net.py*) exit "$TRAIN_STATUS";; esac\n'
    )
    fake.chmod(0o755)
    out = subprocess.run(
        ["make", "-o", ".venv/.installed", "demo", f"PY={fake}"], cwd=ROOT,
        env={**os.environ, "TRAIN_STATUS": str(status)}, capture_output=True,
        text=True,
    )  # fmt: skip
    assert out.returncode == code, out.stderr
    assert ("Error" in out.stderr) == (code != 0), out.stderr
