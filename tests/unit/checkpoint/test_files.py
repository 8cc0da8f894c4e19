"""checkpoint/files.py's weights paths and checkpoint/sharded.py's consolidation:
what TEST.WEIGHTS / TRAIN.WEIGHTS naming a run folder resolve to, and what a sharded
checkpoint consolidated into one file holds."""

import fractions
import os
import time

import pytest
import torch

from pycls_fast.checkpoint import files, sharded
from pycls_fast.errors import CheckpointError
from pycls_fast.launch import processes as launch
from pycls_fast.models import build_model
from pycls_fast.runtime import distributed
from tests.helpers import tiny_cfg


def _touch(folder, *names):
    os.makedirs(folder, exist_ok=True)
    for name in names:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"x")


def test_a_run_folder_names_its_newest_complete_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    ckpts = files.checkpoint_dir(run)
    # 5 iterations into epoch 3 is newer than the end of epoch 2, older than the
    # end of epoch 3 (whose write did not complete: .tmp).
    names = [
        "model_epoch_0001.pyth",
        "model_epoch_0003_iter_000005.pyth",
        "model_epoch_0002.pyth",
        "model_epoch_0003.pyth.tmp",
        "notes.txt",
    ]
    _touch(ckpts, *names)
    newest = os.path.join(ckpts, "model_epoch_0003_iter_000005.pyth")
    assert files.resolve_weights(run) == (newest, f"newest in {ckpts}")
    # Its checkpoints/ folder names the same file; a file names itself.
    assert files.resolve_weights(ckpts) == (newest, f"newest in {ckpts}")
    given = os.path.join(ckpts, "model_epoch_0001.pyth")
    assert files.resolve_weights(given) == (given, "given")


def test_a_folder_without_a_checkpoint_says_what_it_holds(tmp_path):
    run = str(tmp_path / "run")
    _touch(files.checkpoint_dir(run), "model_epoch_0001.pyth.tmp")
    _touch(run, "stdout.log")
    with pytest.raises(CheckpointError, match="no complete checkpoint in .*run") as e:
        files.resolve_weights(run)
    assert "holds: checkpoints, stdout.log" in str(e.value)
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        files.resolve_weights(str(tmp_path / "missing"))


def test_a_consolidated_sharded_checkpoint_holds_its_weights_and_meta(tmp_path):
    cfg = tiny_cfg()
    torch.manual_seed(0)
    model, ema = build_model(cfg), build_model(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "model_epoch_0003.dcp")
    meta = {"epoch": 3, "iter": 0, "cfg": "MODEL:\n  TYPE: vit\n"}
    sharded.save(path, model, optimizer, ema, meta, {})
    out = str(tmp_path / "consolidated.pyth")
    returned = sharded.consolidate(path, out)
    assert returned["epoch"] == 3 and returned["cfg"] == meta["cfg"]
    state = files.load_checkpoint(out)
    assert (state["epoch"], state["iter"], state["cfg"]) == (3, 0, meta["cfg"])
    for key, value in model.state_dict().items():
        assert torch.equal(state["model_state"][key], value), key
    for key, value in ema.state_dict().items():
        assert torch.equal(state["ema_state"][key], value), key


def _metadata_reads(monkeypatch) -> list[str]:
    """The `.metadata` files DCP opens from now on (every read of the index)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    opened, real = [], FileSystem.create_stream

    def counting(self, path, mode):
        if str(path).endswith(".metadata"):
            opened.append(str(path))
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", counting)
    return opened


@pytest.mark.parametrize("use_ema", [False, True])
def test_loading_weights_from_a_sharded_checkpoint_reads_its_index_once(
    tmp_path, monkeypatch, use_ema
):
    """TEST.WEIGHTS / TRAIN.WEIGHTS from a sharded checkpoint: one full tensor at a
    time, but the `.metadata` index (hundreds of MB for ViT-22B on 512 ranks) read
    once per load, whatever the number of tensors, not once per tensor."""
    from pycls_fast.checkpoint.weights import load_model_weights

    reads = {}
    for layers in (1, 4):
        cfg = tiny_cfg("VIT.NUM_LAYERS", str(layers))
        torch.manual_seed(layers)
        model, ema = build_model(cfg), build_model(cfg)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        path = str(tmp_path / f"layers{layers}" / "model_epoch_0002.dcp")
        meta = {"epoch": 2, "iter": 0, "cfg": ""}
        sharded.save(path, model, optimizer, ema, meta, {})
        fresh = build_model(cfg)
        opened = _metadata_reads(monkeypatch)
        loaded = load_model_weights(fresh, path, use_ema=use_ema)
        reads[layers] = len(opened)
        monkeypatch.undo()
        want = (ema if use_ema else model).state_dict()
        assert len(want) > 10 * layers  # many tensors, each read on its own
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, want[key]), key
        assert (loaded.epoch, loaded.ema) == (2, use_ema)
    assert reads == {1: 1, 4: 1}


@pytest.mark.parametrize("mmap", [False, True])
def test_a_checkpoint_holding_code_is_refused_naming_what_it_holds(tmp_path, mmap):
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    good, bad, garbage = (str(tmp_path / n) for n in ("good", "bad", "garbage"))
    torch.save({"model_state": weights, "epoch": 3}, good)
    loaded = files.load_checkpoint(good, mmap=mmap)
    assert loaded["epoch"] == 3 and torch.equal(
        loaded["model_state"]["w"], weights["w"]
    )
    # A pickled object of any class but tensors and plain values would run code.
    torch.save({"model_state": weights, "ratio": fractions.Fraction(1, 3)}, bad)
    with pytest.raises(CheckpointError) as e:
        files.load_checkpoint(bad, mmap=mmap)
    assert str(e.value).startswith(
        f"cannot read checkpoint {bad}: it holds objects that loading would run code "
        "for (fractions.Fraction);"
    )
    # Not torch.save's output (a log, random bytes): said so, not "code".
    for text in (b"not a checkpoint", b"\x11\x93" + bytes(range(200))):
        with open(garbage, "wb") as f:
            f.write(text)
        with pytest.raises(CheckpointError) as e:
            files.load_checkpoint(garbage, mmap=mmap)
        assert str(e.value) == (
            f"cannot read checkpoint {garbage}: not a file that torch.save wrote (it "
            "starts neither as a zip archive nor as a pickle)"
        )
    # A pickle that torch's loader cannot read (not a tensor's): its reason, without
    # torch's advice to load unsafely.
    with open(garbage, "wb") as f:
        f.write(b"\x80\x02\xad\x00\x00")
    with pytest.raises(CheckpointError) as e:
        files.load_checkpoint(garbage, mmap=mmap)
    message = str(e.value)
    assert message.startswith(f"cannot read checkpoint {garbage}: ")
    assert message.endswith("(a damaged or partial file?)")
    assert "weights_only" not in message and "run code" not in message


def test_a_sharded_save_clears_the_leftover_of_a_crashed_write(tmp_path):
    cfg = tiny_cfg()
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    meta = {"epoch": 1, "iter": 0, "cfg": ""}
    clean, path = str(tmp_path / "clean.dcp"), str(tmp_path / "model_epoch_0001.dcp")
    sharded.save(clean, model, optimizer, None, meta, {})
    # A write that crashed left its .tmp folder with a shard of another world size.
    _touch(path + ".tmp", "__7_0.distcp")
    sharded.save(path, model, optimizer, None, meta, {})
    assert sorted(os.listdir(path)) == sorted(os.listdir(clean))
    assert not os.path.exists(path + ".tmp")


def test_removing_partial_writes_never_fails_over_one_it_cannot_remove(tmp_path):
    folder = files.checkpoint_dir(str(tmp_path))
    _touch(folder, "model_epoch_0001.pyth", "model_epoch_0002.pyth.tmp.123")
    _touch(os.path.join(folder, "model_epoch_0003.dcp.tmp"), "__0_0.distcp")
    _touch(os.path.join(folder, "model_epoch_0001.dcp.old"), ".metadata")
    # One rmtree refuses (a symbolic link), as one would that another node on a
    # shared folder removes at the same time: the rest still goes.
    os.makedirs(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(folder, "link.tmp"))
    removed = files.remove_partial(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == [
        "link.tmp", "model_epoch_0001.dcp.old", "model_epoch_0002.pyth.tmp.123",
        "model_epoch_0003.dcp.tmp",
    ]  # fmt: skip
    assert sorted(os.listdir(folder)) == ["link.tmp", "model_epoch_0001.pyth"]


def test_a_checkpoint_is_on_disk_before_its_name_is(tmp_path, monkeypatch):
    """save_atomically's durability order: the temporary file's data reach the disk
    (fsync) before the rename makes them the checkpoint, and the folder's entry is
    synced after it; a power loss then leaves the old checkpoint or the new one,
    never a named file of zeros. (A crash itself cannot be had in-process: the calls
    and their order are what is checked.)"""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = files.save_checkpoint(str(tmp_path), {"epoch": 1}, 1)
    folder = os.path.realpath(os.path.dirname(path))
    tmp = f"{os.path.realpath(path)}.tmp.{os.getpid()}"
    assert events == [
        ("fsync", tmp),
        ("replace", tmp, os.path.realpath(path)),
        ("fsync", folder),
    ]
    assert files.load_checkpoint(path)["epoch"] == 1


def test_a_leftover_another_node_removes_first_does_not_stop_the_save(
    tmp_path, monkeypatch
):
    """On a shared folder the first rank of every node clears a crashed write's
    leftover: another node may remove it between this node's look and its rmtree."""
    cfg = tiny_cfg()
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "model_epoch_0001.dcp")
    _touch(path + ".tmp", "__7_0.distcp")
    real_rmtree = sharded.shutil.rmtree

    def another_node_first(folder, *args, **kwargs):
        real_rmtree(folder)  # the other node's removal, just before this one's
        return real_rmtree(folder, *args, **kwargs)

    monkeypatch.setattr(sharded.shutil, "rmtree", another_node_first)
    sharded.save(path, model, optimizer, None, {"epoch": 1, "iter": 0, "cfg": ""}, {})
    assert ".metadata" in os.listdir(path) and not os.path.exists(path + ".tmp")


def _save_as_two_nodes(cfg):
    """Rank 1 as the first rank of a second node (LOCAL_RANK 0), writing into its
    own folder (node-local: OUT_DIR/node<rank>) or the shared OUT_DIR/shared."""
    os.environ["LOCAL_RANK"] = "0"
    rank = distributed.rank()
    if rank == 1:  # a slow look for the metadata: rank 0 must wait for it
        exists = os.path.exists

        def slow_exists(path):
            if path.endswith(".metadata"):
                time.sleep(1.0)
            return exists(path)

        os.path.exists = slow_exists
    node_local = cfg.OUT_DIR.endswith("local")
    folder = os.path.join(cfg.OUT_DIR, f"node{rank}" if node_local else "shared")
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = os.path.join(folder, "model_epoch_0001.dcp")
    meta = {"epoch": 1, "iter": 0, "cfg": ""}
    sharded.save(path, model, optimizer, None, meta, {"rank": rank})


@pytest.mark.parametrize("folders", ["local", "shared"])
def test_each_node_publishes_the_shards_its_folder_holds(tmp_path, folders):
    """Node-local folders (a remote OUT_DIR's mirrors): rank 0's folder gets the
    metadata, the other node's its own shards, and each node renames its own copy
    so that it can upload it. A shared folder: rank 0 alone renames, once the
    other node has looked for the metadata (or it would rename what is gone)."""
    out = tmp_path / folders
    launch.launch(_save_as_two_nodes, tiny_cfg("NUM_GPUS", "2", "OUT_DIR", str(out)))
    name = "model_epoch_0001.dcp"
    if folders == "local":
        assert os.listdir(out / "node0") == [name] == os.listdir(out / "node1")
        assert ".metadata" in os.listdir(out / "node0" / name)
        assert ".metadata" not in os.listdir(out / "node1" / name)
        assert "__1_0.distcp" in os.listdir(out / "node1" / name)
    else:
        assert os.listdir(out / "shared") == [name]
        held = set(os.listdir(out / "shared" / name))
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= held
