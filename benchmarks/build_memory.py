"""Peak memory per rank while building and stepping a large ViT, sharded.

    python -m benchmarks.build_memory [--cfg configs/vit/ViT-g-14.yaml] [--nproc 2]
        [--im-size 56] [--batch 2] [--json-out FILE] [KEY VALUE ...]

Spawns `--nproc` ranks (gloo on a CPU, one GPU each otherwise) that train the
config's model under FSDP (FSDP.ENABLED True), at a reduced image size and batch so
that a step fits beside the model. Each rank first builds a one-block copy of the
model (what building imports and sets up once is not the model's), then reports:
  - baseline: its resident memory (host RSS; device memory allocated on a GPU)
    before building;
  - build: the peak while building the components (model, EMA if on, optimizer);
  - step: the peak while running `--steps` training steps (forward, backward,
    optimizer step: gradients and optimizer state of its shard appear);
next to the whole model's fp32 bytes and the bytes this rank holds in parameters,
gradients and optimizer state (`state_bytes`). In brackets next to each peak: the
bytes of the tensors live at that moment (engine/dry_run.py's `LiveBytes` on the
real run: storages created since the baseline, the step's over the built state),
so that resident memory splits into tensors and what the allocator holds beyond
them (freed blocks the C heap keeps, fragmentation). The goal: a rank's build peak is
about its shard (whole / nproc; x 2 with the EMA), not the whole model.

Defaults keep two CPU ranks of ViT-g/14 (1.01B parameters, 4.05 GB in fp32) within
~13 GB of host memory: SGD without momentum (no optimizer state: AdamW would add two
shards) and no EMA (`--ema` adds one shard). The host has no swap: check `free -g`
first. Runs on main's code too (for a before / after): only build_components,
train_step, synthetic_batch and LiveBytes are used.
"""

import argparse
import json
import os
import platform
import resource
import tempfile
import time
from functools import partial

import torch

from pycls_fast.config import load_cfg
from pycls_fast.engine import timing
from pycls_fast.engine.dry_run import LiveBytes
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.launch import processes as launch
from pycls_fast.launch.cli import run
from pycls_fast.parallel.data_parallel import state_bytes
from pycls_fast.runtime import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


def _host_peak() -> int:
    """This process's peak resident memory so far, bytes (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _host_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory(device: torch.device) -> tuple[int, int]:
    """(now, peak so far) bytes: device memory allocated on a GPU, else host RSS."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(
            device
        )
    return _host_now(), _host_peak()


def _reset_peak(device: torch.device) -> None:
    # The host's peak cannot be reset: it is read as growth over the baseline.
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def measure(cfg, steps: int = 1) -> list[dict] | None:
    """Every rank: build (after a one-block warm-up), `steps` training steps;
    returns the ranks' records (launch keeps rank 0's)."""
    device = distributed.device()
    warm = cfg.clone()
    warm.defrost()
    warm.VIT.NUM_LAYERS = 1
    seed_everything(cfg.RNG_SEED)
    build_components(warm, loaders=False)
    _reset_peak(device)
    base_now, _ = _memory(device)
    start = time.perf_counter()
    build_tensors = LiveBytes()
    with build_tensors:
        parts = build_components(cfg, loaders=False)
    build_s = time.perf_counter() - start
    built_now, build_peak = _memory(device)
    _reset_peak(device)
    per_rank = cfg.TRAIN.BATCH_SIZE // parts.layout.dp
    inputs, targets = timing.synthetic_batch(parts, per_rank, cfg.TRAIN.IM_SIZE)
    start = time.perf_counter()
    step_tensors = LiveBytes()
    with step_tensors:
        for _ in range(steps):
            loss, _, _ = train_step(parts, inputs, targets)
    loss = float(loss)
    step_s = (time.perf_counter() - start) / steps
    step_now, step_peak = _memory(device)
    held = state_bytes(parts.model, parts.optimizer)
    whole = sum(p.numel() for p in parts.model.parameters()) * 4
    ema = 0
    if parts.ema is not None:
        ema = sum(
            distributed.local_tensor(t).nbytes for t in parts.ema.state_dict().values()
        )
    record = {
        "rank": distributed.rank(),
        "baseline_bytes": base_now,
        "build_peak_growth": build_peak - base_now,
        "step_peak_growth": step_peak - base_now,
        "built_bytes": built_now - base_now,
        # The tensors' own bytes (storages), at the peaks and after building: what
        # the growth of resident memory holds beyond them is the allocator's.
        "build_tensor_peak": build_tensors.peak,
        "built_tensor_bytes": build_tensors.live,
        # Above the built state: the step's new tensors at their peak.
        "step_tensor_peak": build_tensors.live + step_tensors.peak,
        "whole_fp32_bytes": whole,
        "held": held,
        "ema_bytes": ema,
        "build_s": build_s,
        "step_s": step_s,
        "loss": loss,
    }
    return distributed.all_gather_object(record)


def _table(records, args, device_text):
    whole = records[0]["whole_fp32_bytes"]
    lines = [
        f"{args.cfg}: whole model {whole / GB:.2f} GB fp32; {args.nproc} ranks, "
        f"FSDP, {device_text}",
        "rank | baseline GB | build peak +GB (x whole) [tensors] "
        "| step peak +GB (x whole) [tensors] "
        "| params GB | grads GB | optimizer GB | EMA GB | build s | step s",
    ]
    for r in records:
        h, build, step = r["held"], r["build_peak_growth"], r["step_peak_growth"]
        tb, ts = r["build_tensor_peak"], r["step_tensor_peak"]
        lines.append(
            f"{r['rank']} | {r['baseline_bytes'] / GB:.2f} | "
            f"{build / GB:.2f} ({build / whole:.2f}) [{tb / GB:.2f} ({tb / whole:.2f})]"
            f" | {step / GB:.2f} ({step / whole:.2f}) [{ts / GB:.2f} "
            f"({ts / whole:.2f})] | "
            f"{h['params'] / GB:.2f} | {h['grads'] / GB:.2f} | "
            f"{h['optimizer'] / GB:.2f} | {r['ema_bytes'] / GB:.2f} | "
            f"{r['build_s']:.1f} | {r['step_s']:.1f}"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cfg", default=os.path.join(ROOT, "configs/vit/ViT-g-14.yaml")
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--im-size", type=int, default=56)
    parser.add_argument("--batch", type=int, default=2, help="global batch")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--ema", action="store_true", help="keep the config's EMA")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("opts", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="build_memory_")
    opts = [
        "NUM_GPUS", str(args.nproc), "FSDP.ENABLED", "True",
        "TRAIN.IM_SIZE", str(args.im_size), "TEST.IM_SIZE", str(args.im_size),
        "TRAIN.BATCH_SIZE", str(args.batch), "TEST.BATCH_SIZE", str(args.batch),
        "OPTIM.OPTIMIZER", "sgd", "OPTIM.MOMENTUM", "0.0", "OPTIM.NESTEROV", "False",
        "OPTIM.MTA", "False",
        "OUT_DIR", out,
    ]  # fmt: skip
    if not args.ema:
        opts += ["OPTIM.EMA_ALPHA", "0.0"]
    cfg = load_cfg(args.cfg, [*opts, *args.opts])
    records = launch.launch(partial(measure, steps=args.steps), cfg)
    device_text = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    )
    print(_table(records, args, device_text))
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "cfg": args.cfg,
                    "nproc": args.nproc,
                    "im_size": args.im_size,
                    "batch": args.batch,
                    "ema": args.ema,
                    "torch": torch.__version__,
                    "device": device_text,
                    "ranks": records,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    run(main)
