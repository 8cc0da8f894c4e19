"""Sweeps: samplers (pycls's semantics), constraints, setup's forks, and a whole
sweep on the digits fixture: setup -> launch (2 at a time) -> collect -> analyze."""

import json
import os
import sys

import numpy as np
import pytest
import yaml

from pycls_fast.config import load_cfg
from pycls_fast.errors import ConfigError, UserError
from pycls_fast.models import complexity
from pycls_fast.observe.logging import load_json_stats
from pycls_fast.sweep import constraints, rand, samplers
from pycls_fast.sweep.collect import collect_sweep
from pycls_fast.sweep.config import load_sweep_cfg, sweep_dir
from pycls_fast.sweep.launcher import Job, LocalBackend, launch_sweep
from pycls_fast.sweep.report import analyze_sweep
from pycls_fast.sweep.setup import load_forks, sample_forks, setup_sweep
from tests.helpers import (
    DIGITS_CFG,
    ROOT,
    TINY,
    assert_help_lists,
    one_thread_env,
    run_tool,
    sampling_band,
)

TRAIN_NET = os.path.join(ROOT, "tools/train_net.py")


def _sampler(**fields):
    return samplers.load_sampler("KEY", fields)


def _draws(sampler, n=2000, seed=0):
    rng = np.random.default_rng(seed)
    return [samplers.sample(sampler, rng) for _ in range(n)]


# ------------------------------------ samplers ------------------------------------ #
def test_uniform_int_is_quantized_and_reaches_both_ends():
    s = _sampler(TYPE="int_sampler", RAND_TYPE="uniform", RANGE=[4, 20], QUANTIZE=4)
    values = _draws(s)
    assert set(values) == {4, 8, 12, 16, 20}
    assert all(type(v) is int for v in values)
    # Each of the 5 steps about equally often: a frequency of 1/5 each.
    band = sampling_band(len(values), (0.2 * 0.8) ** 0.5)
    assert all(abs(values.count(v) / len(values) - 0.2) < band for v in set(values))


def test_log_uniform_spreads_evenly_over_decades():
    s = _sampler(TYPE="float_sampler", RAND_TYPE="log_uniform",
                 RANGE=[1.0e-4, 1.0e-2], QUANTIZE=1.0e-6)  # fmt: skip
    values = np.array(_draws(s, 4000))
    assert values.min() >= 1e-4 and values.max() <= 1e-2
    low_decade = np.mean(values < 1e-3)
    # Half the draws in each decade (a uniform sampler would give ~0.09).
    assert abs(low_decade - 0.5) < sampling_band(len(values), 0.5)
    assert np.allclose(np.round(values / 1e-6), values / 1e-6)


def test_power2_uniform_gives_each_power_alike():
    s = _sampler(TYPE="int_sampler", RAND_TYPE="power2_uniform", RANGE=[2, 32],
                 QUANTIZE=1)  # fmt: skip
    values = _draws(s, 2500)
    assert set(values) == {2, 4, 8, 16, 32}
    band = sampling_band(len(values), (0.2 * 0.8) ** 0.5)
    assert all(abs(values.count(v) / len(values) - 0.2) < band for v in set(values))


def test_normal_stays_in_range():
    s = _sampler(TYPE="float_sampler", RAND_TYPE="normal", RANGE=[0.0, 1.0],
                 QUANTIZE=0.01)  # fmt: skip
    values = np.array(_draws(s))
    assert values.min() >= 0.0 and values.max() <= 1.0
    # Centred: a variable on [0, 1] has a standard deviation of at most 1/2.
    assert abs(values.mean() - 0.5) < sampling_band(len(values), 0.5)


def test_value_and_list_samplers():
    values = _draws(_sampler(TYPE="value_sampler", VALUES=["a", "b", "c"]), 300)
    assert set(values) == {"a", "b", "c"}
    item = {"TYPE": "int_sampler", "RANGE": [1, 3], "QUANTIZE": 1}
    lists = _draws(_sampler(TYPE="list_sampler", LENGTH=4, ITEM_SAMPLER=item), 50)
    assert all(len(v) == 4 and set(v) <= {1, 2, 3} for v in lists)


def test_samples_are_reproducible_from_the_seed():
    s = _sampler(TYPE="float_sampler", RAND_TYPE="log_uniform", RANGE=[0.1, 10.0],
                 QUANTIZE=0.01)  # fmt: skip
    assert _draws(s, 50, seed=3) == _draws(s, 50, seed=3)
    assert _draws(s, 50, seed=3) != _draws(s, 50, seed=4)


def test_grid_enumerates_every_combination():
    grid = samplers.grid({
        "A": _sampler(TYPE="grid_sampler", VALUES=[1, 2, 3]),
        "B": samplers.load_sampler("B", ["x", "y"]),  # a bare list is a grid
        "C": _sampler(TYPE="value_sampler", VALUES=[0]),
    })  # fmt: skip
    assert len(grid) == 6
    assert {(g["A"], g["B"]) for g in grid} == {(a, b) for a in (1, 2, 3) for b in "xy"}


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"TYPE": "nope"}, "TYPE must be one of"),
        ({"TYPE": "int_sampler", "RANGE": [3, 10], "QUANTIZE": 2}, "multiples"),
        ({"TYPE": "float_sampler", "RAND_TYPE": "log_uniform", "RANGE": [0.0, 1.0]},
         "low > 0"),
        ({"TYPE": "int_sampler", "RAND_TYPE": "power2_uniform", "RANGE": [3, 9]},
         "powers of 2"),
        ({"TYPE": "value_sampler", "VALUES": []}, "non-empty"),
        ({"TYPE": "value_sampler", "VALUES": [1], "RANGE": [0, 1]}, "unknown field"),
    ],
)  # fmt: skip
def test_bad_samplers_name_the_key(fields, words):
    with pytest.raises(ConfigError, match=words) as e:
        samplers.load_sampler("OPTIM.BASE_LR", fields)
    assert "OPTIM.BASE_LR" in str(e.value)


def test_quantize_keeps_the_type_of_q():
    assert rand.quantize(7.9, 2) == 6 and type(rand.quantize(7.9, 2)) is int
    assert rand.quantize(0.123456, 0.001) == 0.123


# ---------------------------------- constraints ----------------------------------- #
def test_constraint_expressions():
    cfg = load_cfg(None, TINY)
    cx = complexity(cfg)
    assert constraints.evaluate("VIT.MLP_DIM == 2 * VIT.HIDDEN_DIM", cfg, cx)
    assert constraints.evaluate("params < 1e6 and flops > 0", cfg, cx)
    assert not constraints.evaluate("max(VIT.NUM_LAYERS, 1) > 2", cfg, cx)
    for bad in ["__import__('os')", "VIT.NOPE > 1", "[x for x in (1,)]"]:
        with pytest.raises(ConfigError):
            constraints.evaluate(bad, cfg, cx)


# ------------------------------------- setup -------------------------------------- #
def _write_sweep(tmp_path, digits="data/digits", **setup):
    """A sweep config over the digits demo (tiny: 16 px, 1 epoch) under tmp_path."""
    base_opts = {
        "DATA.PATH": digits, "TRAIN.IM_SIZE": 16, "TEST.IM_SIZE": 16,
        "VIT.NUM_LAYERS": 1, "VIT.HIDDEN_DIM": 32, "VIT.MLP_DIM": 64,
        "TRAIN.BATCH_SIZE": 128, "OPTIM.MAX_EPOCH": 1, "OPTIM.WARMUP_EPOCHS": 0,
        "TRAIN.CHECKPOINT_PERIOD": 1, "DATA_LOADER.NUM_WORKERS": 1,
        "LOG_DEST": "file", "LOG_PERIOD": 5,
    }  # fmt: skip
    sweep = {
        "NAME": "tiny",
        "ROOT_DIR": str(tmp_path / "sweeps"),
        "SETUP": {"BASE_CFG": DIGITS_CFG, "BASE_OPTS": base_opts, **setup},
        "LAUNCH": {"PARALLEL_JOBS": 2},
        "ANALYZE": {"PLOT_CURVES_BEST": 2},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return str(path)


LR_DEPTH = {
    "OPTIM.BASE_LR": {"TYPE": "grid_sampler", "VALUES": [0.001, 0.003]},
    "VIT.NUM_LAYERS": {"TYPE": "grid_sampler", "VALUES": [1, 2]},
}


def test_grid_setup_writes_forks_that_load(tmp_path):
    sweep = load_sweep_cfg(_write_sweep(tmp_path, SAMPLERS=LR_DEPTH))
    runs = setup_sweep(sweep)
    assert [r["name"] for r in runs] == ["000000", "000001", "000002", "000003"]
    combos = {(r["overrides"]["OPTIM.BASE_LR"], r["overrides"]["VIT.NUM_LAYERS"])
              for r in runs}  # fmt: skip
    assert combos == {(0.001, 1), (0.001, 2), (0.003, 1), (0.003, 2)}
    listing = load_forks(sweep)
    assert listing["runs"] == json.loads(json.dumps(runs))
    for r in runs:
        cfg = load_cfg(r["cfg_file"])
        assert r["overrides"]["OPTIM.BASE_LR"] == cfg.OPTIM.BASE_LR
        assert r["overrides"]["VIT.NUM_LAYERS"] == cfg.VIT.NUM_LAYERS
        assert os.path.join(sweep_dir(sweep), "logs", r["name"]) == cfg.OUT_DIR
        assert os.path.isabs(cfg.DATA.PATH)  # pinned: runs may start elsewhere
        assert complexity(cfg) == r["complexity"]
    assert os.path.isfile(os.path.join(sweep_dir(sweep), "sweep_cfg.yaml"))


def test_random_setup_is_reproducible_and_respects_constraints(tmp_path):
    width = {"TYPE": "int_sampler", "RAND_TYPE": "uniform", "RANGE": [16, 128],
             "QUANTIZE": 16}  # fmt: skip
    lr = {"TYPE": "float_sampler", "RAND_TYPE": "log_uniform",
          "RANGE": [1.0e-4, 1.0e-2], "QUANTIZE": 1.0e-6}  # fmt: skip
    setup = {
        "NUM_CONFIGS": 6,
        "RNG_SEED": 7,
        "SAMPLERS": {"VIT.HIDDEN_DIM": width, "OPTIM.BASE_LR": lr},
        "DERIVED": {"VIT.MLP_DIM": "2 * VIT.HIDDEN_DIM"},
        "CONSTRAINTS": {"CX": {"PARAMS": [0, 60000]},
                        "EXPRS": ["VIT.HIDDEN_DIM % 32 == 0"]},
    }  # fmt: skip
    sweep = load_sweep_cfg(_write_sweep(tmp_path, **setup))
    forks = sample_forks(sweep)
    again = sample_forks(sweep)
    assert [f["overrides"] for f in forks] == [f["overrides"] for f in again]
    assert len({json.dumps(f["overrides"]) for f in forks}) == 6
    for f in forks:
        dim = f["overrides"]["VIT.HIDDEN_DIM"]
        assert dim % 32 == 0 and f["overrides"]["VIT.MLP_DIM"] == 2 * dim
        assert f["complexity"]["params"] <= 60000
        assert 1e-4 <= f["overrides"]["OPTIM.BASE_LR"] <= 1e-2


def test_grid_and_random_samplers_mix(tmp_path):
    lr = {"TYPE": "float_sampler", "RAND_TYPE": "log_uniform",
          "RANGE": [1.0e-4, 1.0e-2], "QUANTIZE": 1.0e-6}  # fmt: skip
    samplers_ = {"VIT.NUM_LAYERS": [1, 2], "OPTIM.BASE_LR": lr}
    sweep = load_sweep_cfg(_write_sweep(tmp_path, SAMPLERS=samplers_, NUM_CONFIGS=6))
    forks = [f["overrides"] for f in sample_forks(sweep)]
    # The grid points take turns; the random key is drawn afresh for each.
    assert [f["VIT.NUM_LAYERS"] for f in forks] == [1, 2, 1, 2, 1, 2]
    assert len({f["OPTIM.BASE_LR"] for f in forks}) == 6


def test_run_status_from_files(tmp_path):
    from pycls_fast.runtime.run_lock import RunLock
    from pycls_fast.sweep.runs import run_status, write_json

    run = {"out_dir": str(tmp_path / "run")}
    assert run_status(run) == "missing"
    os.makedirs(run["out_dir"])
    assert run_status(run) == "incomplete"
    with RunLock(run["out_dir"]):
        assert run_status(run) == "running"
    write_json(os.path.join(run["out_dir"], "exit_status.json"), {"exit_code": 143})
    assert run_status(run) == "incomplete"  # stopped by SIGTERM: it resumes
    write_json(os.path.join(run["out_dir"], "exit_status.json"), {"exit_code": 1})
    assert run_status(run) == "failed"
    final = {"_type": "test_epoch", "epoch": "3/3", "top1_err": 5.0}
    assert run_status(run, [{"_type": "test_epoch", "epoch": "2/3"}]) == "failed"
    assert run_status(run, [final]) == "done"


def test_base_cfg_may_be_a_mapping_of_keys(tmp_path):
    """pycls's spelling: SETUP.BASE_CFG holds the config's keys themselves."""
    path = tmp_path / "sweep.yaml"
    base = {"MODEL": {"NUM_CLASSES": 10}, "VIT": {"HIDDEN_DIM": 48, "MLP_DIM": 96},
            "TRAIN": {"IM_SIZE": 32}, "TEST": {"IM_SIZE": 32}}  # fmt: skip
    path.write_text(yaml.safe_dump({
        "NAME": "m", "ROOT_DIR": str(tmp_path),
        "SETUP": {"BASE_CFG": base, "SAMPLERS": {"VIT.NUM_HEADS": [2, 4]}},
    }))  # fmt: skip
    forks = sample_forks(load_sweep_cfg(str(path)))
    assert [f["cfg"].VIT.NUM_HEADS for f in forks] == [2, 4]
    assert all(f["cfg"].VIT.HIDDEN_DIM == 48 for f in forks)


def test_the_example_sweep_sets_up(monkeypatch):
    monkeypatch.chdir(ROOT)  # its BASE_CFG and DATA.PATH are relative to the repo
    sweep = load_sweep_cfg("configs/sweeps/digits_lr_depth.yaml")
    forks = sample_forks(sweep)
    assert len(forks) == 6
    assert {f["cfg"].OPTIM.MAX_EPOCH for f in forks} == {8}
    assert all(f["complexity"]["flops"] <= 1e8 for f in forks)


@pytest.mark.parametrize("name", ["setup", "launch", "collect", "analyze"])
def test_tools_help(name):
    result = run_tool(f"sweep_{name}.py", "--help", env=_env(), timeout=120)
    assert_help_lists(f"tools/sweep_{name}.py", result)


def test_too_few_valid_samples_says_why(tmp_path):
    setup = {"SAMPLERS": LR_DEPTH, "NUM_CONFIGS": 4,
             "CONSTRAINTS": {"CX": {"FLOPS": [0, 1000]}}}  # fmt: skip
    sweep = load_sweep_cfg(_write_sweep(tmp_path, **setup))
    with pytest.raises(
        UserError, match=r"only 0 of SETUP.NUM_CONFIGS 4 .*flops > 1000"
    ):
        sample_forks(sweep)


def test_a_misspelled_sampler_key_is_named_at_once(tmp_path):
    typo = {"VIT.NUM_LAYER": {"TYPE": "grid_sampler", "VALUES": [1, 2]}}
    sweep = load_sweep_cfg(_write_sweep(tmp_path, SAMPLERS=typo))
    with pytest.raises(ConfigError) as e:
        sample_forks(sweep)
    assert str(e.value).startswith(
        "SETUP.SAMPLERS / SETUP.DERIVED: unknown config key VIT.NUM_LAYER"
    )
    assert "NUM_LAYERS" in str(e.value)
    # A sweep config with a section twice: refused at the second one.
    path = tmp_path / "twice.yaml"
    path.write_text("NAME: a\nSETUP: {NUM_CONFIGS: 2}\nSETUP: {NUM_CONFIGS: 3}\n")
    with pytest.raises(ConfigError, match="at line 3, column 1: SETUP given twice"):
        load_sweep_cfg(str(path))


def test_setup_refuses_a_started_sweep(tmp_path):
    sweep = load_sweep_cfg(_write_sweep(tmp_path, SAMPLERS=LR_DEPTH))
    setup_sweep(sweep)
    os.makedirs(os.path.join(sweep_dir(sweep), "logs", "000000"))
    with pytest.raises(UserError, match="has started"):
        setup_sweep(sweep)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"NAM": "x"}, "unknown sweep config key NAM .*did you mean 'NAME'"),
        ({"NAME": ""}, "NAME must be set"),
        ({"LAUNCH": {"MODE": "pbs"}}, "not implemented yet"),
        ({"SETUP": {"NUM_CONFIGS": "six"}}, "expected int"),
        (
            {"ANALYZE": {"METRICS": ["TRAIN.BATCH_SIZ"]}},
            "ANALYZE.METRICS: unknown config key TRAIN.BATCH_SIZ "
            r"\(did you mean 'TRAIN.BATCH_SIZE'\?\)$",
        ),
    ],
)
def test_bad_sweep_configs_name_the_key(tmp_path, change, words):
    path = _write_sweep(tmp_path, SAMPLERS=LR_DEPTH)
    raw = yaml.safe_load(_read(path))
    for k, v in change.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    with pytest.raises(ConfigError, match=words):
        load_sweep_cfg(path)


# ------------------------------ a whole sweep, for real ---------------------------- #
def _env():
    return one_thread_env(PYTHONPATH=ROOT)


def _tool(name, sweep_file, *args):
    return run_tool(name, "--sweep-cfg", sweep_file, *args, env=_env(), timeout=300)


def _read(path):
    with open(path) as f:
        return f.read()


def _log_lines(run):
    with open(os.path.join(run["out_dir"], "stdout.log")) as f:
        return f.readlines()


@pytest.mark.slow
def test_sweep_end_to_end(tmp_path, digits):
    sweep_file = _write_sweep(tmp_path, digits=digits, SAMPLERS=LR_DEPTH)
    sweep = load_sweep_cfg(sweep_file)
    runs = setup_sweep(sweep)
    # One fork fails: its data folder does not exist.
    broken = runs[3]
    good_cfg = _read(broken["cfg_file"])
    with open(broken["cfg_file"], "w") as f:
        f.write(good_cfg.replace(f"PATH: {digits}", f"PATH: {tmp_path}/nope"))

    lines = []
    backend = LocalBackend(
        lambda job: [sys.executable, TRAIN_NET, "--cfg", job.cfg_file], 2, _env()
    )
    counts = launch_sweep(runs, backend, out=lines.append)
    assert counts == {"done": 3, "failed": 1}
    assert lines[0].startswith("sweep: 4 runs; skipping 0 done; running 4, 2 at a")
    assert sum(line.startswith("start ") for line in lines) == 4
    ends = [line for line in lines if line.startswith("end ")]
    assert len(ends) == 4 and all("ETA" in line for line in ends)
    failed = [line for line in ends if line.startswith("end 000003: failed")]
    assert failed and "(exit status 2): error: DATA.PATH" in failed[0]

    # Collect: each run's stats are its log's, statuses and the failure's reason.
    data = collect_sweep(sweep)
    assert data["counts"] == {"done": 3, "failed": 1}
    for entry, run in zip(data["runs"], runs, strict=True):
        if entry["status"] == "failed":
            assert "nope" in entry["error"] and entry["exit_code"] == 2
            continue
        records = load_json_stats(os.path.join(run["out_dir"], "stdout.log"))
        for kind in ("train_epoch", "test_epoch"):
            assert entry["json_stats"][kind] == [r for r in records
                                                 if r["_type"] == kind]  # fmt: skip
        assert (
            entry["summary"]["top1_err"]
            == entry["json_stats"]["test_epoch"][-1]["top1_err"]
        )
        assert entry["cfg"]["OPTIM"]["BASE_LR"] == run["overrides"]["OPTIM.BASE_LR"]
        assert entry["complexity"] == run["complexity"]
    with open(os.path.join(sweep_dir(sweep), "sweep.json")) as f:
        assert json.load(f) == data

    # Analyze: the figures and a page whose table lists the 4 runs.
    page = analyze_sweep(sweep)
    folder = os.path.dirname(page)
    for png in ("error_vs_complexity", "error_vs_keys", "curves_best", "error_edf"):
        assert os.path.getsize(os.path.join(folder, f"{png}.png")) > 5000
    text = _read(page)
    assert text.count('<tr class="') == 4
    assert all(f">{r['name']}</a>" in text for r in runs)
    assert text.count("data:image/png;base64,") == 4

    # Launching again reruns nothing: no new log lines, the failed run left alone.
    before = {r["name"]: _log_lines(r) for r in runs[:3]}
    failed_log = _read(os.path.join(broken["out_dir"], "launch.log"))
    again = _tool("sweep_launch.py", sweep_file)
    assert again.returncode == 1, again.stderr
    assert "skipping 3 done, 1 failed (--retry-failed reruns them); running 0" in (
        again.stdout
    )
    assert {r["name"]: _log_lines(r) for r in runs[:3]} == before
    assert _read(os.path.join(broken["out_dir"], "launch.log")) == failed_log

    # With the data fixed, --retry-failed reruns only the failed run.
    with open(broken["cfg_file"], "w") as f:
        f.write(good_cfg)
    retry = _tool(
        "sweep_launch.py", sweep_file, "--retry-failed", "--max-parallel", "2"
    )
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert "running 1, 2 at a time" in retry.stdout
    assert "end 000003: done" in retry.stdout
    assert {r["name"]: _log_lines(r) for r in runs[:3]} == before
    collected = _tool("sweep_collect.py", sweep_file)
    assert collected.returncode == 0 and "4 done" in collected.stdout


def test_tools_report_a_missing_setup_in_one_line(tmp_path):
    sweep_file = _write_sweep(tmp_path, SAMPLERS=LR_DEPTH)
    for tool in ("sweep_launch.py", "sweep_collect.py"):
        result = _tool(tool, sweep_file)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            f"error: {sweep_dir(load_sweep_cfg(sweep_file))}/cfgs.json not found: "
            "set the sweep up first (tools/sweep_setup.py)"
        ]


def test_job_is_a_plain_record():
    job = Job("000001", "/a.yaml", "/out")
    assert (job.name, job.cfg_file, job.out_dir) == ("000001", "/a.yaml", "/out")


def test_slurm_runs_are_train_net_jobs_with_the_sweeps_resources(tmp_path):
    from pycls_fast.sweep.launcher import Job, job_overrides

    raw = yaml.safe_load(_read(_write_sweep(tmp_path, SAMPLERS=LR_DEPTH)))
    raw["LAUNCH"].update(MODE="slurm", NUM_GPUS=8, PARTITION="learnfair",
                         TIME_LIMIT=600, CPU_ONLY=False)  # fmt: skip
    path = tmp_path / "slurm.yaml"
    path.write_text(yaml.safe_dump(raw))
    launch = load_sweep_cfg(str(path)).LAUNCH
    job = Job("000003", "cfgs/000003.yaml", "logs/000003")
    opts = job_overrides(launch, job)
    pairs = dict(zip(opts[::2], opts[1::2]))
    assert pairs == {
        "LAUNCH.MODE": "slurm", "LAUNCH.WAIT": "True", "LAUNCH.NAME": "000003",
        "NUM_GPUS": "8", "LAUNCH.CPUS_PER_GPU": "10", "LAUNCH.MEM_PER_GPU": "60",
        "LAUNCH.TIME_LIMIT": "600", "LAUNCH.MAX_RETRY": "3",
        "LAUNCH.CPU_ONLY": "False", "LAUNCH.PARTITION": "learnfair",
    }  # fmt: skip
    # The fork's config takes them (they are train_net's LAUNCH keys).
    cfg = load_cfg(
        DIGITS_CFG, ["TRAIN.BATCH_SIZE", "64", "TEST.BATCH_SIZE", "64", *opts]
    )
    assert (cfg.LAUNCH.MODE, cfg.LAUNCH.NAME, cfg.NUM_GPUS) == ("slurm", "000003", 8)
    local = load_sweep_cfg(_write_sweep(tmp_path, SAMPLERS=LR_DEPTH)).LAUNCH
    assert job_overrides(local, job) == []
