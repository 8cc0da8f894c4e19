"""Command-line tools: their contracts (output, exit codes, one-line errors)."""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from pycls_fast.config import load_cfg
from pycls_fast.config_doc import undocumented
from pycls_fast.models.timm_compat import build_timm_vit
from pycls_fast.parallel.planner import HEADROOM
from tests.helpers import (
    ROOT,
    TINY,
    assert_help_lists,
    run_benchmark,
    run_tool,
    tiny_cfg,
    vit_param_count,
)

EXAMPLE = os.path.join(ROOT, "configs/examples/vit_tiny_cpu.yaml")


@pytest.mark.parametrize(
    "name",
    [
        "info_net.py",
        "convert_weights.py",
        "gen_config_doc.py",
        "avg_checkpoints.py",
        "export.py",
        "mutation.py",
    ],
)
def test_help_lists_the_documented_options(name):
    assert_help_lists(f"tools/{name}", run_tool(name, "--help"))


@pytest.mark.parametrize("name", ["attention", "loader", "optimizer"])
def test_bench_help_lists_the_documented_options(name):
    assert_help_lists(f"benchmarks/{name}.py", run_benchmark(name, "--help"))


def test_bench_attention_says_where_it_is():
    tiny = ["--batch", "1", "--reps", "1", "--iters", "1", "--json"]
    result = run_benchmark(
        "attention", "--shapes", "vit-s", "--dtypes", "fp32,bf16", *tiny
    )
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert progress[0] == "[1/2] vit-s fp32, timing the first"
    assert re.fullmatch(r"\[2/2\] vit-s bf16, ~\d+ s left", progress[1])
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(record["results"]) == {"vit-s/fp32", "vit-s/bf16"}
    assert "sdpa" in record["results"]["vit-s/fp32"]


def test_info_net_json():
    result = run_tool("info_net.py", "--cfg", "configs/pycls/ViT-P-18GF.yaml", "--json")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.strip().splitlines()  # only JSON: it pipes into jq
    record = json.loads(line)
    assert record["params"] == 86_567_656
    assert record["flops"] == 17_580_319_720
    assert record["acts"] == 23_895_544


def test_info_net_one_line_per_config():
    configs = ["configs/pycls/ViT-P-18GF.yaml", "configs/vit/ViT-B-16.yaml"]
    result = run_tool(
        "info_net.py", "--cfg", configs[0], "--cfg", configs[1], "--summary",
        "MODEL.NUM_CLASSES", "10",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["ViT-P-18GF", "ViT-B-16"]
    as_json = run_tool(
        "info_net.py", "--cfg", configs[0], "--cfg", configs[1], "--json",
        "MODEL.NUM_CLASSES", "10",
    )  # fmt: skip
    records = [json.loads(line) for line in as_json.stdout.strip().splitlines()]
    assert [r["config"] for r in records] == configs
    # The override reached both: ViT-B/16's head has 768 * 10 + 10 parameters.
    assert records[1]["params"] == 86_566_120 - 768 * 990 - 990


def test_info_net_prints_the_model_without_flags():
    result = run_tool("info_net.py", "--cfg", "configs/vit/ViT-Ti-16.yaml")
    assert result.returncode == 0, result.stderr
    assert "ViTEncoderBlock" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("ViT-Ti-16: params")
    # A 22B-parameter model's tree prints without allocating its weights (meta).
    result = run_tool("info_net.py", "--cfg", "configs/vit/ViT-22B-14.yaml")
    assert result.returncode == 0, result.stderr
    assert "ViT-22B-14: params 21,758,454,760" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cfg", "missing.yaml"], "error: config file not found: missing.yaml"),
        (["--cfg", EXAMPLE, "VIT.HIDEN_DIM", "8"], "did you mean 'VIT.HIDDEN_DIM'?"),
        (
            ["--cfg", EXAMPLE, "TRAIN.IM_SIZE", "30"],
            "TRAIN.IM_SIZE (30) must be divisible",
        ),
    ],
)
def test_user_mistakes_exit_2_with_one_line(args, message):
    result = run_tool("info_net.py", *args)
    assert result.returncode == 2
    assert result.stderr.strip() == result.stderr.strip().splitlines()[0]
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "tool, args, line",
    [
        # pycls forks' and detectron2's habit: the overrides behind --opts.
        ("train_net.py", ["--cfg", EXAMPLE, "--opts", "OPTIM.MAX_EPOCH", "1"],
         "error: --opts is not needed here: config overrides go as bare KEY VALUE "
         "pairs after the flags: OPTIM.MAX_EPOCH 1"),
        ("info_net.py", ["--cfg", EXAMPLE, "--out-dir", "/tmp/x"],
         "error: --out-dir is not a flag here; it is the config key OUT_DIR: "
         "OUT_DIR /tmp/x"),
        ("test_net.py", ["--config", EXAMPLE],
         f"error: --config is not a flag here; it is --cfg FILE: --cfg {EXAMPLE}"),
        # argparse's own errors, on tools with parsers of their own too: one line
        # instead of the usage and the message.
        ("export.py", ["--run", "out/x", "--format", "tflite", "--dst", "x"],
         "error: argument --format: invalid choice: 'tflite' (choose from "
         "'safetensors', 'onnx') (see export.py --help)"),
        ("plot_log.py", ["--bogus", "run"],
         "error: unrecognized arguments: --bogus (see plot_log.py --help)"),
    ],
)  # fmt: skip
def test_argument_mistakes_are_one_line_exit_2(tool, args, line):
    result = run_tool(tool, *args)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [line]


@pytest.mark.parametrize("mode", ["slurm", "submitit_local"])
def test_a_job_that_cannot_be_shaped_is_refused_before_any_work(tmp_path, mode):
    out = tmp_path / "out"
    result = run_tool(
        "train_net.py", "--cfg", EXAMPLE, "LAUNCH.MODE", mode, "OUT_DIR", str(out),
        "NUM_GPUS", "12", "TRAIN.BATCH_SIZE", "96", "TEST.BATCH_SIZE", "96",
        "MAX_GPUS_PER_NODE", "8",
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: NUM_GPUS (12) over several nodes must be a multiple of "
        "MAX_GPUS_PER_NODE (8)"
    ]
    assert not out.exists()


def test_config_doc_is_current_and_complete():
    result = run_tool("gen_config_doc.py", "--check")
    assert result.returncode == 0, result.stdout
    assert undocumented() == []


def test_convert_weights_files_round_trip(tmp_path):
    cfg = tiny_cfg()
    timm_model = build_timm_vit(cfg)
    src = tmp_path / "timm.pth"
    torch.save({"state_dict": timm_model.state_dict()}, src)
    ours, back = tmp_path / "ours.pyth", tmp_path / "back.pth"
    opts = ["--cfg", EXAMPLE, *TINY, "VIT.CLASSIFIER_TYPE", "token"]
    result = run_tool(
        "convert_weights.py", "--src", str(src), "--dst", str(ours), *opts
    )
    assert result.returncode == 0, result.stderr
    checkpoint = torch.load(ours, weights_only=True)
    assert "encoder.block_1.mlp_block.linear_2.weight" in checkpoint["model_state"]
    result = run_tool(
        "convert_weights.py", "--src", str(ours), "--dst", str(back), "--to-timm", *opts
    )
    assert result.returncode == 0, result.stderr
    original, converted = timm_model.state_dict(), torch.load(back, weights_only=True)
    assert sorted(original) == sorted(converted)
    assert all(torch.equal(original[k], converted[k]) for k in original)


def test_convert_weights_bad_input(tmp_path):
    result = run_tool(
        "convert_weights.py", "--cfg", EXAMPLE, "--src", "nope.pth", "--dst", "x.pth"
    )
    assert result.returncode == 2 and "no such file: nope.pth" in result.stderr
    src = tmp_path / "ours.pth"
    torch.save(build_timm_vit(tiny_cfg()).state_dict(), src)
    dst = tmp_path / "out.pyth"
    result = run_tool(
        "convert_weights.py", "--cfg", EXAMPLE, "--src", str(src), "--dst", str(dst)
    )  # the tiny timm model does not fit the example config's dimensions
    assert result.returncode == 2 and "VIT.CLASSIFIER_TYPE is 'pooled'" in result.stderr
    assert not dst.exists()


def test_bench_loader_runs_every_mode_on_the_same_images(tmp_path):
    # A tiny run of `make bench-loader`: every mode decodes the same 64 images (the
    # tool asserts the counts), ratios and CPU figures come out, memory is skipped.
    result = run_benchmark(
        "loader",
        "--gen-dir",
        str(tmp_path / "jpegs"),
        "--images",
        "64",
        "--batch-size",
        "16",
        "--rounds",
        "1",
        "--im-size",
        "64",
        "--no-memory",
        "--max-tries",
        "1",
        "--json",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    rates = record["images_per_s"]
    assert set(rates) == {
        "single",
        "ceiling",
        "threads",
        "spdl",
        "subprocess",
        "threads-per-image",
        "processes",
    }
    assert all(rate > 0 for rate in rates.values())
    # --workers defaults to the core count, so the ideal is cores x single.
    assert record["ideal"] == pytest.approx(os.cpu_count() * rates["single"])
    assert record["threads_over_processes"] == pytest.approx(
        rates["threads"] / rates["processes"]
    )
    # One round: the median of per-round ratios is that round's ratio.
    for name in ("threads_over_ideal", "threads_over_processes"):
        assert record[f"{name}_per_round_median"] == pytest.approx(record[name])
    assert all(ms > 0 for ms in record["cpu_ms_per_image"].values())
    assert "| threads |" in result.stdout and "| processes |" in result.stdout


def test_check_node_times_one_rank_of_a_sharded_config():
    # ViT-22B-14.yaml (FSDP, NUM_GPUS 512) laid out as in docs/DISTRIBUTED.md (PP 2 x
    # TP 4), shrunk: one rank's step at its share of the global batch (1024 / 64
    # data-parallel ranks), in a one-process group. It crashed before (no process
    # group for FSDP; the TP / PP mesh of one process) and timed the global batch.
    # Folded into one process, a rank of the real ViT-22B needs ~87 GB for its
    # fp32 weights alone: the fold is checked against the planner's memory and
    # trimmed to the blocks that fit (--memory-gib 0.003: 1 of these 2 blocks).
    result = run_tool(
        "check_node.py", "--cfg", "configs/vit/ViT-22B-14.yaml", "--checks", "loader",
        "--steps", "1", "--json", "--memory-gib", "0.003",
        "PARALLEL.TP", "4", "PARALLEL.PP", "2",
        "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32", "VIT.PATCH_SIZE", "8",
        "VIT.HIDDEN_DIM", "48", "VIT.NUM_HEADS", "4", "VIT.MLP_DIM", "96",
        "VIT.NUM_LAYERS", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])["rows"]
    assert [r["check"] for r in rows] == [
        "loader vs step demand (ViT-22B-14.yaml, 16 images per rank)",
        "loader cores per GPU (crop + flip + AutoAugment)",
    ]
    assert {r["verdict"] for r in rows} <= {"ok", "warning"}
    assert "(timed at 1 of 2 blocks: the rank does not fit" in rows[0]["result"]


def test_check_node_on_cpu_reports_every_check():
    result = run_tool("check_node.py", "--steps", "2", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout.strip().splitlines()[-1])["rows"]
    verdicts = {r["check"].split(",")[0].split(" (")[0]: r["verdict"] for r in rows}
    assert verdicts == {
        "device": "ok",
        "AMP O1": "ok",
        "AMP O2": "ok",
        "AMP O3": "ok",
        "DDP vs FSDP": "ok",
        "all-reduce bus bandwidth": "ok",
        "matmul peak float32": "ok",
        "matmul peak bfloat16": "ok",
        "matmul peak float16": "ok",
        # Both loader rows weigh the loader against this machine's own step: another
        # test beside this one (make test runs two files at once) can make them warn.
        "loader vs step demand": verdicts["loader vs step demand"],
        "loader cores per GPU": verdicts["loader cores per GPU"],
        "GPU checks": "skipped",
    }, rows
    assert verdicts["loader vs step demand"] in ("ok", "warning")
    table = result.stdout.splitlines()
    assert any(x.startswith("DDP vs FSDP, 2 CPU processes, gloo") for x in table)
    # A line per check as it starts, the table at the end.
    phases = [x.split(" (")[0] for x in result.stderr.splitlines() if "] " in x]
    assert phases == [f"check_node: [{i + 1}/4] {name}" for i, name in
                      enumerate(["amp", "parallel", "matmul", "loader"])]  # fmt: skip
    # The recipe's cores per GPU: its CPU per image times the step's images/s, and a
    # warning exactly when that passes this machine's cores.
    cores = next(r for r in rows if r["check"].startswith("loader cores per GPU"))
    ms, rate, need, here = map(float, re.findall(r"[0-9.]+", cores["result"]))
    assert need == pytest.approx(
        ms * rate / 1e3, abs=0.05 + 0.005 * rate / 1e3 + ms / 2e3
    )
    assert here == len(os.sched_getaffinity(0))
    assert cores["verdict"] == ("ok" if need <= here else "warning")
    # Each thing said once: no warning about the checks' own AMP overrides, no
    # "skipped  skipped".
    assert "MIXED_PRECISION True is ignored" not in result.stdout + result.stderr
    gpu = next(x for x in table if x.startswith("GPU checks"))
    assert gpu.split()[2:4] == ["skipped", "no"], gpu


ROW = re.compile(
    r"\s+(?:pp(\d+)m(\d+)x)?(ddp|fsdp)(\d+)(?:xtp(\d+))?(\+ac)?\s+"
    r"([\d./ ]+) = ([\d.]+)\s+(fits|does not fit), speed ([\d.]+)(\s+<- plan)?$"
)


def test_plan_net_prints_each_layout_and_the_choice():
    path = "configs/vit/ViT-22B-14.yaml"
    result = run_tool("plan_net.py", "--cfg", path, "--gpus", "8,64",
                      "TRAIN.BATCH_SIZE", "4096")  # fmt: skip
    assert result.returncode == 0, result.stderr
    cfg = load_cfg(os.path.join(ROOT, path))
    assert cfg.OPTIM.OPTIMIZER == "adamw" and cfg.OPTIM.EMA_ALPHA > 0
    # Derived apart from the planner: fp32 weights, as many gradients, AdamW's two
    # moments, one EMA copy; the weights outside the blocks (stem, positions, head)
    # are what a pipeline stage may hold beyond its even share.
    tenths = vit_param_count(cfg) * 4 / 2**30 * 10  # GiB in tenths, as printed
    v = cfg.VIT
    block = 4 * v.HIDDEN_DIM**2 + 2 * v.HIDDEN_DIM * v.MLP_DIM + 9 * v.HIDDEN_DIM
    outside = (vit_param_count(cfg) - v.NUM_LAYERS * block) * 4 / 2**30 * 10
    printed = 0.5  # figures are rounded to the tenth: compared as integers of tenths
    tables = result.stdout.split("plan: ")
    for gpus, table in zip((8, 64), tables):
        rows = [m for line in table.splitlines() if (m := ROW.fullmatch(line))]
        assert len(rows) >= 4, table
        for m in rows:
            pp, micro, kind, dp, tp = (int(m[1] or 1), int(m[2] or 1), m[3],
                                       int(m[4]), int(m[5] or 1))  # fmt: skip
            assert pp * dp * tp == gpus, m[0]
            assert 4096 // dp % micro == 0 or micro == 1, m[0]
            parts = [round(float(x) * 10) for x in m[7].split(" / ")]
            params, grads, optim, master, ema = parts[:5]
            total = round(float(m[8]) * 10)
            shards = pp * tp * (dp if kind == "fsdp" else 1)
            share = tenths / shards
            assert share - printed <= params <= share + outside + printed, m[0]
            assert grads == params == ema and master == 0, m[0]
            assert abs(optim - 2 * params) <= 2 * printed, m[0]
            assert abs(sum(parts) - total) <= len(parts) * printed, m[0]
            limit = HEADROOM * 800  # the planner keeps a margin of each GPU's 80 GiB
            if abs(total - limit) > len(parts) * printed:  # not decided by rounding
                assert (m[9] == "fits") == (total <= limit), m[0]
        # The plan: the fastest of the layouts that fit, marked, and its settings.
        fitting = [m for m in rows if m[9] == "fits"]
        best = max(fitting, key=lambda m: float(m[10]))
        assert [m[0] for m in rows if m[11]] == [best[0]]
        settings = tables[tables.index(table) + 1].splitlines()[0]
        pp, micro, kind, tp = best[1], best[2], best[3], best[5] or "1"
        assert settings.startswith(
            f"{best[0].split()[0]}: PARALLEL.PP {pp} PARALLEL.TP {tp} FSDP.ENABLED "
            f"{kind == 'fsdp'} FSDP.ACTIVATION_CHECKPOINT {bool(best[6])} "
            f"PARALLEL.PP_MICROBATCHES {micro}"
        ), settings
        # Unsharded, the 22B fp32 weights alone exceed a GPU's 80 GiB.
        assert tenths > 800
        assert [m[9] for m in rows if m[3] == "ddp" and not (m[1] or m[5])] == [
            "does not fit"
        ]
    # Nothing fits in 1 GiB: one line says what would help.
    none = run_tool("plan_net.py", "--cfg", "configs/vit/ViT-22B-14.yaml",
                    "--gpu-gib", "1")  # fmt: skip
    assert "plan: none fits: more GPUs, or fewer images per step" in none.stdout
    bad = run_tool("plan_net.py", "--cfg", "configs/vit/ViT-22B-14.yaml", "--gpus", "x")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: --gpus: comma-separated integers, got x"


def _mutation_tool():
    spec = importlib.util.spec_from_file_location(
        "mutation_tool", os.path.join(ROOT, "tools", "mutation.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_mutation_tool_plants_one_change_per_mutant():
    tool = _mutation_tool()
    target = next(t for t in tool.TARGETS if t.name == "ema")
    with open(os.path.join(ROOT, target.path)) as f:
        source = f.read()
    mutants = tool.enumerate_mutants(target, source)
    assert len({m.key for m in mutants}) == len(mutants)
    original = ast.unparse(ast.parse(source)).splitlines()
    for m in mutants:
        planted = tool.mutated_source(source, m).splitlines()
        compile("\n".join(planted), target.path, "exec")
        changed = [a for a, b in zip(original, planted) if a != b]
        assert len(planted) == len(original) and len(changed) == 1, m.what
    planted = {m.what: tool.mutated_source(source, m) for m in mutants}
    assert "epoch >= cfg.OPTIM.WARMUP_EPOCHS" in planted["`<` -> `>=`"]


def test_mutation_targets_name_tests_that_exist_and_equivalents_that_exist():
    tool = _mutation_tool()
    nodes = sorted({t for target in tool.TARGETS for t in target.tests})
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *nodes],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:]
    keys = set()
    for target in tool.TARGETS:
        with open(os.path.join(ROOT, target.path)) as f:
            keys |= {m.key for m in tool.enumerate_mutants(target, f.read())}
    assert set(tool.EQUIVALENT) <= keys, set(tool.EQUIVALENT) - keys


def _check_node_tool():
    """tools/check_node.py as a module."""
    spec = importlib.util.spec_from_file_location(
        "check_node_tool", os.path.join(ROOT, "tools", "check_node.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_check_node_says_how_short_the_loader_falls():
    tool = _check_node_tool()
    # 20% over the step's demand is ok; short of it, how short, in words.
    assert tool.loader_verdict(1200, 1000) == ("ok", "")
    verdict, fix = tool.loader_verdict(1335, 1147)
    assert verdict == "warning"
    assert fix.startswith("the loader keeps up with 16% to spare, under 20%: raise")
    assert tool.loader_verdict(900, 1000)[1].startswith(
        "the loader would starve the step: raise DATA_LOADER.NUM_WORKERS"
    )


def test_check_node_names_where_the_policy_runs_and_when_to_move_it(monkeypatch):
    tool = _check_node_tool()
    host = load_cfg(None, ["TRAIN.AUGMENT", "rand-m9-mstd0.5-inc1"])
    device = load_cfg(None, ["TRAIN.AUGMENT", "rand-m9-mstd0.5-inc1",
                             "TRAIN.AUGMENT_BACKEND", "device"])  # fmt: skip
    assert tool.recipe_name(host) == "crop + flip + rand-m9-mstd0.5-inc1"
    assert tool.recipe_name(device) == (
        "crop + flip + rand-m9-mstd0.5-inc1 on the device"
    )
    assert tool._device_hint(host) == ""  # no GPU here
    monkeypatch.setattr(tool.torch.cuda, "is_available", lambda: True)
    assert "TRAIN.AUGMENT_BACKEND device" in tool._device_hint(host)
    assert tool._device_hint(device) == ""
    augmix = load_cfg(None, ["TRAIN.AUGMENT", "augmix-m5-w4-d2"])
    assert tool._device_hint(augmix) == ""
