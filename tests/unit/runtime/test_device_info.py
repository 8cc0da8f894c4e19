"""Device checks: LOCAL_RANK against the visible GPUs, GPUs asked for but unusable,
the device line of the start-up log. CUDA is faked by monkeypatching torch.cuda."""

import ast
import os
import subprocess
import sys
from importlib import metadata

import pytest
import torch
import torch.distributed as dist

from pycls_fast.errors import ConfigError, DeviceError
from pycls_fast.launch import processes as launch
from pycls_fast.runtime import device_info, distributed
from tests.helpers import ROOT, tiny_cfg


def _fake_cuda(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    return calls


def test_local_rank_beyond_the_visible_gpus_is_one_clear_error(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ConfigError) as e:
        distributed.device()
    assert str(e.value) == (
        "LOCAL_RANK 3 but only 2 GPUs are visible: start torchrun with "
        "--nproc_per_node <= 2 or set CUDA_VISIBLE_DEVICES"
    )
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.device() == torch.device("cuda", 1)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_process_group_is_bound_to_the_local_gpu(monkeypatch, backend):
    set_device = _fake_cuda(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: seen.update(k))
    launch.init_process_group(tiny_cfg("DIST_BACKEND", backend))
    assert set_device == [torch.device("cuda", 1)]
    assert seen.get("device_id") == (
        torch.device("cuda", 1) if backend == "nccl" else None
    )


def test_one_process_fsdp_group_sets_the_local_gpu(monkeypatch):
    set_device = _fake_cuda(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: seen.update(k))
    launch.init_single_process_group(tiny_cfg("FSDP.ENABLED", "True"))
    assert set_device == [torch.device("cuda", 2)]
    assert seen["device_id"] == torch.device("cuda", 2) and seen["world_size"] == 1


def test_cpu_group_binds_no_device(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    assert launch._bind_device(tiny_cfg()) == {}


def _machine(monkeypatch, driver, build, visible=None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_info, "driver_version", lambda: driver)
    monkeypatch.setattr(torch.version, "cuda", build)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_cpu_machine_keeps_running_cpu_processes(monkeypatch):
    # No NVIDIA driver: a CPU machine whatever the torch build (this one is +cu130).
    for build in (None, "13.0"):
        _machine(monkeypatch, None, build)
        device_info.check_gpus_usable(tiny_cfg("NUM_GPUS", "2"))


def test_gpus_asked_for_on_a_driver_too_old_for_the_build(monkeypatch):
    _machine(monkeypatch, "535.104.05", "13.0")
    with pytest.raises(DeviceError) as e:
        device_info.check_gpus_usable(tiny_cfg("NUM_GPUS", "2"))
    line = str(e.value)
    assert "driver 535.104.05 is too old" in line and "needs driver >= 580" in line
    assert "https://download.pytorch.org/whl/cu126" in line and "\n" not in line
    # gloo asks for CPUs; one process asks for nothing.
    device_info.check_gpus_usable(tiny_cfg("NUM_GPUS", "2", "DIST_BACKEND", "gloo"))
    device_info.check_gpus_usable(tiny_cfg())


def test_gpus_asked_for_with_a_cpu_build_or_none_visible(monkeypatch):
    _machine(monkeypatch, "580.65.06", None)
    with pytest.raises(DeviceError, match="CPU-only build.*whl/cu130"):
        device_info.check_gpus_usable(tiny_cfg("NUM_GPUS", "2"))
    _machine(monkeypatch, "580.65.06", "13.0", visible="7")
    with pytest.raises(DeviceError, match="no GPU is visible.*'7'"):
        device_info.check_gpus_usable(tiny_cfg("NUM_GPUS", "2"))
    # An empty CUDA_VISIBLE_DEVICES chooses the CPU on purpose (the test suite's).
    _machine(monkeypatch, "580.65.06", "13.0", visible="")
    device_info.check_gpus_usable(tiny_cfg("NUM_GPUS", "2"))


def test_launch_refuses_unusable_gpus_before_any_work(monkeypatch):
    _machine(monkeypatch, "535.104.05", "13.0")
    ran = []
    with pytest.raises(DeviceError):
        launch.launch(ran.append, tiny_cfg("NUM_GPUS", "2"))
    assert ran == []


def test_describe_device_on_cpu():
    line = device_info.describe_device("cpu")
    assert line.startswith("cpu (") and f"torch {torch.__version__}" in line


def test_outdated_packages_compare_releases_not_strings():
    from pycls_fast.runtime.device_info import TESTED_FLOORS, outdated_packages

    assert TESTED_FLOORS == {"torch": "2.14", "timm": "1.0.31"}
    # The GPU image of docs/PERFORMANCE.md: both older.
    assert outdated_packages({"torch": "2.11.0+cu130", "timm": "1.0.29"}) == [
        "torch 2.11.0+cu130, older than 2.14",
        "timm 1.0.29, older than 1.0.31",
    ]
    # "2.9" < "2.14" as releases, though not as strings; local tags and pre-releases
    # compare by their release.
    assert outdated_packages({"torch": "2.9.1"}) == ["torch 2.9.1, older than 2.14"]
    assert outdated_packages({"torch": "2.14.1+cpu", "timm": "1.0.31"}) == []
    assert outdated_packages({"torch": "2.15.0a0+git1234", "timm": "1.1.0"}) == []


def test_the_installed_packages_are_not_outdated():
    from pycls_fast.runtime.device_info import outdated_packages, outdated_warning

    assert outdated_packages() == [] and outdated_warning() is None


def test_the_version_check_reads_timm_metadata_without_importing_timm():
    """Every run's start checks timm's version; importing timm there cost each
    process seconds (timm imports wandb where installed) that a run without timm's
    parts never needed."""
    import timm

    code = (
        "import sys\n"
        "from pycls_fast.runtime.device_info import outdated_packages\n"
        "outdated_packages()\n"
        "print(sorted(m for m in ('timm', 'wandb') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert metadata.version("timm") == timm.__version__


def test_the_outdated_warning_names_the_fix(monkeypatch):
    from pycls_fast.runtime import device_info

    monkeypatch.setattr(
        device_info, "outdated_packages", lambda: ["torch 2.11.0, older than 2.14"]
    )
    assert device_info.outdated_warning() == (
        "torch 2.11.0, older than 2.14 (the oldest releases this project is tested "
        "with): pip install 'torch>=2.14' 'timm>=1.0.31'"
    )


def test_setup_py_requires_the_tested_floors():
    """setup.py's install_requires floors are the versions the warning names: a pip
    install never resolves to a torch or timm the start-up line would call outdated."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    requires = next(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.keyword) and node.arg == "install_requires"
    )
    floors = {}
    for item in ast.literal_eval(requires):
        name, _, rest = item.partition(">=")
        floors[name] = rest.split(",")[0]
    tested = device_info.TESTED_FLOORS
    assert {name: floors[name] for name in tested} == tested
