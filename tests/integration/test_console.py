"""The console of train_net: human lines on a terminal, json_stats lines on a
pipe, and always json_stats lines in OUT_DIR/stdout.log."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading

from pycls_fast.observe.logging import load_json_stats
from tests.helpers import DIGITS_CFG, ROOT, run_tool

ARGS = [
    "--cfg", DIGITS_CFG, "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16",
    "VIT.NUM_LAYERS", "1", "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64",
    "OPTIM.MAX_EPOCH", "1", "LOG_PERIOD", "5",
]  # fmt: skip


def run_on_terminal(*args: str) -> tuple[int, str]:
    """Runs `python tools/train_net.py args` with stdout and stderr on a
    pseudo-terminal; returns (exit status, what the terminal showed)."""
    master, slave = pty.openpty()
    # A terminal of 120 x 40 characters (a fresh pty reports 0 x 0).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tools", "train_net.py"), *args],
        stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip
    os.close(slave)
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    code = proc.wait(timeout=600)
    reader.join(timeout=30)
    os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


def test_terminal_shows_human_lines(digits, tmp_path):
    out = str(tmp_path / "tty")
    code, shown = run_on_terminal(*ARGS, "DATA.PATH", digits, "OUT_DIR", out)
    assert code == 0, shown
    assert "json_stats" not in shown
    lines = shown.replace("\r", "\n").splitlines()
    # The first lines: where, on what, and how the batch is split.
    assert any(f"output folder {out}; device cpu" in line for line in lines)
    assert any("batch 64 images per step (TRAIN.BATCH_SIZE), 64 per data-parallel "
               "rank; 1 epoch(s)" in line for line in lines)  # fmt: skip
    records = load_json_stats(os.path.join(out, "stdout.log"))
    it = next(r for r in records if r["_type"] == "train_iter")
    optional = [
        f"MFU {100.0 * it['mfu']:.1f}%" if it.get("mfu") else "",
        f"|g| {it['grad_norm']:.3g}" if "grad_norm" in it else "",
        f"goodput {100.0 * it['goodput']:.0f}%" if "goodput" in it else "",
    ]
    human = "  ".join(
        [
            f"train epoch 1/1 iter {it['iter']}",
            "loss LOSS",
            f"top-1 {100.0 - it['top1_err']:.2f}%",
            f"{it['img_per_s']:,.0f} img/s",
            f"data wait {100.0 * it['data_wait_frac']:.0f}%",
            *[part for part in optional if part],
            f"ETA {it['eta']}",
        ]
    )
    assert "grad_norm" in it  # the record carries the step's gradient norm
    # The loss as the line prints the full value (see the test line below).
    before, after = human.split("LOSS")
    shown_losses = [
        float(line[line.index(before) + len(before) :].split()[0])
        for line in lines
        if before in line and line.endswith(after)
    ]
    assert len(shown_losses) == 1, human
    assert abs(shown_losses[0] - it["loss"]) <= 0.5e-4 + 1e-5
    test = next(r for r in records if r["_type"] == "test_epoch")
    pattern = r"test epoch 1/1  loss ([\d.]+)  top-1 ([\d.]+)%  top-5 ([\d.]+)%"
    found = [m.groups() for line in lines if (m := re.search(pattern, line))]
    assert len(found) == 1, shown
    # The line prints the full values to 4 / 2 decimals, the json_stats record keeps
    # 6 significant digits: they agree to half the line's last digit plus that.
    loss, top1, top5 = map(float, found[0])
    assert abs(loss - test["loss"]) <= 0.5e-4 + 1e-5
    assert abs(top1 - (100.0 - test["top1_err"])) <= 0.5e-2 + 1e-3
    assert abs(top5 - (100.0 - test["top5_err"])) <= 0.5e-2 + 1e-3
    assert [r["_type"] for r in records].count("train_epoch") == 1
    # The progress bar shows, and every log line starts on a line of its own (the
    # bar is lifted for it, not overwritten in its middle).
    assert any("it/s" in line or "s/it" in line for line in lines), shown
    for raw in shown.split("\r\n"):  # a terminal ends lines with \r\n
        if "] train epoch" in raw:
            assert raw.split("\r")[-1].lstrip(" ").startswith("["), repr(raw)


def test_pipe_keeps_json_stats_lines(digits, tmp_path):
    out = str(tmp_path / "pipe")
    result = run_tool("train_net.py", *ARGS, "DATA.PATH", digits, "OUT_DIR", out)
    assert result.returncode == 0, result.stderr
    shown = [r for r in result.stdout.splitlines() if "json_stats: " in r]
    kept = load_json_stats(os.path.join(out, "stdout.log"))
    assert len(shown) == len(kept) and kept
