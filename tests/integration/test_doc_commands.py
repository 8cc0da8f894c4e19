"""Every shell command shown in README.md and docs/*.md is executed, as written or
at a stated reduced size: configs and docs cannot drift apart.

One convention for every doc: commands run from the repository root in the
environment `make` builds, so they paste into a fresh shell (`.venv/bin/python
tools/...`, `.venv/bin/torchrun ...`, `make ...`); bare `python` / `torchrun` /
`pip` only where a doc installs into an environment of the reader's own. The "run"
commands are run that way: through bash, from the repository root, in an
environment holding only PATH and HOME.

A command is a line of a fenced block without a language (or bash / sh) that starts
with a command word (`python`, `.venv/bin/python`, `torchrun`, `make`, ...; `$ ` is
a shell prompt, `\\` continues a line). Lines of output in the same blocks are not
commands. Each command must match one row of REDUCTIONS (its document and the
start of the command), which says how it is checked and why:

- "run": run as written (`python` is this interpreter; of a pipe, the command
  before it), exit status 0, or the status and error line the document shows
  after it;
- "config": a training or evaluation command of a cluster, real data or a GPU:
  its config file and overrides are loaded at their full size (every load-time
  check), with the launcher's world size (torchrun: --nnodes x --nproc_per_node,
  which replaces NUM_GPUS; SLURM: NUM_GPUS) and the launch keys
  checked (`check_launch`): what `train_net` checks before reading data;
- "tiny": run with tests/helpers.py's TINY model overrides appended (4 blocks),
  the ranks and layout as written;
- "skip": not a command of this project (installing, cloning) or one that another
  test runs (named), or one that needs the user's own files.

A new command in the docs fails this test until it has a row.
"""

import os
import pathlib
import re
import shlex
import subprocess

import pytest

from pycls_fast.config import check_launch, load_cfg
from pycls_fast.errors import UserError
from tests.helpers import TINY

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))]
COMMAND_WORDS = (
    "python",
    ".venv/bin/python",
    ".venv/bin/torchrun",
    ".venv/bin/pip",
    "torchrun",
    "make",
    "pip",
    "git",
    "srun",
    "SWEEP=",
    "MAIN_NODE=",
)

# (document, start of the command, how, why). Keep it sorted by document.
REDUCTIONS = [
    ("README.md", "make demo", "skip", "the Makefile's demo; its parts: test_tools"),
    ("README.md", "make test", "skip", "runs this suite"),
    ("README.md", ".venv/bin/python tools/info_net.py", "run", "fast (meta device)"),
    ("README.md", ".venv/bin/python tools/convert_weights.py", "skip",
     "needs the user's timm checkpoint file (no downloads); test_tools converts one"),
    ("README.md", "make bench-attention", "skip",
     "a benchmark of minutes; test_bench_attention_says_where_it_is runs it tiny"),
    ("DATA.md", ".venv/bin/python tools/prepare_imagenet.py", "skip",
     "needs the ImageNet archives; test_prepare_imagenet runs it on small ones"),
    ("DATA.md", ".venv/bin/python tools/train_net.py", "config",
     "ImageNet on a GPU node"),
    ("DATA.md", ".venv/bin/python tools/pack_dataset.py", "skip",
     "needs ImageNet; test_bench_data packs a small split"),
    ("DATA.md", ".venv/bin/pip install s3fs", "skip", "installs a package"),
    ("DISTRIBUTED.md", ".venv/bin/python tools/train_net.py", "config", "GPU nodes"),
    ("DISTRIBUTED.md", ".venv/bin/torchrun --standalone --nproc_per_node 8", "config",
     "8 GPUs"),
    ("DISTRIBUTED.md", ".venv/bin/torchrun --nnodes 4", "config", "4 nodes of 8 GPUs"),
    ("DISTRIBUTED.md", "MAIN_NODE=", "skip", "sets a variable inside an sbatch job"),
    ("DISTRIBUTED.md", "srun .venv/bin/torchrun", "config",
     "an sbatch job of 4 nodes"),
    ("DISTRIBUTED.md", ".venv/bin/python tools/plan_net.py", "run",
     "the planner, no GPU"),
    ("DISTRIBUTED.md",
     ".venv/bin/python tools/plan_net.py --cfg configs/vit/ViT-22B-14.yaml --dry-run",
     "tiny",
     "minutes at 22B: the same ranks and layout with a tiny ViT"),
    ("DISTRIBUTED.md", ".venv/bin/python tools/consolidate_checkpoint.py", "skip",
     "needs a training run's checkpoint; test_checkpoint_files consolidates one"),
    ("DISTRIBUTED.md",
     ".venv/bin/torchrun --standalone --nproc_per_node 2 tools/time_net.py",
     "skip", "a timing run of minutes; test_bench_ladder_dist runs its ladder"),
    ("GETTING_STARTED.md", "git clone", "skip", "clones this repository"),
    ("GETTING_STARTED.md", "make test", "skip", "runs this suite"),
    ("GETTING_STARTED.md", "pip install", "skip", "installs the package"),
    ("GETTING_STARTED.md", "make check-node", "skip",
     "times this machine for a minute; test_tools runs check_node"),
    ("GETTING_STARTED.md", ".venv/bin/python tools/info_net.py", "run", "fast"),
    ("GETTING_STARTED.md", ".venv/bin/python tools/train_net.py", "config",
     "ImageNet"),
    ("GETTING_STARTED.md",
     ".venv/bin/python tools/train_net.py --cfg configs/vit/ViT-S-16.yaml --opts",
     "run", "refused before any work, with the line shown"),
    ("GETTING_STARTED.md",
     ".venv/bin/python tools/train_net.py --cfg configs/my_experiments", "skip",
     "the reader's own config (the text writes it) and converted weights"),
    ("GETTING_STARTED.md", "make demo", "skip", "the Makefile's demo"),
    ("GETTING_STARTED.md", ".venv/bin/python tools/time_net.py", "config",
     "ImageNet on the user's machine"),
    ("GETTING_STARTED.md", ".venv/bin/python tools/test_net.py", "skip",
     "needs the demo's run (make demo); test_evaluate_run evaluates a run folder"),
    ("GETTING_STARTED.md", ".venv/bin/python tools/plot_log.py", "skip",
     "needs the demo's logs; test_plot_log plots a run"),
    ("GETTING_STARTED.md", ".venv/bin/python tools/avg_checkpoints.py", "skip",
     "needs the demo's run; test_avg_checkpoints averages a run's checkpoints"),
    ("GETTING_STARTED.md", ".venv/bin/python tools/export.py", "skip",
     "needs the demo's averaged weights; test_export exports tiny weights"),
    ("GETTING_STARTED.md", ".venv/bin/python tools/export.py --run out/vit_s", "run",
     "refused before any work, with the line shown"),
    ("GETTING_STARTED.md", ".venv/bin/python -c", "skip",
     "reads the W&B run of section 7; test_getting_started_wandb runs it"),
    ("PERFORMANCE.md", "make bench-gpu", "skip",
     "needs a GPU node; test_gpu_node runs benchmarks/gpu_node.sh with a tiny config"),
    ("PERFORMANCE.md", ".venv/bin/python tools/train_net.py", "config",
     "a profile on a GPU"),
    ("PERFORMANCE.md", ".venv/bin/python -m benchmarks.fp8", "skip",
     "needs a GPU with float8 matmuls; test_bench_fp8 runs it emulated, tiny"),
    ("PERFORMANCE.md", "make bench-contention", "skip",
     "minutes of timed rounds; test_bench_data runs the benchmark at a small size"),
    ("PERFORMANCE.md", "make gpu-wheels", "skip",
     "downloads wheels from the registry into build/wheels"),
    ("RECIPES.md", ".venv/bin/python tools/train_net.py", "config", "ImageNet on GPUs"),
    ("RECIPES.md", "make distill-demo", "skip", "minutes; test_distill_demo"),
    ("RECIPES.md", ".venv/bin/python tools/test_net.py --run", "skip",
     "evaluates a training run's folder on ImageNet; test_evaluate_multi"),
    ("SWEEPS.md", ".venv/bin/python tools/prepare_digits.py", "skip",
     "test_sweep's data"),
    ("SWEEPS.md", "SWEEP=", "skip", "sets a variable"),
    ("SWEEPS.md", ".venv/bin/python tools/sweep_", "skip", "test_sweep runs the sweep"),
]  # fmt: skip

# Commands in another environment than make's .venv: the reader's own (installing
# the package into it).
OWN_ENVIRONMENT = [("GETTING_STARTED.md", "pip install -e")]
ENVIRONMENT_WORDS = (".venv/bin/", "make ", "git ", "srun .venv/bin/", "SWEEP=",
                     "MAIN_NODE=")  # fmt: skip

# Commands that fail today because of a defect being fixed elsewhere (strict xfail:
# the fix makes them pass, and then their entry must go). Issue 27's defect 2 (the
# launcher's world size against NUM_GPUS) is fixed: none now.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def _commands():
    """(document, line number, command, the lines shown after it) of every shell
    command in the docs."""
    out = []
    for doc in DOCS:
        path = ROOT / doc if doc == "README.md" else ROOT / "docs" / doc
        text = path.read_text()
        for m in re.finditer(r"```([^\n]*)\n(.*?)```", text, re.S):
            if m.group(1).strip() not in ("", "bash", "sh", "shell"):
                continue
            first = text[: m.start()].count("\n") + 2
            lines = m.group(2).replace("\\\n", " ").split("\n")
            for i, line in enumerate(lines):
                cmd = line.strip().removeprefix("$ ")
                cmd = re.sub(r"\s+#.*$", "", cmd)
                if not cmd.startswith(COMMAND_WORDS):
                    continue
                shown = [ln.strip() for ln in lines[i + 1 : i + 2]]
                out.append((doc, first + i, " ".join(cmd.split()), shown))
    return out


def _row(doc, cmd):
    rows = [r for r in REDUCTIONS if r[0] == doc and cmd.startswith(r[1])]
    rows.sort(key=lambda r: -len(r[1]))  # the most specific start
    return rows[0] if rows else None


COMMANDS = _commands()


def test_every_command_has_a_reduction():
    missing = [f"{d}:{n}: {c}" for d, n, c, _ in COMMANDS if _row(d, c) is None]
    assert not missing, "add a REDUCTIONS row for:\n" + "\n".join(missing)
    used = {(_row(d, c)[0], _row(d, c)[1]) for d, _, c, _ in COMMANDS}
    stale = [r[:2] for r in REDUCTIONS if r[:2] not in used]
    assert not stale, f"REDUCTIONS rows that match no command: {stale}"


def test_commands_run_in_the_environment_make_builds():
    """No bare `python`, `torchrun` or `pip`: they fail in a fresh shell, where only
    .venv/bin/ holds the package."""
    bare = [
        f"{d}:{n}: {c}"
        for d, n, c, _ in COMMANDS
        if not c.startswith(ENVIRONMENT_WORDS)
        and not any(d == doc and c.startswith(s) for doc, s in OWN_ENVIRONMENT)
    ]
    assert not bare, "write .venv/bin/python (or torchrun, pip):\n" + "\n".join(bare)


def _fresh_shell():
    """(argv prefix, environment) of a user's fresh shell in the repository root:
    bash, PATH and HOME only. Where ROOT/.venv imports another checkout's package
    (a git worktree sharing one .venv), this checkout goes first on PYTHONPATH."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(ROOT)}
    venv = ROOT / ".venv" / "bin" / "python"
    where = subprocess.run(
        [str(venv), "-c", "import pycls_fast; print(pycls_fast.__file__)"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    ).stdout  # fmt: skip
    if not where.startswith(str(ROOT / "pycls_fast")):
        env["PYTHONPATH"] = str(ROOT)
    return env


def _params():
    out = []
    for doc, line, cmd, shown in COMMANDS:
        row = _row(doc, cmd)
        if row is None or row[2] == "skip":
            continue
        marks = []
        reason = KNOWN_FAILURES.get(row[:2])
        if reason:
            marks.append(pytest.mark.xfail(strict=True, reason=reason))
        out.append(
            pytest.param(doc, cmd, row[2], shown, id=f"{doc}:{line}", marks=marks)
        )
    return out


def _tool_argv(cmd):
    """(the tool's path, its arguments, the world size the launcher gives) of a
    command: `python tools/x.py ...`, `torchrun [opts] tools/x.py ...`, `srun ...`."""
    env = {"SLURM_NNODES": "4", "MAIN_NODE": "node0", "SLURM_JOB_ID": "1"}
    argv = shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), cmd))
    argv = argv[1:] if argv[0] == "srun" else argv
    world = None
    if argv[0].endswith("torchrun"):
        opts = {}
        i = 1
        while not argv[i].endswith(".py"):
            if argv[i] == "--standalone":
                i += 1
                continue
            opts[argv[i]] = argv[i + 1]
            i += 2
        world = int(opts.get("--nnodes", 1)) * int(opts["--nproc_per_node"])
        argv = argv[i:]
    else:
        argv = argv[1:]  # python
    return argv[0], argv[1:], world


def _check_config(cmd):
    tool, args, world = _tool_argv(cmd)
    assert tool.startswith("tools/") and os.path.exists(ROOT / tool), tool
    files, opts, i = [], [], 0
    while i < len(args):
        if args[i] == "--cfg":
            files.append(args[i + 1])
            i += 2
        elif args[i].startswith("--"):
            i += 1 if args[i] in ("--json", "--best", "--summary") else 2
        else:
            opts.append(args[i])
            i += 1
    assert files, f"no --cfg in {cmd}"
    # As the tools load it: at the launcher's world size (launch/cli.py).
    check_launch(load_cfg(files[0], opts, world))


@pytest.mark.parametrize("doc,cmd,how,shown", _params())
def test_documented_command(doc, cmd, how, shown, tmp_path):
    if how == "config":
        try:
            _check_config(cmd)
        except UserError as e:
            pytest.fail(f"{doc}: {cmd}\n  -> {e}")
        return
    line = cmd.split(" | ")[0]  # not the program piped into
    if how == "tiny":
        line += " " + shlex.join([*TINY, "VIT.NUM_LAYERS", "4"])
    out = subprocess.run(
        ["bash", "-c", line], cwd=ROOT, env=_fresh_shell(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    error = next((s for s in shown if s.startswith("error:")), None)
    if error:
        assert out.returncode == 2 and error in out.stderr, out.stderr[-1000:]
    else:
        assert out.returncode == 0, f"{cmd}\n{out.stderr[-2000:]}"
