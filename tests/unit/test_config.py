"""Config: pycls compatibility, merging, validation, dump, docs."""

import glob
import os
import re
import tokenize

import pytest
import torch
import yaml

from pycls_fast import config
from pycls_fast.config import (
    IGNORED,
    LIMITS,
    ConfigError,
    _flat_keys,
    check_launch,
    dump_cfg,
    get_cfg,
    ignored_keys,
    load_cfg,
    with_overrides,
)
from pycls_fast.models import build_model, complexity
from tests.helpers import ROOT, vit_param_count

PYCLS_VIT = os.path.join(ROOT, "tests", "data", "pycls_vit_p_4gf.yaml")
DIGITS = os.path.join(ROOT, "configs", "examples", "vit_digits.yaml")


def test_get_cfg_returns_independent_copies():
    a, b = get_cfg(), get_cfg()
    a.OPTIM.BASE_LR = 123.0
    assert b.OPTIM.BASE_LR == 0.1
    assert get_cfg().OPTIM.BASE_LR == 0.1


def test_pycls_vit_config_loads_unchanged():
    cfg = load_cfg(PYCLS_VIT)
    assert cfg.VIT.HIDDEN_DIM == 384 and cfg.VIT.MLP_DIM == 1152
    assert pytest.approx(1e-6) == cfg.LN.EPS  # YAML 1.1 reads 1e-6 as a string
    assert cfg.OPTIM.BIAS_CUSTOM_WEIGHT_DECAY == 0.0
    assert cfg.TRAIN.MIXED_PRECISION is True
    assert cfg.AMP.MODE == "O1"  # pycls's alias, AMP.MODE unset: the balanced mode
    assert cfg.LAUNCH.PARTITION == "learnlab"
    assert cfg.NUM_GPUS == 32


# The union of the keys of pycls's config schema across its releases.
PYCLS_KEYS = [
    "MODEL.TYPE",
    "MODEL.DEPTH",
    "MODEL.NUM_CLASSES",
    "MODEL.LOSS_FUN",
    "MODEL.ACTIVATION_FUN",
    "MODEL.ACTIVATION_INPLACE",
    "MODEL.SCALING_TYPE",
    "MODEL.SCALING_FACTOR",
    "RESNET.TRANS_FUN",
    "RESNET.NUM_GROUPS",
    "RESNET.WIDTH_PER_GROUP",
    "RESNET.STRIDE_1X1",
    "ANYNET.STEM_TYPE",
    "ANYNET.STEM_W",
    "ANYNET.BLOCK_TYPE",
    "ANYNET.DEPTHS",
    "ANYNET.WIDTHS",
    "ANYNET.STRIDES",
    "ANYNET.BOT_MULS",
    "ANYNET.GROUP_WS",
    "ANYNET.HEAD_W",
    "ANYNET.SE_ON",
    "ANYNET.SE_R",
    "REGNET.STEM_TYPE",
    "REGNET.STEM_W",
    "REGNET.BLOCK_TYPE",
    "REGNET.STRIDE",
    "REGNET.SE_ON",
    "REGNET.SE_R",
    "REGNET.DEPTH",
    "REGNET.W0",
    "REGNET.WA",
    "REGNET.WM",
    "REGNET.GROUP_W",
    "REGNET.BOT_MUL",
    "REGNET.HEAD_W",
    "EN.STEM_W",
    "EN.DEPTHS",
    "EN.WIDTHS",
    "EN.EXP_RATIOS",
    "EN.SE_R",
    "EN.STRIDES",
    "EN.KERNELS",
    "EN.HEAD_W",
    "EN.DC_RATIO",
    "EN.DROPOUT_RATIO",
    "VIT.PATCH_SIZE",
    "VIT.STEM_TYPE",
    "VIT.C_STEM_KERNELS",
    "VIT.C_STEM_STRIDES",
    "VIT.C_STEM_DIMS",
    "VIT.NUM_LAYERS",
    "VIT.NUM_HEADS",
    "VIT.HIDDEN_DIM",
    "VIT.MLP_DIM",
    "VIT.CLASSIFIER_TYPE",
    "BN.EPS",
    "BN.MOM",
    "BN.USE_PRECISE_STATS",
    "BN.NUM_SAMPLES_PRECISE",
    "BN.ZERO_INIT_FINAL_GAMMA",
    "BN.USE_CUSTOM_WEIGHT_DECAY",
    "BN.CUSTOM_WEIGHT_DECAY",
    "LN.EPS",
    "LN.USE_CUSTOM_WEIGHT_DECAY",
    "LN.CUSTOM_WEIGHT_DECAY",
    "OPTIM.OPTIMIZER",
    "OPTIM.BASE_LR",
    "OPTIM.MIN_LR",
    "OPTIM.LR_POLICY",
    "OPTIM.STEPS",
    "OPTIM.LR_MULT",
    "OPTIM.GAMMA",
    "OPTIM.MAX_EPOCH",
    "OPTIM.MOMENTUM",
    "OPTIM.DAMPENING",
    "OPTIM.NESTEROV",
    "OPTIM.BETA1",
    "OPTIM.BETA2",
    "OPTIM.WEIGHT_DECAY",
    "OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY",
    "OPTIM.BIAS_CUSTOM_WEIGHT_DECAY",
    "OPTIM.WARMUP_FACTOR",
    "OPTIM.WARMUP_EPOCHS",
    "OPTIM.EMA_ALPHA",
    "OPTIM.EMA_UPDATE_PERIOD",
    "OPTIM.MTA",
    "TRAIN.DATASET",
    "TRAIN.SPLIT",
    "TRAIN.BATCH_SIZE",
    "TRAIN.IM_SIZE",
    "TRAIN.EVAL_PERIOD",
    "TRAIN.CHECKPOINT_PERIOD",
    "TRAIN.AUTO_RESUME",
    "TRAIN.WEIGHTS",
    "TRAIN.MIXED_PRECISION",
    "TRAIN.LABEL_SMOOTHING",
    "TRAIN.MIXUP_ALPHA",
    "TRAIN.CUTMIX_ALPHA",
    "TRAIN.PCA_STD",
    "TRAIN.AUGMENT",
    "TEST.DATASET",
    "TEST.SPLIT",
    "TEST.BATCH_SIZE",
    "TEST.IM_SIZE",
    "TEST.WEIGHTS",
    "DATA_LOADER.NUM_WORKERS",
    "DATA_LOADER.PIN_MEMORY",
    "DATA_LOADER.MODE",
    "CUDNN.BENCHMARK",
    "MEM.RELU_INPLACE",
    "PREC_TIME.WARMUP_ITER",
    "PREC_TIME.NUM_ITER",
    "LAUNCH.MODE",
    "LAUNCH.MAX_RETRY",
    "LAUNCH.NAME",
    "LAUNCH.COMMENT",
    "LAUNCH.CPUS_PER_GPU",
    "LAUNCH.MEM_PER_GPU",
    "LAUNCH.PARTITION",
    "LAUNCH.GPU_TYPE",
    "LAUNCH.TIME_LIMIT",
    "LAUNCH.EMAIL",
    "FSDP.ENABLED",
    "FSDP.RESHARD_AFTER_FW",
    "FSDP.LAYER_NORM_FP32",
    "FSDP.DO_NOT_RESHARD_AFTER_FW",
    "FSDP.MIXED_PRECISION",
    "DESC",
    "VERBOSE",
    "NUM_GPUS",
    "MAX_GPUS_PER_NODE",
    "OUT_DIR",
    "CFG_DEST",
    "RNG_SEED",
    "LOG_DEST",
    "LOG_PERIOD",
    "DIST_BACKEND",
    "HOST",
    "PORT",
    "PORT_RANGE",
    "DOWNLOAD_CACHE",
]


def test_every_pycls_schema_key_is_accepted():
    ours = set(_flat_keys(get_cfg()))
    assert [k for k in PYCLS_KEYS if k not in ours] == []


def test_deprecated_pycls_keys_are_ignored(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("PREC_TIME:\n  ENABLED: True\n  BATCH_SIZE: 128\n")
    cfg = load_cfg(str(path))
    assert "ENABLED" not in cfg.PREC_TIME


@pytest.mark.parametrize(
    "path",
    sorted(
        p
        for p in glob.glob(os.path.join(ROOT, "configs/*/*.yaml"))
        # sweep configs have their own schema (test_sweep); launch/ holds launch-key
        # fragments for _BASE_ (tests/unit/launch/test_submit.py loads them)
        if "/sweeps/" not in p and "/launch/" not in p
    ),
)
def test_shipped_configs_load_the_model_their_name_says(path):
    cfg = load_cfg(path)
    assert cfg.MODEL.TYPE == "vit"
    assert cfg.DESC
    v = cfg.VIT
    want = _named_model(os.path.basename(path)[: -len(".yaml")], cfg.DESC)
    if want.get("dims"):
        assert want["dims"] == (v.HIDDEN_DIM, v.NUM_LAYERS, v.NUM_HEADS, v.MLP_DIM)
    for key, got in (("patch", v.PATCH_SIZE), ("im_size", cfg.TRAIN.IM_SIZE),
                     ("stem", v.STEM_TYPE)):  # fmt: skip
        if key in want:
            assert got == want[key], key
    if want.get("stem") == "conv":  # ViT_C-xGF: ViT_P-xGF with one block fewer
        p = load_cfg(path.replace("ViT-C-", "ViT-P-")).VIT
        assert (v.HIDDEN_DIM, v.NUM_HEADS, v.MLP_DIM) == (p.HIDDEN_DIM, p.NUM_HEADS,
                                                          p.MLP_DIM)  # fmt: skip
        assert v.NUM_LAYERS == p.NUM_LAYERS - 1
    cx = complexity(cfg)
    if "gflops" in want:  # pycls names its designs by their flops, nominally:
        # of the family's names, this config's flops are nearest its own
        nearest = min((1, 4, 18, 36), key=lambda n: abs(cx["flops"] / 1e9 - n))
        assert nearest == want["gflops"]
    # The counted parameters: the architecture's formula, and the model built (on
    # the meta device: no memory, even for ViT-22B).
    with torch.device("meta"):
        built = sum(p.numel() for p in build_model(cfg).parameters())
    assert cx["params"] == vit_param_count(cfg) == built


# (width, depth, heads, MLP) as published: ViT-Ti (DeiT, Touvron et al. 2021, Table 1),
# S/B/L/H (Dosovitskiy et al. 2020, Table 1; S from DeiT), g/G (Zhai et al. 2022,
# Table 2), e (PaLI, Chen et al. 2022, 3.1), 22B (Dehghani et al. 2023, Table 1).
PUBLISHED = {
    "Ti": (192, 12, 3, 768), "S": (384, 12, 6, 1536), "B": (768, 12, 12, 3072),
    "L": (1024, 24, 16, 4096), "H": (1280, 32, 16, 5120),
    "g": (1408, 40, 16, 6144), "G": (1664, 48, 16, 8192),
    "e": (1792, 56, 16, 15360), "22B": (6144, 48, 48, 24576),
}  # fmt: skip


def _named_model(name: str, desc: str) -> dict:
    """What a shipped config's file name (and its DESC's "N px") says of its model."""
    if m := re.fullmatch(r"ViT-(\w+)-(\d+)(GF)?", name):  # configs/vit: ViT-B-16
        if not m[3]:
            return {"dims": PUBLISHED[m[1]], "patch": int(m[2]), "im_size": 224}
        stem = {"P": "patchify", "C": "conv"}[m[1]]  # configs/pycls: ViT-P-4GF
        return {"stem": stem, "patch": 16, "im_size": 224, "gflops": int(m[2])}
    if m := re.fullmatch(r"deit3?_(ti|s|b)(_ft(\d+))?", name):
        px = re.search(r"(\d+) px", desc)
        size = int(m[3] or (px[1] if px else 224))
        return {"dims": PUBLISHED[m[1].capitalize()], "patch": 16, "im_size": size}
    assert name.startswith(("vit_", "deit_s_digits")), f"{name}: what model is it?"
    return {}  # the examples and the digits student: their own shapes


def test_overrides_are_typed():
    cfg = load_cfg(None, ["OPTIM.BASE_LR", "0.5", "VIT.C_STEM_DIMS", "[1, 2]"])
    assert cfg.OPTIM.BASE_LR == 0.5
    assert cfg.VIT.C_STEM_DIMS == [1, 2]
    cfg = load_cfg(None, ["TRAIN.BATCH_SIZE", "64", "OPTIM.MTA", "True"])
    assert cfg.TRAIN.BATCH_SIZE == 64 and cfg.OPTIM.MTA is True
    # An int given for a float key becomes a float.
    assert isinstance(load_cfg(None, ["OPTIM.BASE_LR", "1"]).OPTIM.BASE_LR, float)


def test_base_inheritance(tmp_path):
    (tmp_path / "base.yaml").write_text("VIT:\n  HIDDEN_DIM: 384\n  NUM_HEADS: 6\n")
    (tmp_path / "child.yaml").write_text("_BASE_: base.yaml\nVIT:\n  NUM_LAYERS: 3\n")
    cfg = load_cfg(str(tmp_path / "child.yaml"))
    assert (cfg.VIT.HIDDEN_DIM, cfg.VIT.NUM_LAYERS) == (384, 3)


@pytest.mark.parametrize(
    "opts, message",
    [
        (["VIT.HIDEN_DIM", "384"], "VIT.HIDEN_DIM (did you mean 'VIT.HIDDEN_DIM'?)"),
        (["OPTIMM.BASE_LR", "1"], "OPTIMM.BASE_LR (did you mean 'OPTIM.BASE_LR'?)"),
        (["TRAIN.BATCH_SIZE", "many"], "TRAIN.BATCH_SIZE: expected int, got 'many'"),
        (["TRAIN.BATCH_SIZE", "1.5"], "TRAIN.BATCH_SIZE: expected int"),
        (["OPTIM.MTA", "3"], "OPTIM.MTA: expected bool"),
        (["TRAIN.IM_SIZE", "100"], "TRAIN.IM_SIZE (100) must be divisible by"),
        (["VIT.NUM_HEADS", "7"], "VIT.HIDDEN_DIM (768) must be divisible by"),
        (["VIT.CLASSIFIER_TYPE", "pool"], "did you mean 'pooled'?"),
        (["VIT.LAYOUT", "seq_first"], "VIT.LAYOUT must be one of"),
        (["OPTIM.OPTIMIZER", "adamw2"], "did you mean 'adamw'?"),
        (["TRAIN.BATCH_SIZE", "0"], "TRAIN.BATCH_SIZE must be > 0"),
        (["TRAIN.LABEL_SMOOTHING", "1.5"], "TRAIN.LABEL_SMOOTHING must be in [0, 1)"),
        (["OPTIM.STEPS", "[5, 10]"], "OPTIM.STEPS must be [] or a list starting at 0"),
        (["OUT_DIR", ""], "OUT_DIR must be a folder, got ''"),
        (["NUM_GPUS", "3"], "TRAIN.BATCH_SIZE (128) must be divisible by NUM_GPUS"),
        (["DATA.CROP_SCALE", "[0.5, 0.2]"], "DATA.CROP_SCALE must be [min, max]"),
        (["DATA.HFLIP", "1.5"], "DATA.HFLIP must be in [0, 1], got 1.5"),
        (["MODEL.ACTIVATION_FUN", "silu"], "MODEL.ACTIVATION_FUN 'silu' is not impl"),
        (["DATA_LOADER.MODE", "ffcv"], "DATA_LOADER.MODE 'ffcv' is not implemented"),
        (
            ["OPTIM.LR_POLICY", "exp", "OPTIM.GAMMA", "0.5"],
            "OPTIM.GAMMA 0.5 is not implemented",
        ),
        (["MODEL.TYPE", "resnet"], "MODEL.TYPE must be one of ['vit']"),
        (["VIT.PATCH_SIZE"], "KEY VALUE or KEY=VALUE pairs"),
        (["DIST_BACKEND", "nccl2"], "DIST_BACKEND must be one of"),
        (
            ["VIT.ATTENTION", "sdpa_flash", "AMP.MODE", "fp32"],
            "VIT.ATTENTION 'sdpa_flash' needs fp16 / bf16 inputs",
        ),
        (["VIT.ATTENTION", "sdpa_cudnn"], "VIT.ATTENTION 'sdpa_cudnn' needs fp16"),
        (
            ["TRAIN.CUDA_GRAPHS", "True", "NUM_GPUS", "2", "FSDP.ENABLED", "True"],
            "TRAIN.CUDA_GRAPHS True does not work with FSDP.ENABLED",
        ),
        (
            ["TRAIN.CUDA_GRAPHS", "True", "NUM_GPUS", "2", "PARALLEL.PP", "2"],
            "TRAIN.CUDA_GRAPHS True does not work with PARALLEL.PP",
        ),
        (
            ["TRAIN.CUDA_GRAPHS", "True", "TRAIN.COMPILE", "block"],
            "does not work with TRAIN.COMPILE 'block'",
        ),
    ],
)
def test_bad_values_name_the_key(opts, message):
    with pytest.raises(ConfigError) as e:
        load_cfg(None, opts)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


CONV = ["VIT.STEM_TYPE", "conv", "VIT.HIDDEN_DIM", "64", "VIT.NUM_HEADS", "4"]


@pytest.mark.parametrize(
    "stem, message",
    [
        (
            ["[3, 3, 1]", "[2, 2, 2]", "[16, 32, 64]"],
            "multiply to 8, not VIT.PATCH_SIZE",
        ),
        (["[3, 3, 1]", "[4, 4, 1]", "[16, 32, 48]"], "VIT.C_STEM_DIMS ends with 48"),
        (["[3, 1]", "[4, 4, 1]", "[16, 32, 64]"], "of equal length"),
        (["[3, 2, 1]", "[4, 4, 1]", "[16, 32, 64]"], "VIT.C_STEM_KERNELS must be odd"),
    ],
)
def test_conv_stem_checks(stem, message):
    keys = ["VIT.C_STEM_KERNELS", "VIT.C_STEM_STRIDES", "VIT.C_STEM_DIMS"]
    opts = CONV + [x for pair in zip(keys, stem) for x in pair]
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_cfg(None, opts)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_cfg(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("VIT:\n  PATCH_SIZE: 8\n  NUM_LAYERS: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML at line 4, column 1: "):
        load_cfg(str(bad))
    typo = tmp_path / "typo.yaml"
    typo.write_text("TRAIN:\n  BATCHSIZE: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'TRAIN.BATCH_SIZE'"):
        load_cfg(str(typo))
    # A typo in a _BASE_ file names that file, not the one that includes it.
    child = tmp_path / "child.yaml"
    child.write_text("_BASE_: typo.yaml\nOPTIM:\n  BASE_LR: 0.1\n")
    with pytest.raises(ConfigError, match=r"BATCH_SIZE'\?\) \(in .*typo.yaml\)$"):
        load_cfg(str(child))
    # A section given twice would drop the first's keys; a key twice, its value.
    twice = tmp_path / "twice.yaml"
    twice.write_text("TRAIN:\n  IM_SIZE: 16\nVIT:\n  NUM_LAYERS: 2\nTRAIN:\n  X: 3\n")
    with pytest.raises(ConfigError) as e:
        load_cfg(str(twice))
    assert str(e.value) == (
        f"config file {twice} is not valid YAML at line 5, column 1: TRAIN given twice"
    )
    twice.write_text("VIT:\n  NUM_LAYERS: 2\n  NUM_LAYERS: 3\n")
    with pytest.raises(ConfigError, match="line 3, column 3: NUM_LAYERS given twice"):
        load_cfg(str(twice))
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=f"^config file {empty} is empty: it sets"):
        load_cfg(str(empty))


def test_dump_round_trip(tmp_path):
    cfg = load_cfg(PYCLS_VIT, ["OUT_DIR", str(tmp_path)])
    path = dump_cfg(cfg)
    assert path == str(tmp_path / "config.yaml")
    again = load_cfg(path)
    assert again == cfg
    with open(path) as f:
        assert yaml.safe_load(f)["VIT"]["MLP_DIM"] == 1152


def test_loaded_config_is_frozen_and_adjusted_by_with_overrides():
    cfg = load_cfg(None, ["OPTIM.BASE_LR", "0.5"])
    with pytest.raises(AttributeError):
        cfg.OPTIM.BASE_LR = 1.0
    two = with_overrides(cfg, {"NUM_GPUS": 2, "OPTIM.MAX_EPOCH": "7"})
    assert (two.NUM_GPUS, two.OPTIM.MAX_EPOCH, two.OPTIM.BASE_LR) == (2, 7, 0.5)
    assert cfg.NUM_GPUS == 1 and two.is_frozen()
    # The same checks as loading: limits, combinations, unknown keys.
    with pytest.raises(ConfigError, match="must be divisible by NUM_GPUS"):
        with_overrides(cfg, {"NUM_GPUS": 3})
    with pytest.raises(ConfigError, match="did you mean 'NUM_GPUS'"):
        with_overrides(cfg, {"NUM_GPU": 2})
    assert get_cfg().is_frozen() is False  # the defaults stay mutable


@pytest.mark.parametrize(
    "path, opts, mode",
    [
        # The file sets TRAIN.MIXED_PRECISION True: an explicit AMP.MODE wins.
        (DIGITS, ["AMP.MODE", "fp32"], "fp32"),
        (DIGITS, [], "O1"),
        (DIGITS, ["AMP.MODE", "O3"], "O3"),
        (DIGITS, ["TRAIN.MIXED_PRECISION", "False"], "fp32"),
        (PYCLS_VIT, [], "O1"),
        (None, [], "fp32"),
        (None, ["AMP.MODE", "fp32", "TRAIN.MIXED_PRECISION", "True"], "fp32"),
        # pycls's FSDP.MIXED_PRECISION, with FSDP: O2 (and nothing without FSDP).
        (None, ["FSDP.ENABLED", "True", "FSDP.MIXED_PRECISION", "True"], "O2"),
        (None, ["FSDP.MIXED_PRECISION", "True"], "fp32"),
        (
            None,
            ["FSDP.ENABLED", "True", "FSDP.MIXED_PRECISION", "True", "AMP.MODE", "O1"],
            "O1",
        ),  # fmt: skip
        # AMP.MODE '' is "not set": the alias decides.
        (None, ["AMP.MODE", "", "TRAIN.MIXED_PRECISION", "True"], "O1"),
    ],
)
def test_amp_mode_is_the_one_precision_switch(path, opts, mode):
    assert mode == load_cfg(path, opts).AMP.MODE


def test_explicit_amp_mode_in_the_file_wins_over_an_alias_override(tmp_path):
    path = tmp_path / "o2.yaml"
    path.write_text("AMP:\n  MODE: O2\n")
    assert load_cfg(str(path), ["TRAIN.MIXED_PRECISION", "True"]).AMP.MODE == "O2"
    # with_overrides follows the same rule: the file's AMP.MODE stays explicit...
    cfg = with_overrides(load_cfg(str(path)), {"TRAIN.MIXED_PRECISION": True})
    assert cfg.AMP.MODE == "O2"
    # ...and a mode that came from an alias follows a later change of the alias.
    cfg = with_overrides(load_cfg(DIGITS), {"TRAIN.MIXED_PRECISION": False})
    assert cfg.AMP.MODE == "fp32"


def test_explicit_fp32_over_an_alias_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(config, "_warned", set())
    for _ in range(2):
        load_cfg(DIGITS, ["AMP.MODE", "fp32"])
    lines = [r.getMessage() for r in caplog.records if "AMP.MODE" in r.getMessage()]
    assert len(lines) == 1
    assert "TRAIN.MIXED_PRECISION True is ignored: the precision is fp32" in lines[0]


@pytest.mark.parametrize(
    "opts, layer_norm_fp32, reshard",
    [
        ([], True, True),
        (["FSDP.LAYER_NORM_FP32", "False"], False, True),
        (["FSDP.LAYER_NORM_FP32", "False", "AMP.LAYER_NORM_FP32", "True"], True, True),
        (["AMP.LAYER_NORM_FP32", "False"], False, True),
        (["FSDP.DO_NOT_RESHARD_AFTER_FW", "True"], True, False),
        (
            ["FSDP.DO_NOT_RESHARD_AFTER_FW", "True", "FSDP.RESHARD_AFTER_FW", "True"],
            True,
            True,
        ),  # fmt: skip
    ],
)
def test_pycls_fsdp_aliases(opts, layer_norm_fp32, reshard):
    cfg = load_cfg(None, opts)
    assert cfg.AMP.LAYER_NORM_FP32 is layer_norm_fp32
    assert cfg.FSDP.RESHARD_AFTER_FW is reshard


def test_pycls_pytorch_loader_mode_is_processes():
    assert load_cfg(None, ["DATA_LOADER.MODE", "pytorch"]).DATA_LOADER.MODE == (
        "processes"
    )


def test_ignored_key_set_warns_once_naming_it(caplog, monkeypatch):
    monkeypatch.setattr(config, "_warned", set())
    with caplog.at_level("WARNING", logger="pycls_fast.config"):
        for _ in range(3):
            load_cfg(None, ["REGNET.W0", "48", "OPTIM.GAMMA", "0.5"])
        load_cfg(None)  # defaults: no warning
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert any("REGNET.W0 is accepted for pycls but ignored" in x for x in lines)
    assert any("OPTIM.GAMMA" in x for x in lines)  # not refused: LR_POLICY is 'cos'


def test_pycls_launch_keys_load_and_are_checked():
    cfg = load_cfg(PYCLS_VIT)
    assert (cfg.LAUNCH.MODE, cfg.MAX_GPUS_PER_NODE) == ("slurm", 8)
    check_launch(cfg)  # slurm is implemented (launch/submit.py)
    with pytest.raises(ConfigError, match="LAUNCH.TIME_LIMIT"):
        load_cfg(PYCLS_VIT, ["LAUNCH.TIME_LIMIT", "0"])


# Keys that only config.py reads: limited to one value, descriptive, or pycls's
# aliases resolved onto their switch at load.
READ_BY_CONFIG = {
    "MODEL.TYPE",
    "MODEL.LOSS_FUN",
    "DESC",
    "TRAIN.MIXED_PRECISION",
    "FSDP.MIXED_PRECISION",
    "FSDP.LAYER_NORM_FP32",
    "FSDP.DO_NOT_RESHARD_AFTER_FW",
}


def _read_by_modules(key, text):
    """Whether `text` reads `key`: as cfg.NODE.KEY, or through the node itself
    (o = cfg.OPTIM; o.KEY), or a top-level key as cfg.KEY."""
    if re.search(rf"\.{re.escape(key)}\b", text):
        return True
    node, _, leaf = key.partition(".")
    whole_node = re.search(rf"\.{node}\b(?!\.)", text)
    return bool(leaf and whole_node and re.search(rf"\.{leaf}\b", text))


def _code_only(path):
    """The source of `path` with comments and strings blanked out (names in prose or
    messages are not reads). An f-string is blanked whole, expressions included, on
    every Python: before 3.12 it is one STRING token, from 3.12 on a run of
    FSTRING_START ... FSTRING_END tokens (nested ones included)."""
    with open(path) as f:
        lines = f.read().splitlines(keepends=True)
    fstring_start = getattr(tokenize, "FSTRING_START", None)
    fstring_end = getattr(tokenize, "FSTRING_END", None)
    spans, depth, opened = [], 0, None
    with open(path, "rb") as f:
        for t in tokenize.tokenize(f.readline):
            if t.type == fstring_start:
                depth += 1
                opened = t.start if depth == 1 else opened
            elif t.type == fstring_end:
                depth -= 1
                if depth == 0:
                    spans.append((opened, t.end))
            elif depth == 0 and t.type in (tokenize.COMMENT, tokenize.STRING):
                spans.append((t.start, t.end))
    for (r0, c0), (r1, c1) in reversed(spans):
        if r0 == r1:
            line = lines[r0 - 1]
            lines[r0 - 1] = line[:c0] + " " * (c1 - c0) + line[c1:]
        else:
            lines[r0 - 1] = lines[r0 - 1][:c0] + "\n"
            for r in range(r0, r1 - 1):
                lines[r] = "\n"
            lines[r1 - 1] = " " * c1 + lines[r1 - 1][c1:]
    return "".join(lines)


def test_ignored_keys_are_exactly_the_keys_no_module_reads():
    keys = ignored_keys()
    # Ignored keys exist only for pycls's configs to load: each is one of pycls's,
    # and (below) exactly those of them that nothing here reads.
    assert keys and [k for k in keys if k not in PYCLS_KEYS] == []
    flat = set(_flat_keys(get_cfg()))
    assert all(k in flat or k in get_cfg() for k in IGNORED)
    sources = glob.glob(os.path.join(ROOT, "pycls_fast", "**", "*.py"), recursive=True)
    sources += glob.glob(os.path.join(ROOT, "tools", "*.py"))
    text = ""
    # config.py and the docs generator name keys, not read them; the sweep package
    # reads its own sweep schema (NAME, DESC, SETUP, ...).
    for path in sources:
        if "/sweep/" in path:
            continue
        if not path.endswith(("config.py", "config_doc.py", "gen_config_doc.py")):
            text += _code_only(path)
    read = [k for k in keys if _read_by_modules(k, text)]
    assert read == [], "listed in config.IGNORED but read"
    unread = [k for k in flat - set(keys) if not _read_by_modules(k, text)]
    assert sorted(unread) == sorted(READ_BY_CONFIG), "read by nothing, not IGNORED"


def test_limits_name_existing_keys_and_accept_the_defaults():
    flat = set(_flat_keys(get_cfg()))
    assert set(LIMITS) <= flat
    defaults = get_cfg()
    for key, limit in LIMITS.items():
        assert limit.error(key, config._get(defaults, key)) is None, key


@pytest.mark.parametrize(
    "spelling, expected",
    [("true", True), ("True", True), ("yes", True), ("false", False), ("off", False)],
)
def test_boolean_overrides_accept_yaml_spellings(spelling, expected):
    """config.yaml writes `true`; an override may spell it the same way."""
    cfg = load_cfg(None, ["OPTIM.MTA", spelling])
    assert cfg.OPTIM.MTA is expected


def test_key_equals_value_overrides_mix_with_pairs():
    cfg = load_cfg(
        None, ["OPTIM.BASE_LR=0.01", "TRAIN.BATCH_SIZE", "64", "OUT_DIR=/tmp/a=b"]
    )
    assert cfg.OPTIM.BASE_LR == 0.01 and cfg.TRAIN.BATCH_SIZE == 64
    assert cfg.OUT_DIR == "/tmp/a=b"


def test_lowercase_key_gets_did_you_mean():
    with pytest.raises(
        ConfigError, match=r"optim.base_lr \(did you mean 'OPTIM.BASE_LR'"
    ):
        load_cfg(None, ["optim.base_lr", "0.1"])


def test_a_non_boolean_word_for_a_boolean_is_still_refused():
    with pytest.raises(ConfigError, match="OPTIM.MTA: expected bool, got 'maybe'"):
        load_cfg(None, ["OPTIM.MTA", "maybe"])
