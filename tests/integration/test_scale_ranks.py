"""A cluster run's second day, on 2 gloo ranks of one job (issue 37): each rank
plays the first rank of its own node (LOCAL_RANK 0), with a node-local folder where
a step says so, and the collectives time out after DIST.TIMEOUT_S 5 s, so that a
rank waiting for a collective the other never calls fails the job instead of
hanging it. One spawned job runs every step in turn (the processes' start-up is
the cost: shared); each test below asserts what its step recorded.

- async: DDP with asynchronous checkpoints, rank 0's writes slowed past the next
  save, a keep-best evaluation, a stop checkpoint and the end: every rank must run
  the same collectives;
- resume: node-local folders that differ (rank 0's holds a newer checkpoint):
  every rank must resume from the same one;
- retention: FSDP into node-local folders with TRAIN.CHECKPOINT_KEEP 1, a leftover
  of a crashed write on node 1: node 1's folder must keep what rank 0's keeps;
- fetch: a sharded checkpoint on a store (file://), fresh mirrors, node 1's
  downloads slowed past DIST.TIMEOUT_S: each node fetches what its ranks read,
  several files at a time, and the ranks wait for each other patiently;
- tensor_parallel: TP 2, one rank's gradients of the replicated parameters off in
  their last bits (as non-deterministic kernels make them): the replicas must stay
  equal;
- teacher: DISTILL under FSDP: the teacher built sharded, as the student is.
"""

import contextlib
import json
import os
import shutil
import threading
import time

import pytest
import torch

from pycls_fast.checkpoint import files
from pycls_fast.config import with_overrides
from pycls_fast.launch import processes
from pycls_fast.runtime import distributed
from tests.helpers import tiny_cfg

pytestmark = pytest.mark.slow

# Longer than DIST.TIMEOUT_S: a wait through a collective fails.
SLOW_S = 6.0


def _record(base, step, value):
    """Adds this rank's `value` of `step` to its results file."""
    path = os.path.join(base, f"rank{distributed.rank()}.json")
    done = json.load(open(path)) if os.path.exists(path) else {}  # noqa: SIM115
    done[step] = value
    with open(path, "w") as f:
        json.dump(done, f)


def _parts(cfg):
    from pycls_fast.engine.trainer import build_components

    torch.manual_seed(0)
    return build_components(cfg, loaders=())


def _names(out_dir):
    folder = files.checkpoint_dir(out_dir)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _async_step(cfg, base):
    """DDP, TRAIN.CHECKPOINT_ASYNC: rank 0's write takes longer than the steps to
    the next save, so rank 1 finds its (empty) write done first."""
    from pycls_fast.checkpoint import CheckpointManager
    from pycls_fast.errors import Stopped

    out = os.path.join(base, "async")
    cfg = with_overrides(
        cfg,
        {"OUT_DIR": out, "TRAIN.CHECKPOINT_ASYNC": True,
         "TRAIN.CHECKPOINT_KEEP_BEST": True},
    )  # fmt: skip
    manager = CheckpointManager(_parts(cfg))
    if distributed.is_main():
        real = files.save_checkpoint

        def slow(*args, **kwargs):
            time.sleep(SLOW_S / 12)  # past the next save: rank 1 is there at once
            return real(*args, **kwargs)

        files.save_checkpoint = slow
    try:
        for iteration in (1, 2):
            manager.save(0, iteration)  # the second one meets the first in flight
            manager.poll()
        manager.save(1, 0)  # the end of epoch 1
        manager.poll()
        manager.after_eval(0, 50.0)  # keep-best: its checkpoint may be in flight
        manager.save(1, 1)
        manager.poll()
        with contextlib.suppress(Stopped):  # a stop: the write in flight first
            manager.after_iteration(1, 2, 10, signum=15)
        manager.close()
    finally:
        if distributed.is_main():
            files.save_checkpoint = real
    _record(base, "async", _names(out))


def _resume_step(cfg, base):
    """Node-local folders: rank 0's holds a newer complete checkpoint than node 1's
    (its upload was cut short by a stop)."""
    from pycls_fast.checkpoint import CheckpointManager

    written = files.checkpoint_dir(os.path.join(base, "async"))
    out = os.path.join(base, f"resume_node{distributed.rank()}")
    os.makedirs(files.checkpoint_dir(out), exist_ok=True)
    names = ["model_epoch_0001_iter_000002.pyth"]
    if distributed.is_main():
        names.append("model_epoch_0001.pyth")
    for name in names:
        shutil.copy(os.path.join(written, name), files.checkpoint_dir(out))
    manager = CheckpointManager(_parts(with_overrides(cfg, {"OUT_DIR": out})))
    _record(base, "resume", list(manager.restore()))


def _retention_step(cfg, base):
    """FSDP into node-local folders, keeping 1 checkpoint; node 1's folder holds a
    leftover of a write cut short (as a crash leaves it)."""
    from pycls_fast.checkpoint import CheckpointManager
    from pycls_fast.parallel.tensor_parallel import canonical_state_dict

    out = os.path.join(base, f"retention_node{distributed.rank()}")
    leftover = os.path.join(files.checkpoint_dir(out), "model_epoch_0009.dcp.tmp")
    if not distributed.is_main():
        os.makedirs(leftover)
    distributed.barrier()
    cfg = with_overrides(
        cfg, {"OUT_DIR": out, "FSDP.ENABLED": True, "TRAIN.CHECKPOINT_KEEP": 1}
    )
    parts = _parts(cfg)
    manager = CheckpointManager(parts)
    for epoch in (1, 2, 3):
        with torch.no_grad():  # weights of their own at each save
            for p in parts.model.parameters():
                distributed.local_tensor(p).add_(0.5)
        manager.save(epoch, 0)
    manager.close()
    weights = canonical_state_dict(parts.model, 1)
    torch.save(weights, os.path.join(base, "retention_weights.pt"))
    _record(base, "retention", _names(out))


def _slow_downloads(remote):
    """Node 1's downloads of checkpoint shards: each waits for another to be in
    flight (two downloads at once, or a BrokenBarrierError), then takes SLOW_S."""
    both = threading.Barrier(2, timeout=4 * SLOW_S)
    real = remote.fs.get_file

    def get_file(src, dest, *args, **kwargs):
        if src.endswith(".distcp"):
            both.wait()
            time.sleep(SLOW_S)
        return real(src, dest, *args, **kwargs)

    remote.fs.get_file = get_file


def _fetch_step(cfg, base):
    """A sharded checkpoint (the retention step's last, both nodes' files) on a
    store; each node resumes from it through a fresh mirror of its own."""
    from pycls_fast.checkpoint import CheckpointManager
    from pycls_fast.checkpoint.remote import RemoteOut, pull_on_each_node
    from pycls_fast.parallel.tensor_parallel import canonical_state_dict

    store = os.path.join(base, "store")
    name = "model_epoch_0003.dcp"
    if distributed.is_main():
        dest = os.path.join(files.checkpoint_dir(store), name)
        for node in (0, 1):
            src = os.path.join(base, f"retention_node{node}", "checkpoints", name)
            shutil.copytree(src, dest, dirs_exist_ok=True)
        with open(os.path.join(store, "stdout.log"), "w") as f:
            f.write("the run's log\n")
    distributed.barrier()
    mirror = os.path.join(base, f"mirror_node{distributed.rank()}")
    remote = RemoteOut(f"file://{store}", mirror, keep_last=1)
    if not distributed.is_main():
        _slow_downloads(remote)
    timeout = 10 * SLOW_S
    pull_on_each_node(remote, timeout)
    cfg = with_overrides(
        cfg,
        {"OUT_DIR": mirror, "FSDP.ENABLED": True, "TRAIN.CHECKPOINT_KEEP": 1,
         "DIST.PULL_TIMEOUT_S": timeout},
    )  # fmt: skip
    parts = _parts(cfg)
    manager = CheckpointManager(parts, remote=remote)
    position = list(manager.restore())
    saved = torch.load(os.path.join(base, "retention_weights.pt"))
    restored = canonical_state_dict(parts.model, 1)
    equal = all(torch.equal(restored[k], saved[k]) for k in saved)
    held = sorted(os.listdir(os.path.join(files.checkpoint_dir(mirror), name)))
    log = os.path.exists(os.path.join(mirror, "stdout.log"))
    record = {"position": position, "equal": equal, "held": held, "log": log}
    _record(base, "fetch", record)


def _tensor_parallel_step(cfg, base):
    """TP 2: the parameters every TP rank holds whole (stem, position embedding,
    norms, head) get gradients that differ in their last bits on one rank, as
    non-deterministic kernels (cuDNN's weight gradients) give them; after a step
    they must still be equal on both ranks."""
    from pycls_fast.engine.trainer import train_step
    from pycls_fast.parallel.tensor_parallel import _on_tp_mesh

    cfg = with_overrides(cfg, {"PARALLEL.TP": 2, "OUT_DIR": os.path.join(base, "tp")})
    parts = _parts(cfg)
    replicated = {id(p) for p in parts.tp_replicated}
    named = dict(parts.model.named_parameters())
    # Structure: every parameter is split over the TP ranks, or averaged over them.
    loose = [
        n for n, p in named.items() if not _on_tp_mesh(p) and id(p) not in replicated
    ]
    whole = sorted(n for n, p in named.items() if id(p) in replicated)
    noise = 1e-3 * distributed.rank()
    for p in parts.tp_replicated:
        p.register_hook(lambda g: g + noise)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (8,), generator=generator)
    for _ in range(2):
        train_step(parts, x, y)
    values = [named[n].detach().clone() for n in whole]
    other = distributed.all_gather_object(values)[1 - distributed.rank()]
    differ = [n for n, a, b in zip(whole, values, other) if not torch.equal(a, b)]
    _record(base, "tensor_parallel", {"loose": loose, "whole": whole, "differ": differ})


def _teacher_step(cfg, base):
    """DISTILL under FSDP: the teacher is built as the student is, never whole on a
    rank: its bytes at the build's peak are its shards plus at most one tensor;
    its logits are those of the whole teacher."""
    from pycls_fast.components.precision import AmpMode
    from pycls_fast.engine.distill import build_distiller
    from pycls_fast.engine.dry_run import LiveBytes
    from pycls_fast.models import build_model

    teacher_cfg = tiny_cfg("VIT.NUM_LAYERS", "4", "VIT.HIDDEN_DIM", "64")
    path = os.path.join(base, "teacher")
    if distributed.is_main():
        with open(path + ".yaml", "w") as f:
            f.write(teacher_cfg.dump())
        torch.manual_seed(3)
        files.save_atomically(
            {"model_state": build_model(teacher_cfg).state_dict()}, path + ".pyth"
        )
    distributed.barrier()
    cfg = with_overrides(
        cfg,
        {"FSDP.ENABLED": True, "DISTILL.TYPE": "soft",
         "DISTILL.TEACHER_CFG": path + ".yaml",
         "DISTILL.TEACHER_WEIGHTS": path + ".pyth"},
    )  # fmt: skip
    meter = LiveBytes()
    with meter:
        distiller = build_distiller(
            cfg, torch.device("cpu"), AmpMode.FP32, torch.bfloat16
        )
    whole = build_model(teacher_cfg)
    whole.load_state_dict(files.load_checkpoint(path + ".pyth")["model_state"])
    sizes = [t.numel() * t.element_size() for t in whole.state_dict().values()]
    held = [distributed.local_tensor(p) for p in distiller.teacher.parameters()]
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        same = torch.equal(distiller.teacher_logits(x), whole(x).float())
    record = {
        "peak": meter.peak,
        "held": sum(t.numel() * t.element_size() for t in held),
        "whole": sum(sizes),
        "largest": max(sizes),
        "same_logits": same,
        "note": distiller.note,
    }
    _record(base, "teacher", record)


def _job(cfg):
    """Every step in turn, on each rank; each the first rank of its own node."""
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    base = os.path.dirname(cfg.OUT_DIR)
    steps = (_async_step, _resume_step, _retention_step, _fetch_step)
    for step in (*steps, _tensor_parallel_step, _teacher_step):
        step(cfg, base)
        distributed.barrier()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each rank's record of each step ({rank: {step: value}}), and the job's error
    (None when it ended well)."""
    base = tmp_path_factory.mktemp("scale")
    cfg = tiny_cfg(
        "NUM_GPUS", "2", "DIST.TIMEOUT_S", "5", "OUT_DIR", str(base / "out"),
        "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8", "AMP.MODE", "fp32",
        "TRAIN.MIXED_PRECISION", "False",
    )  # fmt: skip
    error = None
    try:
        processes.launch(_job, cfg)
    except Exception as e:  # noqa: BLE001 - reported by each test below
        error = f"{type(e).__name__}: {e}"
    out = {}
    for rank in (0, 1):
        path = base / f"rank{rank}.json"
        out[rank] = json.loads(path.read_text()) if path.exists() else {}
    return out, error


def _step(results, step):
    out, error = results
    if step not in out[0] or step not in out[1]:
        pytest.fail(f"the job did not get through step {step!r}: {error}")
    return out[0][step], out[1][step]


def test_ddp_async_checkpoints_run_the_same_collectives_on_every_rank(results):
    rank0, _ = _step(results, "async")
    # Every save written (the stop's last), none half-written, the best pointer.
    assert rank0 == [
        "best.json", "model_epoch_0001.pyth", "model_epoch_0001_iter_000001.pyth",
        "model_epoch_0001_iter_000002.pyth", "model_epoch_0002_iter_000001.pyth",
        "model_epoch_0002_iter_000002.pyth",
    ]  # fmt: skip


def test_every_rank_resumes_from_the_checkpoint_all_folders_hold(results):
    rank0, rank1 = _step(results, "resume")
    # Rank 0's newer model_epoch_0001 is not in node 1's folder: both take iter 2.
    assert rank0 == rank1 == [0, 2]


def test_node_local_folders_keep_what_rank_0_keeps(results):
    rank0, rank1 = _step(results, "retention")
    assert rank0 == rank1 == ["model_epoch_0003.dcp"]  # the leftover .tmp gone too


def test_each_node_fetches_what_its_ranks_read_and_waits_patiently(results):
    rank0, rank1 = _step(results, "fetch")
    assert rank0["position"] == rank1["position"] == [3, 0]
    assert rank0["equal"] and rank1["equal"]
    assert rank0["log"] and rank1["log"]
    # Rank 0 reads its own shards and nothing of rank 1's file; rank 1 its own and
    # rank 0's (the values both ranks hold are written once, by rank 0).
    assert rank0["held"] == [".metadata", "__0_0.distcp"]
    assert rank1["held"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_replicated_parameters_stay_equal_over_tensor_parallel_ranks(results):
    rank0, rank1 = _step(results, "tensor_parallel")
    assert rank0["loose"] == [] == rank1["loose"]
    # The stem, the position embedding, the blocks' LayerNorms (no sequence
    # parallelism at 17 tokens over 2 ranks), the final norm and the head.
    assert "head.head_fc.weight" in rank0["whole"] and "pos_embedding" in rank0["whole"]
    assert rank0["differ"] == [] == rank1["differ"]


def test_the_teacher_is_built_sharded_as_the_student(results):
    rank0, rank1 = _step(results, "teacher")
    for rank in (rank0, rank1):
        assert rank["same_logits"], rank
        # FSDP over 2 ranks: about half of it each (dim-0 chunks, rounded up).
        assert rank["held"] < 0.6 * rank["whole"]
        # Its shards plus at most one full tensor, never the whole teacher.
        assert rank["peak"] <= rank["held"] + rank["largest"] < rank["whole"]
        assert "GiB on this rank (its FSDP shards)" in rank["note"]
