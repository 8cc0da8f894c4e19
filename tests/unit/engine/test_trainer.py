"""The training loop end to end on the digits folder: learning, logs, checkpoints,
exact resume, test_net, and the errors a user can cause."""

import math
import os
import shutil
import signal

import pytest
import torch

from pycls_fast import checkpoint as ckpt
from pycls_fast.checkpoint import sharded
from pycls_fast.components.optimizer import lr_at, set_lr
from pycls_fast.datasets.to_device.prefetch import DevicePrefetcher
from pycls_fast.engine.trainer import (
    NonFiniteLossError,
    build_components,
    seed_everything,
    train_epoch,
    train_model,
    train_step,
)
from pycls_fast.errors import Stopped
from pycls_fast.launch.processes import launch
from pycls_fast.observe.logging import load_json_stats
from tests.helpers import ROOT, digits_cfg, tiny_cfg

TINY_CFG = os.path.join(ROOT, "configs/examples/vit_tiny_cpu.yaml")


def _cfg(digits, out_dir, *opts):
    """The shrunk demo config (16 px digits, 2 blocks of width 32), 3 epochs."""
    return digits_cfg(
        digits, out_dir,
        "OPTIM.MAX_EPOCH", "3", "OPTIM.WARMUP_EPOCHS", "1",
        "OPTIM.BASE_LR", "0.005", "TRAIN.CHECKPOINT_PERIOD", "1",
        "LOG_PERIOD", "5", "DATA_LOADER.NUM_WORKERS", "2",
        *opts,
    )  # fmt: skip


def test_trains_logs_and_checkpoints(digits, tmp_path):
    cfg = _cfg(
        digits, tmp_path, "OPTIM.EMA_ALPHA", "1e-4", "OPTIM.EMA_UPDATE_PERIOD", "2"
    )
    results = train_model(cfg)
    records = load_json_stats(tmp_path / "stdout.log")
    kinds = [r["_type"] for r in records]
    assert kinds.count("train_epoch") == 3 and kinds.count("test_epoch") == 3
    assert kinds.count("test_ema_epoch") == 3 and "train_iter" in kinds
    epochs = [r for r in records if r["_type"] == "train_epoch"]
    for key in ("epoch", "top1_err", "top5_err", "loss", "lr", "img_per_s",
                "data_wait_frac", "time_epoch_s", "mem_mb"):  # fmt: skip
        assert key in epochs[0], key
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    tests = [r for r in records if r["_type"] == "test_epoch"]
    assert tests[-1]["images"] == 359  # every val image once
    assert results["test"]["top1_err"] < 90.0  # better than chance after 3 epochs
    assert os.path.isfile(tmp_path / "config.yaml")
    names = [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path))]
    assert names == [
        "model_epoch_0001.pyth",
        "model_epoch_0002.pyth",
        "model_epoch_0003.pyth",
    ]
    state = torch.load(
        tmp_path / "checkpoints/model_epoch_0003.pyth", weights_only=False
    )
    assert {"model_state", "optimizer_state", "ema_state", "rng_state"} <= set(state)


def test_iteration_period_ending_an_epoch_checkpoints_it(digits, tmp_path):
    # 11 iterations an epoch; no epoch checkpoint is due after the first: the
    # iteration period still saves its last iteration (the epoch's end, its record
    # and evaluation, left to a resume from it).
    cfg = _cfg(
        digits, tmp_path, "OPTIM.MAX_EPOCH", "2", "TRAIN.CHECKPOINT_PERIOD", "5",
        "TRAIN.CHECKPOINT_ITER_PERIOD", "11",
    )  # fmt: skip
    train_model(cfg)
    names = [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path))]
    assert names == ["model_epoch_0001_iter_000011.pyth", "model_epoch_0002.pyth"]
    state = torch.load(tmp_path / "checkpoints" / names[0], weights_only=False)
    assert (state["epoch"], state["iter"]) == (0, 11)


# "deit": fp32 with DeiT III's data pieces (simple random crop, 3-Augment, colour
# jitter, random erasing, repeated augmentation), which must resume as exactly.
DEIT_DATA = ["DATA.TRAIN_CROP", "simple_random", "TRAIN.THREE_AUGMENT", "True",
             "TRAIN.COLOR_JITTER", "0.3", "TRAIN.RANDOM_ERASE", "0.25",
             "TRAIN.REPEATED_AUG", "3"]  # fmt: skip


# An EMA updated every 3 iterations; after the 1 warmup epoch (which copies the
# weights), alpha = 1e-3 * BATCH_SIZE / MAX_EPOCH * 3 of pycls's rule.
EMA = ["OPTIM.EMA_ALPHA", "1e-3", "OPTIM.EMA_UPDATE_PERIOD", "3"]


@pytest.mark.parametrize("mode", ["fp32", "O1", "deit"])
def test_resume_mid_epoch_ends_with_identical_weights(digits, tmp_path, mode):
    extra = DEIT_DATA if mode == "deit" else []
    mode = "fp32" if mode == "deit" else mode
    opts = ["AMP.MODE", mode, "TRAIN.MIXED_PRECISION", str(mode == "O1"),
            "TRAIN.CHECKPOINT_ITER_PERIOD", "4", "TRAIN.MIXUP_ALPHA",
            "0.2", "TRAIN.LABEL_SMOOTHING", "0.1", "VIT.DROP_PATH", "0.1",
            *EMA, *extra]  # fmt: skip
    full = tmp_path / "full"
    train_model(_cfg(digits, full, *opts))
    # A crash right after the checkpoint 4 iterations into epoch 2: later files gone.
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    paths = ckpt.list_checkpoints(str(crashed))  # oldest first
    names = [os.path.basename(p) for p in paths]
    keep = names.index("model_epoch_0002_iter_000004.pyth")
    assert names[keep - 1 : keep + 2] == [
        "model_epoch_0001.pyth",
        "model_epoch_0002_iter_000004.pyth",
        "model_epoch_0002_iter_000008.pyth",
    ]
    for path in paths[keep + 1 :]:
        os.remove(path)
    assert ckpt.last_checkpoint(str(crashed)).endswith(
        "model_epoch_0002_iter_000004.pyth"
    )
    train_model(_cfg(digits, crashed, *opts))
    a = torch.load(full / "checkpoints/model_epoch_0003.pyth", weights_only=False)
    b = torch.load(crashed / "checkpoints/model_epoch_0003.pyth", weights_only=False)
    for part in ("model_state", "ema_state"):
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), (part, key)
    assert "resumed from" in (crashed / "stdout.log").read_text()
    # The resumed epoch reports the whole epoch, as the uninterrupted run did (the
    # crashed log holds the full run's records first, the resumed ones last).
    full_epoch, resumed_epoch = (
        [r for r in load_json_stats(str(d / "stdout.log"))
         if r["_type"] == "train_epoch" and r["epoch"] == "2/3"][-1]
        for d in (full, crashed)
    )  # fmt: skip
    # Exact: the same per-step figures summed in the same order (the sums resume
    # from the checkpoint in float64).
    for key in ("loss", "top1_err", "top5_err"):
        assert resumed_epoch[key] == full_epoch[key], key


def test_non_finite_loss_stops_with_a_hint(digits, tmp_path):
    cfg = _cfg(digits, tmp_path, "OPTIM.BASE_LR", "1e30", "OPTIM.WARMUP_EPOCHS", "0")
    with pytest.raises(NonFiniteLossError, match="lower OPTIM.BASE_LR"):
        train_model(cfg)


def test_grad_clip_bounds_the_update(digits, tmp_path):
    from pycls_fast.engine.trainer import build_components, train_step

    cfg = _cfg(
        digits, tmp_path, "OPTIM.GRAD_CLIP", "1e-3", "OPTIM.OPTIMIZER", "sgd",
        "OPTIM.MOMENTUM", "0.0", "OPTIM.NESTEROV", "False", "OPTIM.BASE_LR", "1.0",
        "OPTIM.WEIGHT_DECAY", "0.0", "AMP.MODE", "fp32",
        "TRAIN.MIXED_PRECISION", "False",
    )  # fmt: skip
    parts = build_components(cfg, loaders=False)
    torch.nn.init.normal_(parts.trained.head.head_fc.weight)
    before = [p.detach().clone() for p in parts.trained.parameters()]
    images = torch.randn(8, 3, 16, 16)
    train_step(parts, images, torch.arange(8))
    moved = [
        (p.detach() - b).flatten() for p, b in zip(parts.trained.parameters(), before)
    ]
    # Plain SGD, lr 1: the step is the clipped gradient, of global norm 1e-3 - up to
    # torch's clip coefficient max_norm / (norm + 1e-6) (norm > max_norm: at most
    # 1e-6 / 1e-3 relative) and the step's subtraction, rounded at each weight's
    # magnitude (u |w| each: u ||w|| in the norm).
    weights = torch.cat([b.flatten() for b in before]).norm().item()
    atol = 1e-3 * (1e-6 / 1e-3) + torch.finfo(torch.float32).eps / 2 * weights
    assert torch.cat(moved).norm().item() == pytest.approx(1e-3, rel=0, abs=atol)


def test_bad_checkpoints_stop_the_run_and_keep_what_was_written(digits, tmp_path):
    train_model(_cfg(digits, tmp_path, "OPTIM.MAX_EPOCH", "1"))
    config_before = (tmp_path / "config.yaml").read_text()
    last = tmp_path / "checkpoints" / "model_epoch_0001.pyth"
    saved = last.read_bytes()
    # Another model in the same OUT_DIR: refused, nothing overwritten.
    with pytest.raises(ckpt.CheckpointError, match="does not fit this model"):
        train_model(
            _cfg(digits, tmp_path, "OPTIM.MAX_EPOCH", "2", "VIT.HIDDEN_DIM", "48")
        )
    assert last.read_bytes() == saved
    assert (tmp_path / "config.yaml").read_text() == config_before
    # A truncated file: one clear error naming it.
    last.write_bytes(saved[: len(saved) // 2])
    with pytest.raises(ckpt.CheckpointError, match="cannot read checkpoint .*0001"):
        train_model(_cfg(digits, tmp_path, "OPTIM.MAX_EPOCH", "2"))


class _WithEmptyBatch:
    """A train loader whose second batch lost all its images to decoding errors."""

    def __init__(self, loader):
        self.loader = loader

    def set_epoch(self, epoch, start_batch=0):
        self.loader.set_epoch(epoch, start_batch)

    def __len__(self):
        return 3

    def __iter__(self):
        batches = iter(self.loader)
        first, third = next(batches), next(batches)
        batches.close()
        empty = (first[0][:0], first[1][:0])
        return iter([first, empty, third])

    def stats(self):
        return self.loader.stats()


def test_a_batch_of_only_bad_images_is_skipped(digits, tmp_path):
    cfg = _cfg(digits, tmp_path, "AMP.MODE", "fp32", "TRAIN.MIXED_PRECISION", "False")
    seed_everything(0)
    with_empty = build_components(cfg, loaders=("train",))
    with_empty.train_loader = _WithEmptyBatch(with_empty.train_loader)
    with_empty.train_batches = DevicePrefetcher(
        with_empty.train_loader, with_empty.train_prep
    )
    record = train_epoch(with_empty, 0)
    assert math.isfinite(record["loss"]) and record["loss"] > 0
    # The same two real batches, at the learning rates of iterations 1 and 3, without
    # the empty one: the same weights exactly.
    seed_everything(0)
    plain = build_components(cfg, loaders=("train",))
    batches = iter(plain.train_loader)
    for it in (0, 2):
        images, labels = next(batches)
        set_lr(plain.optimizer, lr_at(cfg, it / 3))
        inputs, targets = plain.train_prep(images, labels)
        train_step(plain, inputs, targets)
    for a, b in zip(with_empty.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)


def test_a_stop_after_an_epochs_last_step_keeps_its_end(digits, tmp_path):
    # SIGTERM agreed right after epoch 1's last step: the resumed run does what
    # the stop cut off (epoch 1's record, its evaluation) and ends as one run.
    opts = ["OPTIM.MAX_EPOCH", "2", "TRAIN.CHECKPOINT_PERIOD", "2"]
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    train_model(_cfg(digits, full, *opts))
    after_iteration = ckpt.CheckpointManager.after_iteration

    def sigterm_at_epoch_end(self, epoch, done, iters, signum=0):
        signum = signal.SIGTERM if (epoch, done) == (0, iters) else signum
        return after_iteration(self, epoch, done, iters, signum)

    ckpt.CheckpointManager.after_iteration = sigterm_at_epoch_end
    try:
        with pytest.raises(Stopped):
            train_model(_cfg(digits, stopped, *opts))
    finally:
        ckpt.CheckpointManager.after_iteration = after_iteration
    (name,) = os.listdir(stopped / "checkpoints")
    assert name.startswith("model_epoch_0001_iter_")
    train_model(_cfg(digits, stopped, *opts))

    def epochs(run):
        keys = ("_type", "epoch", "loss", "top1_err", "top5_err", "lr")
        return [{k: r[k] for k in keys if k in r}
                for r in load_json_stats(str(run / "stdout.log"))
                if r["_type"] in ("train_epoch", "test_epoch")]  # fmt: skip

    assert epochs(stopped) == epochs(full)
    assert [r["epoch"] for r in epochs(full)] == ["1/2", "1/2", "2/2", "2/2"]
    a = torch.load(full / "checkpoints/model_epoch_0002.pyth", weights_only=False)
    b = torch.load(stopped / "checkpoints/model_epoch_0002.pyth", weights_only=False)
    for key in a["model_state"]:
        assert torch.equal(a["model_state"][key], b["model_state"][key]), key


def test_an_epoch_resumed_mid_way_counts_its_skipped_steps(
    digits, tmp_path, monkeypatch
):
    # fp16 with a scale that overflows every step of the epoch: each is skipped.
    # Resumed 4 iterations in, the epoch's record still counts all of them.
    from pycls_fast.components.precision import LossScaler
    from pycls_fast.engine import model_setup

    monkeypatch.setattr(
        model_setup, "loss_scaler", lambda dtype: LossScaler(True, init_scale=2.0**100)
    )
    opts = ["OPTIM.MAX_EPOCH", "1", "TRAIN.CHECKPOINT_ITER_PERIOD", "4",
            "AMP.MODE", "O1", "AMP.DTYPE", "fp16",
            "TRAIN.MIXED_PRECISION", "True"]  # fmt: skip
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    train_model(_cfg(digits, full, *opts))
    shutil.copytree(full, crashed)
    for path in ckpt.list_checkpoints(str(crashed)):
        if not path.endswith("model_epoch_0001_iter_000004.pyth"):
            os.remove(path)
    train_model(_cfg(digits, crashed, *opts))
    full_epoch, resumed_epoch = (
        [r for r in load_json_stats(str(d / "stdout.log"))
         if r["_type"] == "train_epoch"][-1]
        for d in (full, crashed)
    )  # fmt: skip
    iters = int(
        [r for r in load_json_stats(str(full / "stdout.log"))
         if r["_type"] == "train_iter"][0]["iter"].split("/")[1]
    )  # fmt: skip
    assert full_epoch["skipped_steps"] == iters
    assert resumed_epoch["skipped_steps"] == iters


def test_o2_ema_follows_the_fp32_master_weights(digits, tmp_path):
    # AMP O2 without FSDP (one process, as under DDP): the EMA is updated from the
    # optimizer's fp32 masters. In warmup the EMA copies them (alpha 1), so it must
    # equal them exactly, not their bf16 roundings.
    cfg = _cfg(
        digits, tmp_path, "AMP.MODE", "O2", "AMP.DTYPE", "bf16",
        "OPTIM.EMA_ALPHA", "1e-5", "OPTIM.EMA_UPDATE_PERIOD", "1",
        "OPTIM.WARMUP_EPOCHS", "2",
    )  # fmt: skip
    seed_everything(0)
    parts = build_components(cfg, loaders=("train",))
    train_epoch(parts, 0)
    weight = parts.model.head.head_fc.weight
    assert weight.dtype == torch.bfloat16
    master = parts.master.master_for(weight)
    assert not torch.equal(master, weight.float())  # the masters' low bits differ
    assert torch.equal(parts.ema.head.head_fc.weight, master)


def _short(digits, out_dir, *opts):
    """2 epochs of 5 iterations of 256 images, one block, an EMA every 2 iterations
    (after iterations 0, 2, 4 of an epoch, as pycls; alpha 1e-3 * 256 / 2 * 2 =
    0.256 after the warmup epoch), evaluated once."""
    return _cfg(
        digits, out_dir, "OPTIM.MAX_EPOCH", "2", "TRAIN.BATCH_SIZE", "256",
        "VIT.NUM_LAYERS", "1", "TRAIN.EVAL_PERIOD", "2", "TEST.BATCH_SIZE", "400",
        "OPTIM.EMA_ALPHA", "1e-3", "OPTIM.EMA_UPDATE_PERIOD", "2", *opts,
    )  # fmt: skip


def test_an_epoch_shorter_than_the_period_still_updates_the_ema(digits, tmp_path):
    # 5 iterations an epoch, an update period of 32: pycls updates after the first
    # iteration of every epoch (here, in warmup, a copy of the weights).
    cfg = _short(digits, tmp_path, "OPTIM.EMA_UPDATE_PERIOD", "32")
    seed_everything(0)
    parts = build_components(cfg, loaders=("train",))
    after_first = {}

    def keep(epoch, done, iters):
        if done == 1:
            after_first.update(
                {k: v.float().clone() for k, v in parts.model.state_dict().items()}
            )

    train_epoch(parts, 0, on_iter_end=keep)  # the warmup epoch: alpha 1
    for k, v in parts.ema.state_dict().items():
        assert torch.equal(v, after_first[k]), k


def test_ema_updates_every_period_with_pycls_alpha(digits, tmp_path):
    cfg = _short(digits, tmp_path)
    seed_everything(0)
    parts = build_components(cfg, loaders=("train",))
    ema = {k: v.clone() for k, v in parts.ema.state_dict().items()}
    updates = []

    def replay(epoch, done, iters):
        # What the EMA must hold: a step of 0.256 towards the weights after
        # (0-based) iterations 0, 2, 4 of the epoch, and nothing in between.
        if (done - 1) % 2 == 0:
            updates.append(done - 1)
            for k, v in parts.model.state_dict().items():
                ema[k] = torch.lerp(ema[k], v.float(), 0.256)

    train_epoch(parts, 1, on_iter_end=replay)  # epoch 2: after the warmup
    assert updates == [0, 2, 4]
    for k, v in parts.ema.state_dict().items():
        # One lerp per update both ways: the same float32 operations.
        torch.testing.assert_close(v, ema[k], rtol=0, atol=0)


@pytest.mark.parametrize(
    "opts",
    [
        # fp16 loss scaling with the loop optimizer (OPTIM.MTA's default False),
        # O2: the fp32 master weights are restored too.
        ["AMP.MODE", "O2", "AMP.DTYPE", "fp16", "TRAIN.MIXED_PRECISION", "True"],
        # FSDP in one process: sharded (DCP) checkpoints, the EMA sharded alike.
        ["AMP.MODE", "fp32", "TRAIN.MIXED_PRECISION", "False", "FSDP.ENABLED", "True"],
    ],
    ids=["fp16", "fsdp"],
)
def test_resume_with_ema_ends_identical(digits, tmp_path, opts):
    """Killed after the checkpoint 2 iterations into epoch 2, resumed: the same
    weights, EMA and loss scale as without the interruption, and the same epoch
    record (the meter's sums are restored). Drop path and mixup draw from the
    restored RNG streams."""
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    opts = ["TRAIN.CHECKPOINT_ITER_PERIOD", "2", "VIT.DROP_PATH", "0.1",
            "TRAIN.MIXUP_ALPHA", "0.2", *opts]  # fmt: skip
    launch(train_model, _short(digits, full, *opts))
    shutil.copytree(full, crashed)
    paths = ckpt.list_checkpoints(str(crashed))  # oldest first
    names = [os.path.basename(p) for p in paths]
    suffix = ".dcp" if "FSDP.ENABLED" in opts else ".pyth"
    keep = names.index(f"model_epoch_0002_iter_000002{suffix}")
    for path in paths[keep + 1 :]:
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    launch(train_model, _short(digits, crashed, *opts))
    assert "resumed from" in (crashed / "stdout.log").read_text()
    a, b = (_final_state(d, suffix) for d in (full, crashed))
    assert set(a) == set(b) and any(k.startswith("ema.") for k in a)
    for key, value in a.items():
        assert torch.equal(value, b[key]), key
    full_epoch, resumed_epoch = (
        [r for r in load_json_stats(str(d / "stdout.log"))
         if r["_type"] == "train_epoch"][-1]
        for d in (full, crashed)
    )  # fmt: skip
    assert resumed_epoch["loss"] == full_epoch["loss"]


def _final_state(out_dir, suffix):
    """The last checkpoint's weights and EMA ('model.*', 'ema.*') and, for a file
    (O2), its loss scaler and master weights ('scaler.*', 'master.*')."""
    path = out_dir / "checkpoints" / f"model_epoch_0002{suffix}"
    if suffix == ".dcp":
        return {
            f"{key}.{k}": v
            for key in ("model", "ema")
            for k, v in sharded.read_model_state(str(path), key).items()
        }
    state = torch.load(path, weights_only=True)
    scaler = {k: torch.tensor(v) for k, v in state["scaler_state"].items()}
    return {
        **{f"model.{k}": v for k, v in state["model_state"].items()},
        **{f"ema.{k}": v for k, v in state["ema_state"].items()},
        **{f"scaler.{k}": v for k, v in scaler.items()},
        **{f"master.{i}": v for i, v in enumerate(state["master_state"]["master"])},
    }


@pytest.mark.parametrize("accum", ["1", "2"])
def test_a_step_weighted_zero_leaves_the_weights(accum):
    """A rank without images joins the others' step with a blank batch weighted 0
    (_step_without_images): its gradients are zeros, so with plain SGD (no momentum,
    no weight decay) not one weight moves, while an unweighted step moves them."""
    cfg = tiny_cfg(
        "TRAIN.BATCH_SIZE", "4", "TRAIN.ACCUM_STEPS", accum, "OPTIM.OPTIMIZER", "sgd",
        "OPTIM.MOMENTUM", "0.0", "OPTIM.NESTEROV", "False", "OPTIM.WEIGHT_DECAY", "0.0",
        "OPTIM.BASE_LR", "0.1",
    )  # fmt: skip
    parts = build_components(cfg, loaders=False)
    before = {k: v.clone() for k, v in parts.model.state_dict().items()}
    images, labels = torch.randn(4, 3, 32, 32), torch.arange(4)
    loss, _, _ = train_step(parts, images, labels, weight=0.0)
    assert loss.item() > 0  # the loss is reported unweighted
    for k, v in parts.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    train_step(parts, images, labels)
    assert not torch.equal(
        parts.model.head.head_fc.weight, before["head.head_fc.weight"]
    )


@pytest.mark.parametrize("fsdp", [False, True])
def test_o1_under_fsdp_keeps_no_whole_model_of_casts(fsdp):
    """O1's forward under FSDP with activation checkpointing: autocast's weight cache
    is off, so the half-precision casts of the gathered weights go with their block
    instead of adding up to a copy of the whole model by the end of the forward.
    Without FSDP the cache stays on (the control: the casts are all there)."""
    import torch.distributed as dist

    from pycls_fast.engine.dry_run import LiveBytes
    from pycls_fast.launch.processes import init_single_process_group

    cfg = tiny_cfg(
        "AMP.MODE", "O1", "TRAIN.MIXED_PRECISION", "True", "VIT.NUM_LAYERS", "4",
        "FSDP.ENABLED", str(fsdp), "FSDP.ACTIVATION_CHECKPOINT", "True",
        "TRAIN.BATCH_SIZE", "1",
    )  # fmt: skip
    if fsdp:
        init_single_process_group(cfg)
    try:
        parts = build_components(cfg, loaders=())
        x = torch.randn(1, 3, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE)
        linears = [m.weight for m in parts.model.modules()
                   if isinstance(m, torch.nn.Linear)]  # fmt: skip
        half = torch.finfo(parts.half_dtype).bits // 8
        casts = sum(w.numel() for w in linears) * half
        biggest_block = max(
            sum(w.numel() for n, w in b.named_parameters() if n.endswith("weight"))
            for b in parts.model.encoder.children()
            if hasattr(b, "mlp_block") or hasattr(b, "self_attention")
        )
        tracker = LiveBytes()
        with tracker, parts.autocast():
            parts.trained(x)
            live = tracker.live
    finally:
        if fsdp:
            dist.destroy_process_group()
    if fsdp:
        # After the forward no block is in flight: less than one block's casts.
        assert live < biggest_block * half < casts
    else:
        assert live >= casts
