"""The checkpoint component: when to save (cadence), which checkpoints to keep
(retention, keep-best), and what each rank's state holds (RNG, device batches)."""

import json
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pycls_fast.checkpoint import CheckpointManager, files, retention
from pycls_fast.checkpoint.cadence import (
    epoch_checkpoint_due,
    iteration_checkpoint,
    stop_checkpoint,
)
from pycls_fast.checkpoint.state import rng_state, set_rng_state
from pycls_fast.config import load_cfg
from pycls_fast.datasets.to_device.transform import DeviceBatchTransform
from pycls_fast.engine.trainer import build_components, train_model
from pycls_fast.launch.processes import launch
from pycls_fast.observe.logging import load_json_stats
from tests.helpers import JSON_REL, digits_cfg, tiny_cfg


def test_epoch_cadence_saves_every_period_and_the_last_epoch():
    due = [e for e in range(10) if epoch_checkpoint_due(e, 10, 3)]
    assert due == [2, 5, 8, 9]  # epochs 3, 6, 9 and the last, 10 (1-based)
    assert all(epoch_checkpoint_due(e, 4, 1) for e in range(4))


def test_iteration_cadence():
    def at(epoch, done, iters=11, max_epoch=3, epoch_period=5, iter_period=4):
        return iteration_checkpoint(
            epoch, done, iters, max_epoch, epoch_period, iter_period
        )

    assert [d for d in range(1, 12) if at(0, d)] == [4, 8]
    assert at(1, 8) == (1, 8)
    assert at(0, 8, iter_period=0) is None  # no iteration period
    # The period lands on an epoch's last iteration: saved there (its end still to
    # do) when no epoch checkpoint follows, else left to the epoch checkpoint.
    assert at(0, 12, iters=12) == (0, 12)
    assert at(0, 12, iters=12, epoch_period=1) is None
    assert at(2, 12, iters=12) is None  # the last epoch always has its checkpoint
    assert at(0, 11, iters=11) is None  # 11 is not a multiple of 4


def test_stop_saves_where_training_is():
    assert stop_checkpoint(1, 5, 11) == (1, 5)
    # After the last iteration: the epoch's end (record, evaluation) still to do.
    assert stop_checkpoint(1, 11, 11) == (1, 11)


def _plant(out_dir, names):
    folder = files.checkpoint_dir(str(out_dir))
    os.makedirs(folder, exist_ok=True)
    for name in names:
        if name.endswith(".dcp"):
            os.makedirs(os.path.join(folder, name))
            open(os.path.join(folder, name, ".metadata"), "w").close()
        else:
            open(os.path.join(folder, name), "w").close()


def _names(out_dir):
    return [os.path.basename(p) for p in files.list_checkpoints(str(out_dir))]


def test_retention_keeps_the_last_k_the_newest_and_the_protected(tmp_path):
    names = [
        "model_epoch_0001.pyth",
        "model_epoch_0002_iter_000004.pyth",
        "model_epoch_0002.pyth",
        "model_epoch_0003.dcp",
        "model_epoch_0004.dcp",
    ]
    _plant(tmp_path, names)
    assert retention.apply_retention(str(tmp_path), 0) == []  # 0: keep all
    assert _names(tmp_path) == names
    retention.apply_retention(str(tmp_path), 2, {"model_epoch_0001.pyth"})
    assert _names(tmp_path) == [names[0], names[3], names[4]]
    retention.apply_retention(str(tmp_path), 1)
    assert _names(tmp_path) == [names[4]]  # sharded directories deleted whole
    assert os.listdir(files.checkpoint_dir(str(tmp_path))) == [names[4]]
    assert retention.to_delete([], 1) == []


def test_keep_only_follows_another_folders_retention(tmp_path):
    """A node's own copy of a sharded checkpoint lacks `.metadata`: keep_only deletes
    it all the same when rank 0's folder no longer keeps it; other files stay."""
    names = ["model_epoch_0001.pyth", "model_epoch_0002.dcp", "model_epoch_0003.dcp"]
    _plant(tmp_path, names)
    folder = files.checkpoint_dir(str(tmp_path))
    os.remove(os.path.join(folder, "model_epoch_0002.dcp", ".metadata"))
    open(os.path.join(folder, "best.json"), "w").close()
    deleted = retention.keep_only(str(tmp_path), {"model_epoch_0003.dcp"})
    assert [os.path.basename(p) for p in deleted] == names[:2]
    assert sorted(os.listdir(folder)) == ["best.json", "model_epoch_0003.dcp"]
    assert retention.keep_only(str(tmp_path / "none"), set()) == []


def _manager(out_dir, keep, keep_best=True):
    cfg = load_cfg(
        None,
        [
            "OUT_DIR", str(out_dir), "TRAIN.CHECKPOINT_KEEP", str(keep),
            "TRAIN.CHECKPOINT_KEEP_BEST", str(keep_best),
        ],
    )  # fmt: skip
    return CheckpointManager(SimpleNamespace(cfg=cfg))


def test_keep_best_points_at_the_lowest_test_error(tmp_path):
    manager = _manager(tmp_path, keep=1)
    for epoch, err in enumerate([50.0, 30.0, 40.0, 45.0]):
        _plant(tmp_path, [files.checkpoint_name(epoch + 1)])
        manager.after_eval(epoch, err)
    assert _names(tmp_path) == ["model_epoch_0002.pyth", "model_epoch_0004.pyth"]
    with open(retention.best_path(str(tmp_path))) as f:
        best = json.load(f)
    assert best == {"checkpoint": "model_epoch_0002.pyth", "epoch": 2, "top1_err": 30}
    # A resumed run reads the pointer: a better epoch takes over, the old best goes.
    manager = _manager(tmp_path, keep=1)
    _plant(tmp_path, ["model_epoch_0005.pyth"])
    manager.after_eval(4, 20.0)
    assert _names(tmp_path) == ["model_epoch_0005.pyth"]
    assert retention.read_best(str(tmp_path))["epoch"] == 5
    # An evaluation of weights that were not saved changes nothing.
    manager.after_eval(5, 1.0)
    assert retention.read_best(str(tmp_path))["epoch"] == 5


def test_without_keep_best_there_is_no_pointer(tmp_path):
    manager = _manager(tmp_path, keep=1, keep_best=False)
    _plant(tmp_path, ["model_epoch_0001.pyth"])
    manager.after_eval(0, 10.0)
    assert not os.path.exists(retention.best_path(str(tmp_path)))


def _cfg(digits, out_dir, *opts):
    return digits_cfg(
        digits, out_dir, "VIT.NUM_LAYERS", "1",
        "OPTIM.WARMUP_EPOCHS", "0", "OPTIM.BASE_LR", "0.005", "LOG_PERIOD", "5",
        *opts,
    )  # fmt: skip


def _best_of_log(out_dir):
    tests = [
        r for r in load_json_stats(str(out_dir / "stdout.log"))
        if r["_type"] == "test_epoch"
    ]  # fmt: skip
    return min(tests, key=lambda r: r["top1_err"])


@pytest.mark.parametrize("fsdp", [False, True])
def test_training_keeps_the_last_and_the_best(digits, tmp_path, fsdp):
    suffix = ".dcp" if fsdp else ".pyth"
    cfg = _cfg(
        digits, tmp_path, "OPTIM.MAX_EPOCH", "3", "TRAIN.CHECKPOINT_ITER_PERIOD", "5",
        "TRAIN.CHECKPOINT_PERIOD", "1", "TRAIN.CHECKPOINT_KEEP", "2",
        "TRAIN.CHECKPOINT_KEEP_BEST", "True",
        "FSDP.ENABLED", str(fsdp),
    )  # fmt: skip
    launch(train_model, cfg) if fsdp else train_model(cfg)
    best = retention.read_best(str(tmp_path))
    logged = _best_of_log(tmp_path)
    # The same figure; json_stats keeps 6 significant digits.
    assert best["top1_err"] == pytest.approx(logged["top1_err"], rel=JSON_REL, abs=0)
    assert best["checkpoint"] == f"model_epoch_{best['epoch']:04d}{suffix}"
    names = _names(tmp_path)
    assert names[-2:] == [
        f"model_epoch_0003_iter_000010{suffix}",
        f"model_epoch_0003{suffix}",
    ]
    assert set(names) == set(names[-2:]) | {best["checkpoint"]}
    assert ".tmp" not in "".join(os.listdir(files.checkpoint_dir(str(tmp_path))))


def test_rng_state_is_plain_values_and_own_device_only():
    state = rng_state(torch.device("cpu"))
    assert state["cuda"] is None  # off CUDA nothing is saved for a device
    assert isinstance(state["torch"], torch.Tensor)
    assert all(isinstance(k, int) for k in state["numpy"][1])
    draws = (torch.rand(2), np.random.rand(2), random.random())
    set_rng_state(state)
    again = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1])
    assert draws[2] == again[2]
    # A state saved on a CUDA device, or one without a CUDA field, loads on a CPU.
    state["cuda"] = torch.zeros(16, dtype=torch.uint8)
    set_rng_state(state, torch.device("cpu"))
    del state["cuda"]
    set_rng_state(state, torch.device("cpu"))
    set_rng_state(state, torch.device("cuda", 3))  # no such device: no traceback


def test_device_batch_transform_state_round_trips():
    cfg = load_cfg(None, ["TRAIN.MIXUP_ALPHA", "0.2", "TRAIN.PCA_STD", "0.1"])
    prep = DeviceBatchTransform(cfg, torch.device("cpu"))
    state = prep.state_dict()
    first = (prep.rng.random(), torch.rand(2, generator=prep.generator))
    other = DeviceBatchTransform(cfg, torch.device("cpu"), rank=1)
    other.load_state_dict(state)
    second = (other.rng.random(), torch.rand(2, generator=other.generator))
    assert first[0] == second[0] and torch.equal(first[1], second[1])


def test_a_save_keeps_the_best_unless_it_writes_over_it(tmp_path):
    cfg = tiny_cfg(
        "OUT_DIR", str(tmp_path), "TRAIN.CHECKPOINT_KEEP", "1",
        "TRAIN.CHECKPOINT_KEEP_BEST", "True",
    )  # fmt: skip
    manager = CheckpointManager(build_components(cfg, loaders=False))
    manager.save(1, 0)
    manager.after_eval(0, 30.0)
    assert retention.read_best(str(tmp_path))["checkpoint"] == "model_epoch_0001.pyth"
    # A later checkpoint: the best stays, and retention (keep 1) spares it.
    manager.save(1, 5)
    assert retention.read_best(str(tmp_path))["checkpoint"] == "model_epoch_0001.pyth"
    assert _names(tmp_path) == [
        "model_epoch_0001.pyth",
        "model_epoch_0002_iter_000005.pyth",
    ]
    # Its own name written again (other weights): no longer known to be the best.
    manager.save(1, 0)
    assert retention.read_best(str(tmp_path)) is None
    assert _names(tmp_path) == ["model_epoch_0002_iter_000005.pyth"]


def _restore_parts(cfg, rank):
    model = torch.nn.Linear(2, 2)
    scaler = SimpleNamespace(state_dict=dict, load_state_dict=lambda s: None)
    return SimpleNamespace(
        cfg=cfg, model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
        ema=None, master=None, scaler=scaler, device=torch.device("cpu"),
        train_prep=DeviceBatchTransform(cfg, "cpu", rank=rank),
    )  # fmt: skip


def test_a_file_at_another_world_size_gives_each_rank_its_own_streams(
    tmp_path, monkeypatch
):
    from pycls_fast.checkpoint import manager
    from pycls_fast.runtime import distributed

    cfg = load_cfg(None, ["TRAIN.MIXUP_ALPHA", "0.8", "TRAIN.RANDOM_ERASE", "0.25"])
    saved = _restore_parts(cfg, 0)
    saved.train_prep.rng.random()  # the run went on a little: not a fresh state
    path = str(tmp_path / "model_epoch_0003.pyth")
    torch.save(manager.training_state(saved, 3, 0), path)
    draw = saved.train_prep.rng.random()

    # The same world (one process): the stream goes on where it was saved.
    same = _restore_parts(cfg, 0)
    manager.restore(same, path)
    assert same.train_prep.rng.random() == draw
    # Two ranks: each starts afresh from RNG_SEED, as a new 2-rank run does, not
    # both from rank 0's saved stream.
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    draws = []
    for rank in (0, 1):
        monkeypatch.setattr(distributed, "rank", lambda r=rank: r)
        parts = _restore_parts(cfg, rank)
        manager.restore(parts, path)
        fresh = DeviceBatchTransform(cfg, "cpu", rank=rank).rng.random()
        draws.append(parts.train_prep.rng.random())
        assert draws[-1] == fresh
    assert draws[0] != draws[1] and draw not in draws


def test_accepted_optimizer_settings_apply_after_a_restore(tmp_path):
    from pycls_fast.checkpoint import manager

    opts = ["OPTIM.OPTIMIZER", "adamw", "OPTIM.WEIGHT_DECAY", "0.05"]
    saved = build_components(tiny_cfg(*opts), loaders=False)
    params = [p for g in saved.optimizer.param_groups for p in g["params"]]
    loss = sum((p.float() ** 2).sum() for p in params)
    loss.backward()
    saved.optimizer.step()  # moments to restore
    path = str(tmp_path / "model_epoch_0001.pyth")
    torch.save(manager.training_state(saved, 1, 0), path)

    # The run resumed with another weight decay and beta2 (TRAIN.ACCEPT_CHANGES):
    # the optimizer's moments come from the checkpoint, its settings from the config.
    changed = ["OPTIM.WEIGHT_DECAY", "0.3", "OPTIM.BETA2", "0.95"]
    parts = build_components(tiny_cfg(*opts, *changed), loaders=False)
    built = [dict(g, params=None) for g in parts.optimizer.param_groups]
    manager.restore(parts, path)
    assert [dict(g, params=None) for g in parts.optimizer.param_groups] == built
    assert {g["betas"] for g in parts.optimizer.param_groups} == {(0.9, 0.95)}
    assert 0.3 in {g["weight_decay"] for g in parts.optimizer.param_groups}
    for before, after in zip(
        saved.optimizer.state.values(), parts.optimizer.state.values(), strict=True
    ):
        assert torch.equal(before["exp_avg_sq"], after["exp_avg_sq"])
