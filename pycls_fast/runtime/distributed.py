"""Process-group helpers: rank, world size, the device of this process, reductions
and object exchange. Pure helpers: starting and joining process groups is
launch/processes.py's.

Work in a single process needs none of it: every helper falls back to rank 0 of 1.
"""

import datetime
import hashlib
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from yacs.config import CfgNode

from pycls_fast.errors import ConfigError
from pycls_fast.runtime.device_info import check_local_rank


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    """Whether this process writes logs, plots and single-file outputs."""
    return rank() == 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def device() -> torch.device:
    """This process's device: GPU LOCAL_RANK when CUDA is usable, else the CPU.

    Raises DeviceError (a ConfigError) when LOCAL_RANK names no visible GPU, rather
    than putting two ranks on one GPU."""
    if torch.cuda.is_available():
        check_local_rank(local_rank())
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP parameter, gradient, state), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_reduce_sum(values: Iterable[float]) -> list[float]:
    """Sums a list of floats across processes (identity in a single process)."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def all_reduce_max(values: Iterable[float]) -> list[float]:
    """Maximum of a list of floats across processes (identity in a single process)."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def _all_reduce(values, op):
    if not is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_reduce_device())
    dist.all_reduce(t, op=op)
    return t.tolist()


def _reduce_device():
    # NCCL reduces CUDA tensors only; gloo reduces CPU tensors.
    return device() if dist.get_backend() == "nccl" else torch.device("cpu")


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def patient_group(timeout_s: float):
    """A gloo group of every rank whose collectives wait up to `timeout_s`, not the
    job's DIST.TIMEOUT_S: for `wait_for_all` after work of uneven length (a
    download). Every rank calls it, at the same point; None in a single process."""
    if not is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def wait_for_all(group, what: str) -> None:
    """Every rank waits on `group` (patient_group's) until all arrive; a
    RuntimeError naming `what` when its timeout passes first."""
    if group is None:
        return
    try:
        dist.barrier(group=group)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RuntimeError(
            f"rank {rank()} waited in vain for {what} (DIST.PULL_TIMEOUT_S): {first}"
        ) from None


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj`, on every rank (identity in a single process)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order ([obj] in a single process)."""
    if not is_initialized():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def check_same_config(cfg: CfgNode) -> None:
    """Raises ConfigError when any rank was started with another config than rank 0
    (e.g. different command-line overrides on different nodes)."""
    if not is_initialized():
        return
    digests = all_gather_object(hashlib.sha256(cfg.dump().encode()).hexdigest())
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ConfigError(
            f"the config of rank {differ[0]} differs from rank 0's: start every "
            "process with the same --cfg file and KEY VALUE overrides"
        )


def destroy_process_group() -> None:
    if is_initialized():
        dist.destroy_process_group()
