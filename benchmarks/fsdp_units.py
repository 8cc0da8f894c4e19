"""The cost of FSDP units under AMP O2: the norms as one fp32 unit (what
parallel/data_parallel.py does) against a unit per norm (what it did), beside O1.

    python -m benchmarks.fsdp_units [--rounds 9] [--cfg configs/vit/ViT-B-16.yaml]

One process (FSDP2 in a group of one), the ladder's batch_second (O1) and amp_o2 (O2)
rungs of --cfg at width 64 and 32 px, so that the step is the host's work (hooks,
dispatch, collectives' bookkeeping), which is what a GPU waits on when units are many.
Prints the first three losses of each (the wrapping changes no number) and the median
step over interleaved rounds (benchmarks/harness.py).
"""

import argparse
import statistics

import torch
import torch.distributed.fsdp as fsdp

from benchmarks.harness import interleave
from benchmarks.ladder_dist import rung_configs
from pycls_fast.engine import timing
from pycls_fast.engine.trainer import build_components, seed_everything, train_step
from pycls_fast.launch.processes import init_single_process_group

NARROW = ["TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32", "VIT.HIDDEN_DIM", "64",
          "VIT.MLP_DIM", "256", "VIT.NUM_HEADS", "2"]  # fmt: skip


def _unit_per_module(shard):
    """fully_shard that makes a list of modules one unit each (the old wrapping)."""

    def wrap(module, **kw):
        for m in module if isinstance(module, list) else [module]:
            shard(m, **kw)
        return module

    return wrap


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cfg", default="configs/vit/ViT-B-16.yaml")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(2)
    rungs = {n: c for n, _, c in rung_configs(args.cfg, NARROW, 4, 1, 32)}
    init_single_process_group(rungs["ddp"])
    shard = fsdp.fully_shard
    variants = [
        ("O1", "batch_second", shard),
        ("O2, a unit per norm", "amp_o2", _unit_per_module(shard)),
        ("O2, one unit for the norms", "amp_o2", shard),
    ]
    built = {}
    for label, rung, wrap in variants:
        fsdp.fully_shard = wrap  # parallel/data_parallel.py imports it when sharding
        try:
            seed_everything(0)
            parts = build_components(rungs[rung], loaders=False)
        finally:
            fsdp.fully_shard = shard
        x, y = timing.synthetic_batch(parts, 4, 32)
        losses = [round(float(train_step(parts, x, y)[0]), 6) for _ in range(3)]
        print(f"{label}: losses {losses}", flush=True)
        built[label] = (parts, x, y)
    steps = {label: (lambda b=b: train_step(*b)) for label, b in built.items()}
    times, _ = interleave(
        steps, torch.device("cpu"), rounds=args.rounds, iters=3, warmup=0
    )
    base = statistics.median(times["O1"])
    for label, t in times.items():
        med = statistics.median(t)
        print(f"{label}: step {1000 * med:.1f} ms ({med / base:.2f}x O1)")


if __name__ == "__main__":
    main()
