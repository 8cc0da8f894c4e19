"""The recipe files against the references' own values.

Each reference value below is written from its source (an argument default of
facebookresearch/deit main.py, a command line of its README_revenge.md, timm's
behaviour that main.py calls, or the paper's table), in the units the reference uses,
and converted here by the rule the config's key documents (a min lr as a fraction of
BASE_LR, a warm-up start as a factor, an eval crop ratio as a resize size). A recipe
file that drifts from its reference fails with the key and the source.
"""

import os

import pytest

from pycls_fast.config import load_cfg
from tests.helpers import ROOT

# DeiT (ICML 2021), facebookresearch/deit main.py defaults: the same for Ti, S, B.
_DEIT_LR, _DEIT_BATCH = 5e-4, 1024  # --lr 5e-4; Table 9: batch 1024
_DEIT_BASE_LR = _DEIT_LR * _DEIT_BATCH / 512  # main.py: linear_scaled_lr
DEIT = {
    "OPTIM.OPTIMIZER": ("adamw", "main.py --opt adamw"),
    "OPTIM.BASE_LR": (_DEIT_BASE_LR, "main.py --lr 5e-4 x batch / 512"),
    "OPTIM.MIN_LR": (1e-5 / _DEIT_BASE_LR, "main.py --min-lr 1e-5"),
    "OPTIM.WARMUP_EPOCHS": (5, "main.py --warmup-epochs 5"),
    "OPTIM.WARMUP_FACTOR": (1e-6 / _DEIT_BASE_LR, "main.py --warmup-lr 1e-6"),
    "OPTIM.MAX_EPOCH": (300, "main.py --epochs 300"),
    "OPTIM.LR_POLICY": ("cos", "main.py --sched cosine"),
    "OPTIM.LR_PER_ITER": (False, "main.py lr_scheduler.step(epoch)"),
    "OPTIM.WEIGHT_DECAY": (0.05, "main.py --weight-decay 0.05"),
    "OPTIM.BETA1": (0.9, "torch AdamW default (--opt-betas None)"),
    "OPTIM.BETA2": (0.999, "torch AdamW default (--opt-betas None)"),
    "OPTIM.GRAD_CLIP": (0.0, "main.py --clip-grad None"),
    "OPTIM.NO_DECAY_TOKENS": (True, "timm create_optimizer: no_weight_decay()"),
    "OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY": (True, "timm: 1-D parameters undecayed"),
    "OPTIM.BIAS_CUSTOM_WEIGHT_DECAY": (0.0, "timm: 1-D parameters undecayed"),
    "LN.USE_CUSTOM_WEIGHT_DECAY": (True, "timm: 1-D parameters undecayed"),
    "LN.CUSTOM_WEIGHT_DECAY": (0.0, "timm: 1-D parameters undecayed"),
    "LN.EPS": (1e-6, "timm VisionTransformer norm_layer eps"),
    "VIT.DROP_PATH": (0.1, "main.py --drop-path 0.1"),
    "VIT.CLASSIFIER_TYPE": ("token", "DeiT: class token"),
    "VIT.LAYER_SCALE": (0.0, "DeiT: no LayerScale"),
    "TRAIN.IM_SIZE": (224, "main.py --input-size 224"),
    "TRAIN.BATCH_SIZE": (_DEIT_BATCH, "Table 9: batch 1024"),
    "TRAIN.LABEL_SMOOTHING": (0.1, "main.py --smoothing 0.1"),
    "TRAIN.MIXUP_ALPHA": (0.8, "main.py --mixup 0.8"),
    "TRAIN.CUTMIX_ALPHA": (1.0, "main.py --cutmix 1.0"),
    "TRAIN.AUGMENT": ("rand-m9-mstd0.5-inc1", "main.py --aa"),
    "TRAIN.AUGMENT_INTERPOLATION": ("bicubic", "main.py --train-interpolation"),
    "TRAIN.COLOR_JITTER": (0.0, "timm: colour jitter off with --aa"),
    "TRAIN.THREE_AUGMENT": (False, "DeiT: no 3-Augment"),
    "TRAIN.PCA_STD": (0.0, "timm: no PCA lighting"),
    "TRAIN.RANDOM_ERASE": (0.25, "main.py --reprob 0.25"),
    "TRAIN.RANDOM_ERASE_MODE": ("pixel", "main.py --remode pixel"),
    "TRAIN.RANDOM_ERASE_COUNT": (1, "main.py --recount 1"),
    "TRAIN.REPEATED_AUG": (3, "main.py --repeated-aug (RASampler, 3)"),
    "TRAIN.LOSS": ("ce", "main.py SoftTargetCrossEntropy"),
    "TEST.IM_SIZE": (int(224 / 0.875), "eval crop ratio 0.875"),
}
DEIT_DIMS = {  # timm deit_{tiny,small,base}_patch16_224
    "ti": (192, 3, 768),
    "s": (384, 6, 1536),
    "b": (768, 12, 3072),
}


def _deit3(lr, batch, im_size, drop_path, **extra):
    """README_revenge.md's ImageNet-1k pre-training command: --unscale-lr (the rate
    as given), --min-lr default 1e-5, --warmup-lr 1e-6, LAMB, BCE, 3-Augment."""
    return {
        "OPTIM.OPTIMIZER": ("lamb", "--opt fusedlamb (LAMB)"),
        "OPTIM.BASE_LR": (lr, "--lr with --unscale-lr"),
        "OPTIM.MIN_LR": (1e-5 / lr, "--min-lr default 1e-5"),
        "OPTIM.WARMUP_EPOCHS": (5, "--warmup-epochs 5"),
        "OPTIM.WARMUP_FACTOR": (1e-6 / lr, "--warmup-lr 1e-6"),
        "OPTIM.MAX_EPOCH": (800, "--epochs 800"),
        "OPTIM.LR_POLICY": ("cos", "--sched cosine"),
        "OPTIM.LR_PER_ITER": (False, "main.py lr_scheduler.step(epoch)"),
        "OPTIM.WEIGHT_DECAY": (0.05, "--weight-decay 0.05"),
        "OPTIM.NO_DECAY_TOKENS": (True, "timm create_optimizer: no_weight_decay()"),
        "LN.CUSTOM_WEIGHT_DECAY": (0.0, "timm: 1-D parameters undecayed"),
        "OPTIM.BIAS_CUSTOM_WEIGHT_DECAY": (0.0, "timm: 1-D parameters undecayed"),
        "VIT.DROP_PATH": (drop_path, "--drop-path"),
        "VIT.LAYER_SCALE": (1e-4, "models_v2.py Layer_scale_init_Block"),
        "TRAIN.IM_SIZE": (im_size, "--input-size"),
        "TRAIN.BATCH_SIZE": (batch, "--batch x 8 GPUs"),
        "TRAIN.LABEL_SMOOTHING": (0.0, "--smoothing 0.0"),
        "TRAIN.MIXUP_ALPHA": (0.8, "--mixup .8"),
        "TRAIN.CUTMIX_ALPHA": (1.0, "--cutmix 1.0"),
        "TRAIN.THREE_AUGMENT": (True, "--ThreeAugment"),
        "TRAIN.COLOR_JITTER": (0.3, "--color-jitter 0.3"),
        "TRAIN.AUGMENT": ("", "no --aa with --ThreeAugment"),
        "TRAIN.RANDOM_ERASE": (0.0, "--reprob 0.0"),
        "TRAIN.REPEATED_AUG": (3, "--repeated-aug"),
        "TRAIN.LOSS": ("bce", "--bce-loss"),
        "TRAIN.BCE_BINARY_TARGETS": (True, "engine.py: targets.gt(0.0)"),
        # 3-Augment's simple random crop is the ImageNet-21k commands' --src only.
        "DATA.TRAIN_CROP": ("random_resized", "no --src: RandomResizedCrop"),
        "TEST.IM_SIZE": (int(im_size / 0.875), "eval crop ratio 0.875"),
        **extra,
    }


def _deit3_ft(im_size, drop_path):
    """README_revenge.md's fine-tuning commands: AdamW, lr 1e-5, 20 epochs, batch
    64 x 8, RandAugment, label smoothing, no repeated augmentation."""
    return {
        "OPTIM.OPTIMIZER": ("adamw", "--opt adamw"),
        "OPTIM.BASE_LR": (1e-5, "--lr 1e-5 with --unscale-lr"),
        "OPTIM.WARMUP_EPOCHS": (5, "--warmup-epochs 5"),
        "OPTIM.WARMUP_FACTOR": (1e-6 / 1e-5, "--warmup-lr 1e-6"),
        "OPTIM.MAX_EPOCH": (20, "--epochs 20"),
        "OPTIM.WEIGHT_DECAY": (0.1, "--weight-decay 0.1"),
        "OPTIM.LR_PER_ITER": (False, "main.py lr_scheduler.step(epoch)"),
        "OPTIM.NO_DECAY_TOKENS": (True, "timm create_optimizer: no_weight_decay()"),
        "VIT.DROP_PATH": (drop_path, "--drop-path"),
        "TRAIN.IM_SIZE": (im_size, "--input-size"),
        "TRAIN.BATCH_SIZE": (512, "--batch 64 x 8 GPUs"),
        "TRAIN.LABEL_SMOOTHING": (0.1, "--smoothing 0.1"),
        "TRAIN.MIXUP_ALPHA": (0.8, "--mixup .8"),
        "TRAIN.CUTMIX_ALPHA": (1.0, "--cutmix 1.0"),
        "TRAIN.AUGMENT": ("rand-m9-mstd0.5-inc1", "--aa rand-m9-mstd0.5-inc1"),
        "TRAIN.AUGMENT_INTERPOLATION": ("bicubic", "--train-interpolation default"),
        "TRAIN.RANDOM_ERASE": (0.0, "--reprob 0.0"),
        "TRAIN.REPEATED_AUG": (1, "--no-repeated-aug"),
        "TRAIN.LOSS": ("ce", "no --bce-loss"),
        "TEST.IM_SIZE": (int(im_size / 0.875), "eval crop ratio 0.875"),
    }


REFERENCES = {
    **{
        f"deit_{size}.yaml": {
            **DEIT,
            "VIT.HIDDEN_DIM": (dims[0], "timm deit model"),
            "VIT.NUM_HEADS": (dims[1], "timm deit model"),
            "VIT.MLP_DIM": (dims[2], "timm deit model"),
        }
        for size, dims in DEIT_DIMS.items()
    },
    "deit3_s.yaml": _deit3(4e-3, 2048, 224, 0.05),
    "deit3_b.yaml": _deit3(3e-3, 2048, 192, 0.2),
    "deit3_b_ft224.yaml": _deit3_ft(224, 0.2),
    "deit3_s_ft384.yaml": _deit3_ft(384, 0.0),
}
# Not a paper recipe: the digits demo of distillation (docs/RECIPES.md).
NOT_RECIPES = {"deit_s_digits_distill.yaml"}

# pycls's ViT-P / ViT-C ("Early Convolutions Help Transformers See Better"):
# facebookresearch/pycls, branch vitconfigs, configs/vitconv_baselines/vit/*.yaml.
_PYCLS_SRC = "pycls vitconfigs configs/vitconv_baselines/vit/"
_PYCLS_COMMON = {
    "OPTIM.OPTIMIZER": "adamw", "OPTIM.LR_POLICY": "cos", "OPTIM.MIN_LR": 0.005,
    "OPTIM.MAX_EPOCH": 400, "OPTIM.WEIGHT_DECAY": 0.24, "OPTIM.WARMUP_EPOCHS": 5,
    "OPTIM.EMA_ALPHA": 1e-5, "OPTIM.EMA_UPDATE_PERIOD": 32,
    "OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY": True, "OPTIM.BIAS_CUSTOM_WEIGHT_DECAY": 0.0,
    "LN.EPS": 1e-6, "LN.USE_CUSTOM_WEIGHT_DECAY": True, "LN.CUSTOM_WEIGHT_DECAY": 0.0,
    "TRAIN.IM_SIZE": 224, "TRAIN.BATCH_SIZE": 2048, "TRAIN.MIXED_PRECISION": True,
    "TRAIN.MIXUP_ALPHA": 0.8, "TRAIN.CUTMIX_ALPHA": 1.0, "TRAIN.LABEL_SMOOTHING": 0.1,
    "TRAIN.AUGMENT": "AutoAugment", "TEST.IM_SIZE": 256, "TEST.BATCH_SIZE": 2048,
    "VIT.PATCH_SIZE": 16, "VIT.CLASSIFIER_TYPE": "token",
}  # fmt: skip
_CONV_BN = {"BN.USE_CUSTOM_WEIGHT_DECAY": True, "BN.CUSTOM_WEIGHT_DECAY": 0.0}
_C_SMALL = {
    "VIT.C_STEM_KERNELS": [3, 3, 3, 3, 1],
    "VIT.C_STEM_STRIDES": [2, 2, 2, 2, 1],
}
_C_BIG = {
    "VIT.C_STEM_KERNELS": [3, 3, 3, 3, 3, 3, 1],
    "VIT.C_STEM_STRIDES": [2, 2, 1, 2, 1, 2, 1],
}
# ours: (their file, {key: value} beyond the common ones)
_PYCLS = {
    "ViT-P-1GF": ("ViT-P-1.0GF_adamw_8gpus", {
        "VIT.STEM_TYPE": "patchify", "VIT.NUM_LAYERS": 12, "VIT.NUM_HEADS": 3,
        "VIT.HIDDEN_DIM": 192, "VIT.MLP_DIM": 576, "OPTIM.BASE_LR": 0.001,
        "NUM_GPUS": 8}),
    "ViT-P-4GF": ("ViT-P-4.0GF_adamw_8gpus", {
        "VIT.STEM_TYPE": "patchify", "VIT.NUM_LAYERS": 12, "VIT.NUM_HEADS": 6,
        "VIT.HIDDEN_DIM": 384, "VIT.MLP_DIM": 1152, "OPTIM.BASE_LR": 0.001,
        "NUM_GPUS": 8}),
    "ViT-P-18GF": ("ViT-P-18GF_adamw_16gpus", {
        "VIT.STEM_TYPE": "patchify", "VIT.NUM_LAYERS": 12, "VIT.NUM_HEADS": 12,
        "VIT.HIDDEN_DIM": 768, "VIT.MLP_DIM": 3072, "OPTIM.BASE_LR": 0.001,
        "NUM_GPUS": 16}),
    "ViT-P-36GF": ("ViT-P-36GF_adamw_32gpus", {
        "VIT.STEM_TYPE": "patchify", "VIT.NUM_LAYERS": 14, "VIT.NUM_HEADS": 16,
        "VIT.HIDDEN_DIM": 1024, "VIT.MLP_DIM": 4096, "OPTIM.BASE_LR": 0.0007,
        "NUM_GPUS": 32}),
    "ViT-C-1GF": ("ViT-C-1.0GF_adamw_8gpus", {
        "VIT.STEM_TYPE": "conv", **_C_SMALL, "VIT.C_STEM_DIMS": [24, 48, 96, 192, 192],
        "VIT.NUM_LAYERS": 11, "VIT.NUM_HEADS": 3, "VIT.HIDDEN_DIM": 192,
        "VIT.MLP_DIM": 576, "OPTIM.BASE_LR": 0.001, "NUM_GPUS": 8, **_CONV_BN}),
    "ViT-C-4GF": ("ViT-C-4.0GF_adamw_8gpus", {
        "VIT.STEM_TYPE": "conv", **_C_SMALL, "VIT.C_STEM_DIMS": [48, 96, 192, 384, 384],
        "VIT.NUM_LAYERS": 11, "VIT.NUM_HEADS": 6, "VIT.HIDDEN_DIM": 384,
        "VIT.MLP_DIM": 1152, "OPTIM.BASE_LR": 0.001, "NUM_GPUS": 8, **_CONV_BN}),
    "ViT-C-18GF": ("ViT-C-18GF_adamw_16gpus", {
        "VIT.STEM_TYPE": "conv", **_C_BIG,
        "VIT.C_STEM_DIMS": [64, 128, 128, 256, 256, 512, 768], "VIT.NUM_LAYERS": 11,
        "VIT.NUM_HEADS": 12, "VIT.HIDDEN_DIM": 768, "VIT.MLP_DIM": 3072,
        "OPTIM.BASE_LR": 0.001, "NUM_GPUS": 16, **_CONV_BN}),
    "ViT-C-36GF": ("ViT-C-36GF_adamw_32gpus", {
        "VIT.STEM_TYPE": "conv", **_C_BIG,
        "VIT.C_STEM_DIMS": [64, 128, 128, 256, 256, 512, 1024], "VIT.NUM_LAYERS": 13,
        "VIT.NUM_HEADS": 16, "VIT.HIDDEN_DIM": 1024, "VIT.MLP_DIM": 4096,
        "OPTIM.BASE_LR": 0.0007, "NUM_GPUS": 32, **_CONV_BN}),
}  # fmt: skip
PYCLS_REFERENCES = {
    f"{ours}.yaml": {
        key: (value, _PYCLS_SRC + theirs + ".yaml")
        for key, value in {**_PYCLS_COMMON, **specific}.items()
    }
    for ours, (theirs, specific) in _PYCLS.items()
}


def _get(cfg, key):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def test_every_deit_config_has_a_reference():
    files = set(os.listdir(os.path.join(ROOT, "configs/deit")))
    assert files - NOT_RECIPES == set(REFERENCES)


def _check(folder, name, table):
    cfg = load_cfg(os.path.join(ROOT, folder, name), [])
    wrong = []
    for key, (want, source) in table.items():
        got = _get(cfg, key)
        same = (
            abs(got - want) <= 1e-3 * abs(want)  # 3 significant digits in the file
            if isinstance(want, float) and not isinstance(want, bool)
            else (list(got) if isinstance(want, list) else got) == want
        )
        if not same:
            wrong.append(f"{key}: {got!r}, reference {want!r} ({source})")
    assert wrong == []


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_recipe_matches_its_reference(name):
    _check("configs/deit", name, REFERENCES[name])


def test_every_pycls_config_has_a_reference():
    files = set(os.listdir(os.path.join(ROOT, "configs/pycls")))
    assert files == set(PYCLS_REFERENCES)


@pytest.mark.parametrize("name", sorted(PYCLS_REFERENCES))
def test_pycls_recipe_matches_pycls(name):
    _check("configs/pycls", name, PYCLS_REFERENCES[name])
    with open(os.path.join(ROOT, "configs/pycls", name)) as f:
        assert "Source: facebookresearch/pycls, branch vitconfigs" in f.read()


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_recipe_cites_its_sources(name):
    """The header names the source; every key the reference table checks is either
    commented on its line or covered by the header's sources."""
    with open(os.path.join(ROOT, "configs/deit", name)) as f:
        text = f.read()
    header = text.split("\n\n")[0] if text.startswith("#") else ""
    assert "facebookresearch/deit" in text.splitlines()[0] + header
