"""What this process runs on, and why asked-for GPUs cannot be used.

    describe_device()        # "cpu (2 cores), torch 2.14.1+cpu" or
                             # "cuda:0 NVIDIA H100 80GB HBM3, torch 2.14.1+cu128,
                             #  CUDA 12.8, driver 570.86.15"
    check_gpus_usable(cfg)   # DeviceError when GPUs are asked for but unusable

A machine without an NVIDIA driver is a CPU machine whatever the torch build: there
NUM_GPUS N runs N CPU processes (gloo), as pycls_fast always has.
"""

import os
import re
import shutil
import subprocess
from importlib import metadata

import torch
from yacs.config import CfgNode

from pycls_fast.errors import DeviceError

# Oldest Linux driver branch that runs each CUDA major version (with CUDA's minor
# version compatibility), from NVIDIA's CUDA toolkit release notes.
_MIN_DRIVER = {11: 450, 12: 525, 13: 580}
# The newest PyTorch CUDA wheel index each driver branch can run.
_WHEEL_FOR_DRIVER = ((580, "cu130"), (525, "cu126"), (450, "cu118"))
WHEEL_INDEX = "https://download.pytorch.org/whl/{tag}"
# The releases the suite runs with (requirements.lock), kept equal to setup.py's
# floors. Older ones were seen to fail (docs/PERFORMANCE.md, "First measurements on
# a GPU"): torch 2.11's PipelineStage takes no example gradients (plan_net --dry-run
# with PARALLEL.PP), timm 1.0.30's save_for_hf no data_config (tools/export.py).
TESTED_FLOORS = {"torch": "2.14", "timm": "1.0.31"}


def _release(version: str) -> tuple[int, ...]:
    """(2, 11, 0) of "2.11.0+cu130" or "2.11.0a0": the leading numeric release."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def outdated_packages(versions: dict[str, str] | None = None) -> list[str]:
    """One "name version, older than floor" per package older than TESTED_FLOORS;
    `versions` (name -> version) defaults to the installed torch and timm."""
    if versions is None:
        # The installed timm's version from its metadata: importing timm costs seconds
        # (it imports wandb where installed), and a run that needs none of it pays them
        # at every start.
        versions = {"torch": torch.__version__, "timm": metadata.version("timm")}
    return [
        f"{name} {versions[name]}, older than {floor}"
        for name, floor in TESTED_FLOORS.items()
        if name in versions and _release(versions[name]) < _release(floor)
    ]


def outdated_warning() -> str | None:
    """The warning line for outdated packages, with the fix; None when none is."""
    old = outdated_packages()
    if not old:
        return None
    pins = " ".join(f"'{n}>={v}'" for n, v in TESTED_FLOORS.items())
    return (
        f"{'; '.join(old)} (the oldest releases this project is tested with): "
        f"pip install {pins}"
    )


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version ("570.86.15"), or None without a driver.

    Read from /proc/driver/nvidia/version, else asked of nvidia-smi."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            match = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", f.read())
        if match:
            return match.group(1)
    except OSError:
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out[0] if out else "unknown"


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def describe_device(device: torch.device | str | None = None) -> str:
    """One line naming `device` (default: this process's current CUDA device when
    CUDA is usable, else the CPU), the torch version and, on CUDA, the CUDA version,
    driver and GPU model; for the start-up log."""
    versions = f"torch {torch.__version__}"
    device = torch.device(device) if device is not None else None
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if device.type != "cuda":
        return f"{device.type} ({_cores()} cores), {versions}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    return (
        f"cuda:{index} {name}, {versions}, CUDA {torch.version.cuda}, "
        f"driver {driver_version() or 'unknown'}"
    )


def _wheel_hint(driver: str | None) -> str:
    major = _major(driver)
    tag = next((t for d, t in _WHEEL_FOR_DRIVER if major and major >= d), "cu126")
    return (
        f"install a torch build this driver runs: pip install torch --index-url "
        f"{WHEEL_INDEX.format(tag=tag)}"
    )


def _major(version: str | None) -> int | None:
    match = re.match(r"(\d+)", version or "")
    return int(match.group(1)) if match else None


def cuda_unusable_reason() -> str | None:
    """Why CUDA is not usable on a machine that has an NVIDIA driver, with the fix;
    None when CUDA is usable, when there is no driver (a CPU machine) or when
    CUDA_VISIBLE_DEVICES is set empty (the CPU was chosen on purpose)."""
    if torch.cuda.is_available() or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return None
    driver = driver_version()
    if driver is None:
        return None
    build = torch.version.cuda
    if build is None:
        return (
            f"torch {torch.__version__} is a CPU-only build while NVIDIA driver "
            f"{driver} is installed: {_wheel_hint(driver)}"
        )
    needed = _MIN_DRIVER.get(_major(build))
    have = _major(driver)
    if needed and have and have < needed:
        return (
            f"NVIDIA driver {driver} is too old for torch {torch.__version__} "
            f"(built for CUDA {build}, which needs driver >= {needed}): update the "
            f"driver, or {_wheel_hint(driver)}"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return (
        f"no GPU is visible to torch {torch.__version__} (CUDA {build}, driver "
        f"{driver}){where}: check nvidia-smi, CUDA_VISIBLE_DEVICES and the "
        "container's GPU access"
    )


def check_gpus_usable(cfg: CfgNode) -> None:
    """Raises DeviceError when the config asks for GPUs (NUM_GPUS > 1 or a torchrun
    world, with DIST_BACKEND 'nccl') that this machine has but cannot use; on a
    machine without an NVIDIA driver the job runs on CPUs instead, as before."""
    world = int(os.environ.get("WORLD_SIZE", cfg.NUM_GPUS))
    if max(world, cfg.NUM_GPUS) <= 1 or cfg.DIST_BACKEND != "nccl":
        return
    reason = cuda_unusable_reason()
    if reason:
        raise DeviceError(
            f"NUM_GPUS {cfg.NUM_GPUS} with DIST_BACKEND 'nccl' asks for GPUs, but "
            f"{reason} (or set DIST_BACKEND gloo to run on CPUs)"
        )


def check_local_rank(local_rank: int) -> None:
    """Raises DeviceError when LOCAL_RANK names no visible GPU: two ranks would share
    one (NCCL's 'Duplicate GPU detected' at the first collective)."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceError(
            f"LOCAL_RANK {local_rank} but only {count} GPUs are visible: start "
            f"torchrun with --nproc_per_node <= {count} or set CUDA_VISIBLE_DEVICES"
        )
