"""Multi-process training on CPU with gloo, 2 processes: DDP and FSDP against one
process, sharded checkpoints across world sizes, memory per rank, and failures."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from pycls_fast.config import load_cfg, with_overrides
from pycls_fast.errors import ConfigError, RankFailedError, UserError
from pycls_fast.launch import processes as launch
from pycls_fast.observe.logging import load_json_stats
from pycls_fast.runtime import distributed
from tests.helpers import (
    DIGITS_CFG,
    EXACT,
    JSON_REL,
    ROOT,
    TINY,
    digits_opts,
    one_image_pct,
    one_thread_env,
    order_tolerance,
    run_tool,
    start_tool,
)
from tests.integration.parallel_parity import run_layout

TRAIN_NET, TEST_NET = "train_net.py", "test_net.py"  # tools/, for run_tool


def _opts(digits, out_dir, *extra):
    """The shrunk demo config (16 px, 2 blocks): 11 train iterations an epoch."""
    return digits_opts(
        digits, out_dir,
        "OPTIM.MAX_EPOCH", "1", "OPTIM.WARMUP_EPOCHS", "0", "OPTIM.BASE_LR", "0.005",
        "LOG_PERIOD", "1", *extra,
    )  # fmt: skip


def _run(tool, digits, out_dir, *extra, launcher=(), timeout=300):
    # One thread per process: 2 ranks share the 2 cores without oversubscription.
    args = ["--cfg", DIGITS_CFG, *_opts(digits, out_dir, *extra)]
    return run_tool(
        tool, *args, timeout=timeout, env=one_thread_env(), launcher=launcher
    )


def _train(digits, out_dir, *extra, launcher=()):
    result = _run(TRAIN_NET, digits, out_dir, *extra, launcher=launcher)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_json_stats(os.path.join(out_dir, "stdout.log"))


def _losses(records):
    return [r["loss"] for r in records if r["_type"] == "train_iter"]


def _final_test(records):
    return [r for r in records if r["_type"] == "test_epoch"][-1]


FP32 = ["AMP.MODE", "fp32", "TRAIN.MIXED_PRECISION", "False"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]

# Exactness is tested in float64 in-process (test_ddp_and_fsdp_train_as_one_process_
# in_float64). The tools' runs print fp32 figures: a layout's gradients differ from
# one process's only in their sums' order (and, in bf16, in where products are
# rounded), so each step's update differs by at most a relative R, and to first order
# the loss curves differ by at most R times the distance the loss travels. fp32: R is
# the order bound of the weight gradients' sums over a batch's tokens (128 images x 16
# tokens); bf16: each side rounds a weight gradient once (u = eps / 2 each), R = eps.
FP32_R = order_tolerance(torch.float32, 128 * 16)
BF16_R = torch.finfo(torch.bfloat16).eps


def _tolerance(records, r):
    """The bound above for one run's `records` (its train_iter losses' travel), plus
    json_stats' 6 significant digits (5e-6 relative) on both figures compared."""
    losses = _losses(records)
    return r * (max(losses) - min(losses)) + 2 * JSON_REL * max(losses)


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision, r",
    [(FP32, FP32_R), (["AMP.MODE", "O1"], BF16_R)],
    ids=["fp32", "bf16-O1"],
)
def test_ddp_and_fsdp_losses_match_one_process(digits, tmp_path, precision, r):
    records = _train(digits, tmp_path / "one", *precision)
    one, tol = _losses(records), _tolerance(records, r)
    # DDP under torchrun, FSDP with pycls's NUM_GPUS spawning: both launchers.
    ddp = _losses(
        _train(
            digits,
            tmp_path / "ddp",
            *precision,
            launcher=[*TORCHRUN, "--nproc_per_node", "2"],
        )
    )
    fsdp = _losses(
        _train(
            digits,
            tmp_path / "fsdp",
            *precision,
            "NUM_GPUS",
            "2",
            "FSDP.ENABLED",
            "True",
        )
    )
    assert len(one) == len(ddp) == len(fsdp) == 11
    assert one[-1] < one[0]  # it learns
    for other in (ddp, fsdp):
        assert max(abs(a - b) for a, b in zip(one, other)) <= tol, (one, other)


@pytest.mark.slow
def test_fsdp_o2_matches_one_process_o2(digits, tmp_path):
    # FSDP O2: fp32 shards gathered as bf16, grads reduced in fp32; one process O2:
    # bf16 weights with fp32 master copies. The same updates, rounded alike; with
    # layer-wise learning-rate decay, whose groups hold the shards under FSDP and the
    # master copies in one process.
    decay = ["OPTIM.LAYER_DECAY", "0.75"]
    records = _train(digits, tmp_path / "one", "AMP.MODE", "O2", *decay)
    one = _losses(records)
    fsdp = _losses(
        _train(
            digits, tmp_path / "fsdp", "AMP.MODE", "O2", "NUM_GPUS", "2",
            "FSDP.ENABLED", "True", "FSDP.ACTIVATION_CHECKPOINT", "True", *decay,
        )
    )  # fmt: skip
    tol = _tolerance(records, BF16_R)
    assert max(abs(a - b) for a, b in zip(one, fsdp)) <= tol, (one, fsdp)


@pytest.mark.parametrize("layout", [[], ["FSDP.ENABLED", "True"]], ids=["ddp", "fsdp"])
def test_ddp_and_fsdp_train_as_one_process_in_float64(layout, tmp_path):
    """2 ranks, each its half of one batch, against one process on the whole batch:
    the same weights after 10 steps, in float64 to within EXACT."""
    base = [*TINY, "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8",
            "OPTIM.OPTIMIZER", "sgd", "OPTIM.MOMENTUM", "0.9", "OPTIM.BASE_LR", "0.05",
            "OPTIM.GRAD_CLIP", "1.0", *layout]  # fmt: skip
    one = run_layout(tmp_path, "one", base)
    two = run_layout(tmp_path, "two", [*base, "NUM_GPUS", "2"])
    assert one["losses"][-1] < one["losses"][0]
    assert two["state"].keys() == one["state"].keys()
    for key, value in one["state"].items():
        assert value.dtype == torch.float64
        torch.testing.assert_close(two["state"][key], value, **EXACT)


def _keep(src, dst, names):
    os.makedirs(os.path.join(dst, "checkpoints"))
    for name in names:
        shutil.copytree(
            os.path.join(src, "checkpoints", name),
            os.path.join(dst, "checkpoints", name),
        )


@pytest.mark.slow
def test_sharded_checkpoints_resume_at_any_world_size(digits, tmp_path):
    common = [
        "OPTIM.MAX_EPOCH", "2", "TRAIN.CHECKPOINT_ITER_PERIOD", "5",
        "FSDP.ENABLED", "True", *FP32,
        "OPTIM.EMA_ALPHA", "0.05", "OPTIM.EMA_UPDATE_PERIOD", "1",
    ]  # fmt: skip
    full_dir = tmp_path / "full"
    full = _train(digits, full_dir, *common, "NUM_GPUS", "2")
    names = sorted(os.listdir(full_dir / "checkpoints"))
    # Every 5 iterations (of 11), and after the last epoch (CHECKPOINT_PERIOD 10).
    assert names == [
        "model_epoch_0001_iter_000005.dcp",
        "model_epoch_0001_iter_000010.dcp",
        "model_epoch_0002.dcp",
        "model_epoch_0002_iter_000005.dcp",
        "model_epoch_0002_iter_000010.dcp",
    ]
    # Every rank wrote its shard: one data file per rank.
    files = os.listdir(full_dir / "checkpoints" / "model_epoch_0002.dcp")
    assert sorted(f for f in files if f.endswith(".distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    target = _final_test(full)
    tol = _tolerance(full, FP32_R)

    # 2 -> 1: resume 5 iterations into epoch 2 with one process.
    one_dir = tmp_path / "one"
    _keep(full_dir, one_dir, ["model_epoch_0002_iter_000005.dcp"])
    one = _train(digits, one_dir, *common, "NUM_GPUS", "1")
    with open(one_dir / "stdout.log") as f:
        assert "resumed from" in f.read()
    assert len(_losses(one)) == 6  # iterations 6..11 only
    # 1 -> 2: resume the checkpoint the one-process run wrote at iteration 10.
    two_dir = tmp_path / "two"
    _keep(one_dir, two_dir, ["model_epoch_0002_iter_000010.dcp"])
    two = _train(digits, two_dir, *common, "NUM_GPUS", "2")
    for resumed in (one, two):
        test = _final_test(resumed)
        assert abs(test["loss"] - target["loss"]) <= tol
        # At most one held-out image decided otherwise.
        assert abs(test["top1_err"] - target["top1_err"]) <= one_image_pct(digits)
    ema = [r for r in full if r["_type"] == "test_ema_epoch"][-1]
    ema_two = [r for r in two if r["_type"] == "test_ema_epoch"][-1]
    assert abs(ema["loss"] - ema_two["loss"]) <= tol

    # test_net reads the sharded checkpoint in one process; the consolidated single
    # file gives the same figures (in fp32, as the training evaluated: bf16 may
    # move an image across the decision of these weights).
    ckpt = str(full_dir / "checkpoints" / "model_epoch_0002.dcp")
    tested = _run(TEST_NET, digits, tmp_path / "t1", *FP32, "TEST.WEIGHTS", ckpt)
    assert tested.returncode == 0, tested.stderr[-2000:]
    single = str(tmp_path / "consolidated.pyth")
    tool = os.path.join(ROOT, "tools/consolidate_checkpoint.py")
    done = subprocess.run(
        [sys.executable, tool, ckpt, single], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    tested_file = _run(TEST_NET, digits, tmp_path / "t2", *FP32, "TEST.WEIGHTS", single)
    assert tested_file.returncode == 0, tested_file.stderr[-2000:]
    expected = f"top-1 accuracy: {100.0 - target['top1_err']:.2f}%"
    assert expected in tested.stdout and expected in tested_file.stdout

    # A sharded checkpoint of another model: refused in one line, exit 2 (the run
    # record names the changed key before any checkpoint is read); accepted
    # explicitly, the checkpoint itself does not fit: one line naming the tensor.
    other = _run(TRAIN_NET, digits, full_dir, *common, "VIT.HIDDEN_DIM", "48")
    assert other.returncode == 2, other.stderr[-2000:]
    assert "VIT.HIDDEN_DIM 32 -> 48" in other.stderr, other.stderr[-2000:]
    assert "Traceback" not in other.stderr
    forced = _run(TRAIN_NET, digits, full_dir, *common, "VIT.HIDDEN_DIM", "48",
                  "TRAIN.ACCEPT_CHANGES", "VIT.HIDDEN_DIM")  # fmt: skip
    assert forced.returncode == 2, forced.stderr[-2000:]
    assert "does not fit this model" in forced.stderr
    assert "Traceback" not in forced.stderr
    # A sharded checkpoint loads into a run without FSDP too: all epochs are done,
    # so it evaluates the final weights, as the FSDP run did.
    plain_dir = tmp_path / "plain"
    _keep(full_dir, plain_dir, ["model_epoch_0002.dcp"])
    plain = _train(digits, plain_dir, *[c if c != "True" else "False" for c in common])
    assert abs(_final_test(plain)["loss"] - target["loss"]) <= tol


def _state_bytes(cfg):
    """One training step; this rank's parameter, gradient and optimizer bytes."""
    from pycls_fast.engine import timing
    from pycls_fast.engine.trainer import build_components, train_step
    from pycls_fast.parallel.data_parallel import state_bytes

    parts = build_components(cfg, loaders=False)
    inputs, targets = timing.synthetic_batch(parts, 8, cfg.TRAIN.IM_SIZE)
    train_step(parts, inputs, targets)
    # Gradients are freed by zero_grad: count them after a backward.
    loss = parts.trained(inputs).float().logsumexp(1).mean()
    loss.backward()
    sizes = state_bytes(parts.trained, parts.optimizer)
    sizes["peak_rss_mb"] = psutil.Process().memory_info().rss / 2**20
    return distributed.all_gather_object(sizes)


def test_fsdp_shards_parameters_gradients_and_optimizer_state():
    opts = [*TINY, "VIT.NUM_LAYERS", "4", "VIT.HIDDEN_DIM", "64", "VIT.MLP_DIM", "256"]
    opts += ["OPTIM.OPTIMIZER", "adamw", "TRAIN.BATCH_SIZE", "16", "NUM_GPUS"]
    whole = launch.launch(_state_bytes, load_cfg(None, [*opts, "1"]))[0]
    ranks = launch.launch(
        _state_bytes, load_cfg(None, [*opts, "2", "FSDP.ENABLED", "True"])
    )
    assert len(ranks) == 2
    for part in ranks:
        for key in ("params", "grads", "optimizer", "total"):
            assert part[key] <= 0.55 * whole[key], (key, part, whole)
    # Together the shards hold the whole state (FSDP pads dim 0 to a multiple of 2).
    total = sum(r["total"] for r in ranks)
    assert whole["total"] <= total <= 1.02 * whole["total"]
    print(f"peak RSS per rank: {[round(r['peak_rss_mb']) for r in ranks]} MB")


def _overflow_on_rank_1(cfg):
    """fp16 O2 under FSDP: an inf in rank 1's gradient shard only."""
    from pycls_fast.engine.trainer import build_components

    parts = build_components(cfg, loaders=False)
    params = [p for p in parts.trained.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    if distributed.rank() == 1:
        # The first gradient shard that rank 1 holds (pos_embedding's dim 0 is 1, so
        # its shard on rank 1 is empty).
        shard = next(
            g for p in params if (g := distributed.local_tensor(p.grad)).numel()
        )
        shard.view(-1)[0] = float("inf")
    found = parts.scaler.unscale_(params)
    parts.scaler.update(found)
    return distributed.all_gather_object((bool(found.item()), parts.scaler.scale_value))


def test_fp16_loss_scaling_skips_the_step_on_every_rank():
    cfg = load_cfg(
        None,
        [*TINY, "NUM_GPUS", "2", "TRAIN.BATCH_SIZE", "16", "FSDP.ENABLED", "True"]
        + ["AMP.MODE", "O2", "AMP.DTYPE", "fp16"],
    )
    ranks = launch.launch(_overflow_on_rank_1, cfg)
    # Both ranks skip the step and halve the scale, though only rank 1 overflowed.
    assert ranks == [(True, 2.0**15), (True, 2.0**15)]


def _differ_on_rank_1(cfg):
    if distributed.rank() == 1:
        cfg = with_overrides(cfg, {"OPTIM.BASE_LR": cfg.OPTIM.BASE_LR * 2})
    distributed.check_same_config(cfg)


def test_mismatched_configs_across_ranks_are_refused():
    cfg = load_cfg(None, [*TINY, "NUM_GPUS", "2", "TRAIN.BATCH_SIZE", "16"])
    with pytest.raises(RankFailedError) as e:
        launch.launch(_differ_on_rank_1, cfg)
    assert e.value.exit_code == 2


def _the_same_mistake_on_every_rank(cfg):
    raise UserError("DATA.PATH folder not found: /nowhere")


def test_a_mistake_of_every_rank_is_said_once(capfd, caplog):
    """One line for the job, the first failing rank's (raised: tools print it), not
    one per rank on stderr, nor torch's warning that it stops the others."""
    cfg = load_cfg(None, [*TINY, "NUM_GPUS", "2", "TRAIN.BATCH_SIZE", "16"])
    with caplog.at_level("WARNING"), pytest.raises(RankFailedError) as e:
        launch.launch(_the_same_mistake_on_every_rank, cfg)
    assert re.fullmatch(
        r"rank [01]: DATA.PATH folder not found: /nowhere", str(e.value)
    )
    assert e.value.exit_code == 2
    err = capfd.readouterr().err
    assert "/nowhere" not in err and "Terminating process" not in caplog.text + err


def _crash_on_rank_1(cfg):
    if distributed.rank() == 1:
        raise RuntimeError("boom on rank 1")
    time.sleep(10)  # still running when rank 1 fails: the launcher stops it


def test_a_crashed_rank_is_said_with_its_traceback(capfd, caplog):
    """An unexpected error (a bug) keeps what a report needs: the traceback of the
    rank that failed first, on stderr above the job's line."""
    cfg = load_cfg(None, [*TINY, "NUM_GPUS", "2", "TRAIN.BATCH_SIZE", "16"])
    with caplog.at_level("WARNING"), pytest.raises(RankFailedError) as e:
        launch.launch(_crash_on_rank_1, cfg)
    assert str(e.value) == "rank 1: RuntimeError: boom on rank 1"
    assert e.value.exit_code == 1
    err = capfd.readouterr().err
    assert 'raise RuntimeError("boom on rank 1")' in err, err
    assert err.rstrip().endswith("RuntimeError: boom on rank 1"), err
    assert "Terminating process" not in caplog.text + err


def _rank_1_groups_last(cfg):
    import torch.distributed as dist

    if distributed.rank() == 1:
        time.sleep(2)  # rank 0 is done by now
    # new_group waits for no one outside the group: rank 0 returns at once, while
    # rank 1 still needs the store (held by rank 0's process) to set up its group.
    dist.new_group(ranks=[1])
    return distributed.rank()


def test_the_first_rank_to_finish_waits_for_the_others():
    cfg = load_cfg(None, [*TINY, "NUM_GPUS", "2", "TRAIN.BATCH_SIZE", "16"])
    # Rank 0 ending early took the store with it: rank 1 failed with a broken pipe
    # after the work was done, and the launcher reported a failed run.
    assert launch.launch(_rank_1_groups_last, cfg) == 0


def test_the_launchers_world_size_wins_over_num_gpus(caplog):
    cfg = load_cfg(None, [*TINY, "NUM_GPUS", "4", "TRAIN.BATCH_SIZE", "16"])
    with caplog.at_level("WARNING"):
        matched = launch._match_world_size(cfg, 2)
    assert matched.NUM_GPUS == 2 and cfg.NUM_GPUS == 4  # a new config, checked
    assert "NUM_GPUS 4 of the config is replaced by the launcher's world size, 2" in (
        caplog.text
    )
    # The checks that depend on the ranks run at the launcher's size.
    cfg = load_cfg(None, [*TINY, "TRAIN.BATCH_SIZE", "15", "TEST.BATCH_SIZE", "16"])
    with pytest.raises(
        ConfigError, match="TRAIN.BATCH_SIZE \\(15\\) must be divisible"
    ):
        launch._match_world_size(cfg, 2)


@pytest.mark.slow
def test_torchrun_trains_a_config_that_says_num_gpus_8(digits, tmp_path):
    # docs/DISTRIBUTED.md's multi-node command (ViT-H-14.yaml says NUM_GPUS 8) at a
    # reduced size: torchrun's 2 processes win over NUM_GPUS, with one log line.
    args = [
        "--cfg", os.path.join(ROOT, "configs/vit/ViT-H-14.yaml"),
        "FSDP.ENABLED", "True", "OUT_DIR", str(tmp_path),
        "DATA.PATH", digits, "MODEL.NUM_CLASSES", "10",
        "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "VIT.PATCH_SIZE", "4",
        "VIT.NUM_LAYERS", "2", "VIT.HIDDEN_DIM", "32", "VIT.NUM_HEADS", "2",
        "VIT.MLP_DIM", "64", "TRAIN.BATCH_SIZE", "128", "TEST.BATCH_SIZE", "200",
        "OPTIM.MAX_EPOCH", "1", "OPTIM.WARMUP_EPOCHS", "0",
        "DATA_LOADER.NUM_WORKERS", "1", "LOG_PERIOD", "1",
    ]  # fmt: skip
    result = run_tool(TRAIN_NET, *args, timeout=300, env=one_thread_env(),
                      launcher=[*TORCHRUN, "--nproc_per_node", "2"])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    line = "NUM_GPUS 8 of the config is replaced by the launcher's world size, 2"
    assert result.stderr.count(line) == 1, result.stderr[-3000:]
    records = load_json_stats(os.path.join(tmp_path, "stdout.log"))
    assert len(_losses(records)) == 11  # 1,437 images / global batch 128
    assert _final_test(records)["top1_err"] < 100.0


def _ranks(parent):
    """The spawned rank processes of `parent`, in rank order (started in order)."""
    kids = [
        p
        for p in parent.children()
        if any("spawn_main" in part for part in p.cmdline())
    ]
    return sorted(kids, key=lambda p: p.create_time())


@pytest.mark.slow
def test_a_killed_rank_stops_the_job_naming_it(digits, tmp_path):
    opts = _opts(digits, tmp_path, "NUM_GPUS", "2", "OPTIM.MAX_EPOCH", "50")
    proc = start_tool("train_net.py", "--cfg", DIGITS_CFG, *opts, env=one_thread_env())
    try:
        log = tmp_path / "stdout.log"
        deadline = time.time() + 120
        while time.time() < deadline and not (
            log.exists() and "train_iter" in log.read_text()
        ):
            time.sleep(0.5)
        ranks = _ranks(psutil.Process(proc.pid))
        assert len(ranks) == 2
        ranks[1].send_signal(signal.SIGKILL)
        start = time.time()
        _, err = proc.communicate(timeout=120)
        assert time.time() - start < 60  # no hang on the survivor's collectives
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "rank 1 was killed by SIGKILL (most likely out of memory" in err
