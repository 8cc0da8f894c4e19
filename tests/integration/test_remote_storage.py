"""Remote DATA.PATH and OUT_DIR against a real S3-compatible server (moto's server
mode on 127.0.0.1, started here): pack shards to it, train from them, checkpoint to
it, kill, resume from it in a fresh mirror, and end as the uninterrupted run does."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from pycls_fast.checkpoint import files, sharded
from pycls_fast.datasets.formats.synthetic import make_image_folder
from tests.helpers import ROOT, TINY, start_tool

pytestmark = pytest.mark.slow  # an S3 server, runs killed and resumed

pytest.importorskip("moto.server", reason="moto[server] is a test dependency")
s3fs = pytest.importorskip("s3fs", reason="s3fs is a test dependency")

BUCKET = "pycls-fast-test"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    """The server's request log: one line per request, in the order it answered."""
    return tmp_path_factory.mktemp("moto") / "server.log"


@pytest.fixture(scope="module")
def s3(server_log):
    """The server's environment (endpoint and credentials), with a fresh bucket."""
    port = _free_port()
    log = open(server_log, "w")  # noqa: SIM115 - the server writes it until the fixture ends
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        fs = s3fs.S3FileSystem(endpoint_url=env["AWS_ENDPOINT_URL"])
        fs.mkdir(BUCKET)
        yield {**os.environ, **env}
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.terminate()
        server.wait(timeout=10)
        log.close()


def _fs():
    return s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"])


def _tool(name, *args, env):
    return start_tool(name, *args, env=env, stderr=subprocess.STDOUT)


def _train_args(out_dir, mirror):
    return [
        "--cfg", os.path.join(ROOT, "configs/examples/vit_digits.yaml"), *TINY,
        "MODEL.NUM_CLASSES", "4", "DATA.PATH", f"s3://{BUCKET}/data",
        "DATA.FORMAT", "shards", "DATA.SHUFFLE_BUFFER", "16", "OUT_DIR", out_dir,
        "OUT_MIRROR", mirror, "OPTIM.MAX_EPOCH", "4", "TRAIN.BATCH_SIZE", "8",
        "TEST.BATCH_SIZE", "16", "TRAIN.CHECKPOINT_PERIOD", "1",
        "TRAIN.CHECKPOINT_KEEP", "2", "TRAIN.CHECKPOINT_KEEP_BEST", "False",
        "DATA_LOADER.NUM_WORKERS", "2",
        "TRAIN.MIXED_PRECISION", "False", "NUM_GPUS", "1", "LOG_PERIOD", "2",
    ]  # fmt: skip


def _json_stats(output):
    """The json_stats records of a run's printed output."""
    marker = "json_stats: "
    return [json.loads(line.split(marker, 1)[1])
            for line in output.splitlines() if marker in line]  # fmt: skip


def _final_weights(path):
    state = torch.load(path, map_location="cpu", weights_only=False)
    return state["model_state"]


def test_train_from_and_checkpoint_to_s3_kill_and_resume(s3, tmp_path):
    folder = make_image_folder(
        str(tmp_path / "folder"), num_classes=4, images_per_class=16, size=(48, 40)
    )
    pack = _tool("pack_dataset.py", "--data", folder, "--out", f"s3://{BUCKET}/data",
                 "--shard-mb", "0.01", env=s3)  # fmt: skip
    out, _ = pack.communicate(timeout=120)
    assert pack.returncode == 0, out
    fs = _fs()
    assert fs.exists(f"{BUCKET}/data/train/shards.json")
    assert len(fs.glob(f"{BUCKET}/data/train/train-*.tar")) > 3

    # The reference: the same run, uninterrupted, with a local OUT_DIR.
    ref = _tool("train_net.py", *_train_args(str(tmp_path / "ref"), ""), env=s3)
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out[-3000:]

    run = f"s3://{BUCKET}/run"
    first = _tool("train_net.py", *_train_args(run, str(tmp_path / "m1")), env=s3)
    ckpt = f"{BUCKET}/run/checkpoints/model_epoch_0001.pyth"
    deadline = time.monotonic() + 240
    while first.poll() is None and time.monotonic() < deadline:
        fs.invalidate_cache()
        if fs.exists(ckpt):
            break
        time.sleep(0.1)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    fs.invalidate_cache()
    assert fs.exists(ckpt)

    # A fresh mirror (another node, say): everything comes from the store.
    second = _tool("train_net.py", *_train_args(run, str(tmp_path / "m2")), env=s3)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out[-3000:]
    assert "fetched checkpoints: model_epoch_000" in out
    assert "resumed from" in out

    fs.invalidate_cache()
    names = sorted(os.path.basename(p) for p in fs.ls(f"{BUCKET}/run/checkpoints"))
    # TRAIN.CHECKPOINT_KEEP 2 applies on the store too.
    assert names == ["model_epoch_0003.pyth", "model_epoch_0004.pyth"]
    log = fs.cat_file(f"{BUCKET}/run/stdout.log").decode()
    assert log.count("output folder") == 2  # the killed run's lines were kept
    local = tmp_path / "final.pyth"
    fs.get_file(f"{BUCKET}/run/checkpoints/model_epoch_0004.pyth", str(local))
    got = _final_weights(local)
    want = _final_weights(tmp_path / "ref" / "checkpoints" / "model_epoch_0004.pyth")
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _stored_order(server_log, prefix):
    """The keys under `prefix` in the order the server completed their uploads (a
    PUT, or the POST that completes a multipart upload), from its request log."""
    with open(server_log) as f:
        log = f.read()
    pattern = rf'"(?:PUT|POST) /{BUCKET}/{re.escape(prefix)}/?([^ ?]+)(\?[^ ]*)? HTTP'
    order = []
    for m in re.finditer(pattern, log):
        query = m[2] or ""
        if "partNumber" in query or "uploads" in query:
            continue  # a part, or the start of a multipart upload
        order.append(m[1])
    return order


def _consolidated_weights(fs, key, tmp_path):
    """The model weights of the sharded checkpoint at s3://`key`, in one process."""
    local = tmp_path / os.path.basename(key)
    fs.get(key, str(local), recursive=True)
    sharded.consolidate(str(local), str(tmp_path / "one.pyth"))
    return files.load_checkpoint(str(tmp_path / "one.pyth"))["model_state"]


def test_sharded_checkpoints_of_two_fsdp_ranks_on_s3(s3, server_log, tmp_path):
    folder = make_image_folder(
        str(tmp_path / "folder"), num_classes=4, images_per_class=8, size=(48, 40)
    )
    data = f"s3://{BUCKET}/fsdp_data"
    pack = _tool("pack_dataset.py", "--data", folder, "--out", data,
                 "--shard-mb", "0.01", env=s3)  # fmt: skip
    out, _ = pack.communicate(timeout=120)
    assert pack.returncode == 0, out
    run = f"s3://{BUCKET}/fsdp_run"

    def train(mirror, epochs, out=run):
        args = _train_args(out, str(tmp_path / mirror) if out == run else "")
        args[args.index("OPTIM.MAX_EPOCH") + 1] = epochs
        args[args.index("NUM_GPUS") + 1] = "2"
        args[args.index("DATA.PATH") + 1] = data
        # The third epoch extends the 2-epoch run: an explicit choice (run record).
        more = ["TRAIN.ACCEPT_CHANGES", "OPTIM.MAX_EPOCH"] if epochs != "2" else []
        proc = _tool("train_net.py", *args, "FSDP.ENABLED", "True", *more, env=s3)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        return out

    train("m1", "2")
    fs = _fs()
    fs.invalidate_cache()
    parts = sorted(
        os.path.basename(p)
        for p in fs.find(f"{BUCKET}/fsdp_run/checkpoints/model_epoch_0002.dcp")
    )
    # Each rank uploaded its own part; .metadata (rank 0's) completes it, so the
    # server must have stored it after both parts.
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(parts)
    order = _stored_order(server_log, "fsdp_run/checkpoints/model_epoch_0002.dcp")
    assert sorted(order) == sorted(parts), order
    assert order[-1] == ".metadata", order
    out = train("m2", "3")  # a fresh mirror: the sharded checkpoint comes back
    assert "fetched checkpoints: model_epoch_0002.dcp" in out
    # The resumed run's state: epoch 3 only, from the stored epoch 2: its weights
    # are those of the same resumption from the first run's local mirror.
    epochs = [r["epoch"] for r in _json_stats(out) if r["_type"] == "train_epoch"]
    assert epochs == ["3/3"]
    shutil.copytree(tmp_path / "m1", tmp_path / "ref")
    train("", "3", out=str(tmp_path / "ref"))
    fs.invalidate_cache()
    assert fs.exists(f"{BUCKET}/fsdp_run/checkpoints/model_epoch_0003.dcp/.metadata")
    got = _consolidated_weights(
        fs, f"{BUCKET}/fsdp_run/checkpoints/model_epoch_0003.dcp", tmp_path / "got"
    )
    ref = tmp_path / "ref" / "checkpoints" / "model_epoch_0003.dcp"
    sharded.consolidate(str(ref), str(tmp_path / "ref.pyth"))
    want = files.load_checkpoint(str(tmp_path / "ref.pyth"))["model_state"]
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_pipeline_checkpoints_without_fsdp_arrive_whole_on_s3(s3, tmp_path):
    # PP 2 without FSDP writes sharded checkpoints too: every rank's part and the
    # .metadata must reach the store (only rank 0 uploaded, a file, before).
    folder = make_image_folder(
        str(tmp_path / "folder"), num_classes=4, images_per_class=8, size=(48, 40)
    )
    data = f"s3://{BUCKET}/pp_data"
    pack = _tool("pack_dataset.py", "--data", folder, "--out", data,
                 "--shard-mb", "0.01", env=s3)  # fmt: skip
    out, _ = pack.communicate(timeout=120)
    assert pack.returncode == 0, out
    args = _train_args(f"s3://{BUCKET}/pp_run", str(tmp_path / "mirror"))
    args[args.index("OPTIM.MAX_EPOCH") + 1] = "1"
    args[args.index("NUM_GPUS") + 1] = "2"
    args[args.index("DATA.PATH") + 1] = data
    proc = _tool("train_net.py", *args, "PARALLEL.PP", "2", env=s3)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    fs = _fs()
    fs.invalidate_cache()
    parts = {
        os.path.basename(p)
        for p in fs.find(f"{BUCKET}/pp_run/checkpoints/model_epoch_0001.dcp")
    }
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= parts, parts


def test_two_nodes_with_node_local_mirrors_checkpoint_to_s3(s3, tmp_path):
    # Two "nodes" on this machine: two torchrun launchers (1 rank each, static
    # rendezvous on 127.0.0.1), each with its own temporary folder, so each its own
    # mirror of the s3:// OUT_DIR. Every node's shards must reach the store, and a
    # second job on fresh mirrors resumes from them.
    folder = make_image_folder(
        str(tmp_path / "folder"), num_classes=4, images_per_class=8, size=(48, 40)
    )
    data = f"s3://{BUCKET}/nodes_data"
    pack = _tool("pack_dataset.py", "--data", folder, "--out", data,
                 "--shard-mb", "0.01", env=s3)  # fmt: skip
    out, _ = pack.communicate(timeout=120)
    assert pack.returncode == 0, out
    run = f"s3://{BUCKET}/nodes_run"

    def job(name, epochs):
        args = _train_args(run, "")  # OUT_MIRROR '': under each node's TMPDIR
        args[args.index("OPTIM.MAX_EPOCH") + 1] = epochs
        args[args.index("TRAIN.CHECKPOINT_KEEP") + 1] = "1"
        args[args.index("DATA.PATH") + 1] = data
        port = str(_free_port())
        procs = []
        for node in range(2):
            tmp = tmp_path / f"{name}_node{node}"
            tmp.mkdir()
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc_per_node", "1", "--node_rank", str(node),
                "--master_addr", "127.0.0.1", "--master_port", port,
                os.path.join(ROOT, "tools/train_net.py"), *args,
                "FSDP.ENABLED", "True",
            ]  # fmt: skip
            env = {**s3, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )  # fmt: skip
            )
        outs = [p.communicate(timeout=300)[0] for p in procs]
        for p, o in zip(procs, outs):
            assert p.returncode == 0, o[-3000:]
        return outs[0]

    def mirror_checkpoints(name, node):
        """The checkpoints in a node's mirror (under its TMPDIR)."""
        (mirror,) = (tmp_path / f"{name}_node{node}" / "pycls_fast_out").iterdir()
        return sorted(os.listdir(mirror / "checkpoints"))

    job("first", "2")
    fs = _fs()
    fs.invalidate_cache()
    parts = {
        os.path.basename(p)
        for p in fs.find(f"{BUCKET}/nodes_run/checkpoints/model_epoch_0002.dcp")
    }
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= parts, parts
    # TRAIN.CHECKPOINT_KEEP 1 on the store and in every node's mirror.
    assert not fs.exists(f"{BUCKET}/nodes_run/checkpoints/model_epoch_0001.dcp")
    for node in (0, 1):
        assert mirror_checkpoints("first", node) == ["model_epoch_0002.dcp"]
    out = job("second", "3")  # fresh mirrors: each node pulls the checkpoint
    assert "fetched checkpoints: model_epoch_0002.dcp" in out
    assert "resumed from" in out
    fs.invalidate_cache()
    assert fs.exists(f"{BUCKET}/nodes_run/checkpoints/model_epoch_0003.dcp/.metadata")
    assert fs.exists(
        f"{BUCKET}/nodes_run/checkpoints/model_epoch_0003.dcp/__1_0.distcp"
    )
    for node in (0, 1):
        assert mirror_checkpoints("second", node) == ["model_epoch_0003.dcp"]
