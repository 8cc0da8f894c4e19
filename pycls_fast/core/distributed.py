"""Process-group helpers: rank, world size, the device of this process, reductions.

Work in a single process needs none of it: every helper falls back to rank 0 of 1.
"""

import os

import torch
import torch.distributed as dist


def is_initialized():
    return dist.is_available() and dist.is_initialized()


def rank():
    return dist.get_rank() if is_initialized() else 0


def world_size():
    return dist.get_world_size() if is_initialized() else 1


def is_main():
    """Whether this process writes logs, plots and single-file outputs."""
    return rank() == 0


def local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))


def device():
    """This process's device: its GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def all_reduce_sum(values):
    """Sums a list of floats across processes (identity in a single process)."""
    if not is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_reduce_device())
    dist.all_reduce(t)
    return t.tolist()


def _reduce_device():
    # NCCL reduces CUDA tensors only; gloo reduces CPU tensors.
    return device() if dist.get_backend() == "nccl" else torch.device("cpu")


def barrier():
    if is_initialized():
        dist.barrier()
