"""docs/GETTING_STARTED.md, "7. Watching a long run": its commands, run as written (the
demo's data and OUT_DIR pointed at test folders, the model shrunk), give a W&B run
offline and the MFU and goodput figures the section says where to read."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow
pytest.importorskip("wandb")

SECTION = "## 7. Watching a long run"
SHRINK = [
    "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "VIT.NUM_LAYERS", "2",
    "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64", "TRAIN.BATCH_SIZE", "128",
]  # fmt: skip


def _commands():
    with open(os.path.join(ROOT, "docs/GETTING_STARTED.md")) as f:
        text = f.read()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\n(.*?)```", section, flags=re.S)
    lines = [
        b.replace("\\\n", " ") for b in blocks if ".venv/bin/python" in b or "grep" in b
    ]
    return [
        line.strip() for block in lines for line in block.splitlines() if line.strip()
    ]


def test_the_sections_commands_show_a_wandb_run_mfu_and_goodput(digits, tmp_path):
    commands = _commands()
    assert commands[0].startswith(".venv/bin/python tools/train_net.py")
    out = str(tmp_path / "digits_wandb")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    outputs = []
    for command in commands:
        command = command.replace("out/digits_wandb", out)
        if command.startswith(".venv/bin/python"):
            args = shlex.split(command)
            args[0] = sys.executable
            if "train_net.py" in command:
                args += ["DATA.PATH", digits, *SHRINK]
            done = subprocess.run(args, capture_output=True, text=True, env=env,
                                  cwd=ROOT, timeout=600)  # fmt: skip
        else:
            done = subprocess.run(command, shell=True, capture_output=True,
                                  text=True, env=env, cwd=ROOT, timeout=60)  # fmt: skip
        assert done.returncode == 0, (command, done.stderr[-3000:])
        outputs.append(done.stdout)
    goodput = json.loads("{" + outputs[1].strip().splitlines()[-1] + "")
    assert goodput["_type"] == "goodput" and 0 < goodput["goodput"] <= 1
    mfus = json.loads(outputs[2].strip().replace("'", '"'))
    assert len(mfus) == 2 and all(m > 0 for m in mfus)
    assert os.path.isfile(os.path.join(out, "wandb_id"))
    # Evaluating the run needs no W&B login: not here (no key, no netrc, online),
    # where wandb.init would refuse or prompt. W&B is skipped, and said so.
    bare = {k: v for k, v in env.items() if not k.startswith("WANDB_")}
    bare["HOME"] = str(tmp_path / "home")
    done = subprocess.run(
        [sys.executable, "tools/test_net.py", "--run", out, "WANDB.MODE", "online"],
        capture_output=True, text=True, env=bare, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOG_WANDB: W&B skipped for this evaluation" in done.stdout
    assert "top-1 accuracy:" in done.stdout
