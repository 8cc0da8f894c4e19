"""docs/GETTING_STARTED.md's "A run's life" as a user walks it, each command read from
the page and run: train, Ctrl-C, resume, change a key (refused, then accepted),
evaluate, load in Python, predict an image. The model is made small (the SMALL
overrides) and the paths point into a temporary folder; nothing else changes."""

import os
import re
import signal
import subprocess
import sys
import time

from tests.helpers import ROOT

SMALL = [
    "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "VIT.NUM_LAYERS", "1",
    "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64", "LOG_PERIOD", "5",
]  # fmt: skip


def _section():
    """The commands (shell lines) and Python blocks of the section, in order."""
    with open(os.path.join(ROOT, "docs", "GETTING_STARTED.md")) as f:
        text = f.read()
    body = text.split("## 2. A run's life", 1)[1].split("\n## ", 1)[0]
    steps = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", body, re.S):
        if lang == "python":
            steps.append(("python", block))
        else:
            steps += [("shell", x) for x in block.splitlines()
                      if x.startswith(".venv/bin/python tools/")]  # fmt: skip
    return steps


def _argv(line, tmp, digits):
    """A documented command as this test runs it: this interpreter, the walk's
    folder in `tmp`, the digits in `digits`, the small model."""
    words = line.replace("out/walk", str(tmp / "walk")).split()
    argv = [sys.executable, os.path.join(ROOT, words[1]), *words[2:]]
    if "train_net.py" in line:
        argv += ["DATA.PATH", digits, *SMALL]
    return argv


def _run(argv):
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_a_runs_life_as_documented(digits, tmp_path):
    steps = _section()
    kinds = [k for k, _ in steps]
    assert kinds == ["shell"] * 5 + ["python"], steps
    (_, train), (_, resume), (_, change), (_, accept), (_, evaluate) = steps[:5]
    assert train == resume  # "rerun the same command"
    walk = tmp_path / "walk"
    log = walk / "stdout.log"

    # Train, then Ctrl-C (SIGINT) once it has logged some iterations.
    proc = subprocess.Popen(_argv(train, tmp_path, digits), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (
            log.exists() and '"_type": "train_iter"' in log.read_text()
        ):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopped by SIGINT at epoch 1, iteration" in err
    assert "rerun the same command to resume" in err
    # Said once (the tool's last line), not also by the log on the console; the
    # log file keeps it.
    assert (out + err).count("stopped by SIGINT") == 1, out[-2000:]
    assert "stopped by SIGINT at epoch 1" in log.read_text()

    result = _run(_argv(resume, tmp_path, digits))
    assert result.returncode == 0, result.stderr
    assert re.search(r"resumed from .*model_epoch_0001_iter_\d+\.pyth", log.read_text())
    assert (walk / "checkpoints" / "model_epoch_0002.pyth").exists()

    config = (walk / "config.yaml").read_text()
    result = _run(_argv(change, tmp_path, digits))
    assert result.returncode == 2
    assert "OPTIM.MAX_EPOCH 2 -> 3 (the cos schedule is recomputed" in result.stderr
    assert "TRAIN.ACCEPT_CHANGES OPTIM.MAX_EPOCH" in result.stderr
    assert (walk / "config.yaml").read_text() == config

    result = _run(_argv(accept, tmp_path, digits))
    assert result.returncode == 0, result.stderr
    assert (walk / "checkpoints" / "model_epoch_0003.pyth").exists()
    assert (walk / "config_history" / "001.yaml").read_text() == config
    assert "accepted config change (TRAIN.ACCEPT_CHANGES): OPTIM.MAX_EPOCH 2 -> 3" in (
        log.read_text()
    )

    before = log.read_text()
    result = _run(_argv(evaluate, tmp_path, digits))
    assert result.returncode == 0, result.stderr
    assert "(359 images, epoch 3/3)" in result.stdout
    assert log.read_text() == before and (walk / "eval" / "stdout.log").exists()

    code = steps[5][1].replace("out/walk", str(walk)).replace("data/digits", digits)
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    top = eval(result.stdout.strip())  # the printed list of (index, name, prob)
    assert len(top) == 3 and all(name == f"digit_{i}" for i, name, _ in top)
    assert 0 < sum(p for _, _, p in top) <= 1 + 1e-6
