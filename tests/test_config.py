"""Config: pycls compatibility, merging, validation, dump, docs."""

import glob
import os

import pytest
import yaml

from pycls_fast.config import (
    ConfigError,
    _flat_keys,
    dump_cfg,
    get_cfg,
    load_cfg,
)

from .conftest import ROOT

PYCLS_VIT = os.path.join(ROOT, "tests", "data", "pycls_vit_p_4gf.yaml")


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
    assert cfg.LAUNCH.PARTITION == "learnlab"
    assert cfg.NUM_GPUS == 32


def test_every_pycls_schema_key_is_accepted():
    # The union of the keys of pycls's config schema across its releases.
    pycls_keys = [
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
    ours = set(_flat_keys(get_cfg()))
    assert [k for k in pycls_keys if k not in ours] == []


def test_deprecated_pycls_keys_are_ignored(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("PREC_TIME:\n  ENABLED: True\n  BATCH_SIZE: 128\n")
    cfg = load_cfg(str(path))
    assert "ENABLED" not in cfg.PREC_TIME


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(ROOT, "configs/*/*.yaml")))
)
def test_shipped_configs_load(path):
    cfg = load_cfg(path)
    assert cfg.MODEL.TYPE == "vit"
    assert cfg.DESC


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
        (["OPTIM.STEPS", "[5, 10]"], "OPTIM.STEPS must start at 0"),
        (["NUM_GPUS", "3"], "TRAIN.BATCH_SIZE (128) must be divisible by NUM_GPUS"),
        (["AMP.MODE", "fp32", "TRAIN.MIXED_PRECISION", "True"], "AMP.MODE is 'fp32'"),
        (["MODEL.TYPE", "resnet"], "MODEL.TYPE must be one of ['vit']"),
        (["VIT.PATCH_SIZE"], "KEY VALUE pairs"),
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
    bad.write_text("VIT: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_cfg(str(bad))
    typo = tmp_path / "typo.yaml"
    typo.write_text("TRAIN:\n  BATCHSIZE: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'TRAIN.BATCH_SIZE'"):
        load_cfg(str(typo))


def test_dump_round_trip(tmp_path):
    cfg = load_cfg(PYCLS_VIT, ["OUT_DIR", str(tmp_path)])
    path = dump_cfg(cfg)
    assert path == str(tmp_path / "config.yaml")
    again = load_cfg(path)
    assert again == cfg
    with open(path) as f:
        assert yaml.safe_load(f)["VIT"]["MLP_DIM"] == 1152
