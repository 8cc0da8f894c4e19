"""The recipe files against the references' own values.

Each reference value below is written from its source (an argument default of
facebookresearch/deit main.py, a command line of its README_revenge.md, timm's
behaviour that main.py calls, or the paper's table; pycls's config files; big_vision's
vit_i1k.py and the code it calls), in the units the reference uses, and converted here
by the rule the config's key documents (a min lr as a fraction of BASE_LR, a warm-up
start as a factor, warm-up steps as epochs, an eval crop ratio as a resize size). A
recipe file that drifts from its reference fails with the key and the source. Files
that are not recipes are named, with the reason (NOT_RECIPES, VIT_NOT_RECIPES).
"""

import os

import pytest
import torch

from pycls_fast.components.optimizer import construct_optimizer, lr_at, set_lr
from pycls_fast.config import load_cfg
from tests.helpers import EXACT, ROOT

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

# AugReg ViT-B/16 ("How to train your ViT?", arXiv 2106.10270): google-research/
# big_vision at commit 8921d51, configs/vit_i1k.py with variant=B/16 (its aug setting
# 'medium2'), and what the code it calls does with the values: optax.py (the update
# chain), utils.py (schedule, mixup), pp/ (crop, normalization), models/vit.py.
_BV = "big_vision 8921d51 "
_BV_LR, _BV_BATCH, _BV_WD = 1e-3, 4096, 1e-4  # vit_i1k.py: lr, input.batch_size, wd
# utils.steps: an epoch is data_size / batch_size steps; data_size is train[:99%] of
# ImageNet-1k's 1,281,167 images (the last 1% is its minival).
_BV_STEPS_PER_EPOCH = round(0.99 * 1_281_167) / _BV_BATCH
_BV_WEIGHT_DECAY = "optax.py wd_mults '.*/kernel$': weight matrices only"
AUGREG = {
    "OPTIM.OPTIMIZER": ("adamw", _BV + "optax_name scale_by_adam + decoupled wd"),
    "OPTIM.BASE_LR": (_BV_LR, _BV + "vit_i1k.py lr 0.001 (no batch scaling)"),
    "OPTIM.LR_POLICY": ("cos", _BV + "schedule decay_type 'cosine'"),
    "OPTIM.LR_PER_ITER": (True, _BV + "utils.py: the schedule is per step"),
    "OPTIM.MIN_LR": (0.0, _BV + "utils.py: the cosine ends at 0"),
    # OPTIM.WARMUP_EPOCHS is an integer: 10,000 steps are 32.3 epochs.
    "OPTIM.WARMUP_EPOCHS": (
        round(10_000 / _BV_STEPS_PER_EPOCH),
        _BV + "warmup_steps=10_000, in epochs",
    ),
    "OPTIM.WARMUP_FACTOR": (0.0, _BV + "utils.py: lr x min(1, step / warmup)"),
    "OPTIM.MAX_EPOCH": (300, _BV + "vit_i1k.py total_epochs 300"),
    # optax.py adds wd x param to the update before the schedule, not times lr;
    # torch's AdamW decays by lr x weight_decay, lr being BASE_LR x the schedule.
    "OPTIM.WEIGHT_DECAY": (_BV_WD / _BV_LR, _BV + "vit_i1k.py wd 0.0001 / lr"),
    "OPTIM.BETA1": (0.9, _BV + "optax.scale_by_adam default b1"),
    "OPTIM.BETA2": (0.999, _BV + "optax.scale_by_adam default b2"),
    "OPTIM.GRAD_CLIP": (1.0, _BV + "vit_i1k.py grad_clip_norm 1.0"),
    "OPTIM.EMA_ALPHA": (0.0, _BV + "train.py keeps no EMA"),
    "OPTIM.LAYER_DECAY": (1.0, _BV + "vit_i1k.py: no lr_mults"),
    "OPTIM.NO_DECAY_TOKENS": (True, _BV + _BV_WEIGHT_DECAY),
    "OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY": (True, _BV + _BV_WEIGHT_DECAY),
    "OPTIM.BIAS_CUSTOM_WEIGHT_DECAY": (0.0, _BV + _BV_WEIGHT_DECAY),
    "LN.USE_CUSTOM_WEIGHT_DECAY": (True, _BV + _BV_WEIGHT_DECAY),
    "LN.CUSTOM_WEIGHT_DECAY": (0.0, _BV + _BV_WEIGHT_DECAY),
    "LN.EPS": (1e-6, _BV + "models/vit.py: flax nn.LayerNorm's default"),
    "VIT.PATCH_SIZE": (16, _BV + "variant B/16"),
    "VIT.HIDDEN_DIM": (768, _BV + "models/vit.py decode_variant('B')"),
    "VIT.NUM_LAYERS": (12, _BV + "models/vit.py decode_variant('B')"),
    "VIT.NUM_HEADS": (12, _BV + "models/vit.py decode_variant('B')"),
    "VIT.MLP_DIM": (3072, _BV + "models/vit.py decode_variant('B')"),
    "VIT.CLASSIFIER_TYPE": ("token", _BV + "vit_i1k.py pool_type 'tok'"),
    "VIT.DROP_PATH": (0.0, _BV + "models/vit.py: no stochastic depth"),
    "VIT.LAYER_SCALE": (0.0, _BV + "models/vit.py: no LayerScale"),
    "TRAIN.IM_SIZE": (224, _BV + "decode_jpeg_and_inception_crop(224)"),
    "TRAIN.BATCH_SIZE": (_BV_BATCH, _BV + "vit_i1k.py input.batch_size 4096"),
    "TRAIN.LOSS": ("ce", _BV + "vit_i1k.py loss 'softmax_xent'"),
    "TRAIN.LABEL_SMOOTHING": (0.0, _BV + "onehot labels"),
    "TRAIN.MIXUP_ALPHA": (0.5, _BV + "MIXUP_DEF medium2 p=0.5: Beta(p, p) per batch"),
    "TRAIN.CUTMIX_ALPHA": (0.0, _BV + "no CutMix"),
    # TF RandAugment: N ops, each applied, magnitude M on the same 0-10 scale as
    # timm's, unclipped (timm clips at 10 unless mmax says otherwise).
    "TRAIN.AUGMENT": ("rand-m15-n2-mmax15-p1.0", _BV + "RANDAUG_DEF randaug(2,15)"),
    "TRAIN.PCA_STD": (0.0, _BV + "no PCA lighting"),
    "TRAIN.COLOR_JITTER": (0.0, _BV + "no colour jitter"),
    "TRAIN.THREE_AUGMENT": (False, _BV + "no 3-Augment"),
    "TRAIN.RANDOM_ERASE": (0.0, _BV + "no random erasing"),
    "TRAIN.REPEATED_AUG": (1, _BV + "no repeated augmentation"),
    "DATA.TRAIN_CROP": ("random_resized", _BV + "inception crop"),
    "DATA.CROP_SCALE": ([0.05, 1.0], _BV + "ops_image.py area_min=5, area_max=100"),
    "DATA.HFLIP": (0.5, _BV + "flip_lr"),
    "DATA.MEAN": ([0.5, 0.5, 0.5], _BV + "value_range(-1, 1)"),
    "DATA.STD": ([0.5, 0.5, 0.5], _BV + "value_range(-1, 1)"),
    "TEST.IM_SIZE": (256, _BV + "resize_small(256)|central_crop(224)"),
}
AUGREG_REFERENCES = {"ViT-B-16.yaml": AUGREG}

# configs/vit/: the model sizes of the speed ladder, not accuracy recipes. Their
# training keys are facebookresearch/pycls main's configs/fsdp/example.yaml (commit
# 0a97464, a ViT-H/16 with the pooled classifier and MTA), key for key, except the
# batch sizes (1024 here, 256 there) and the layout keys (NUM_GPUS, FSDP, PARALLEL:
# plan_net's choice, test_shipped_layouts); the dimensions are the papers'
# (test_config's PUBLISHED).
_FSDP_SRC = "pycls main 0a97464 configs/fsdp/example.yaml"
VIT_SPEED = {
    key: (value, _FSDP_SRC)
    for key, value in {
        "MODEL.NUM_CLASSES": 1000, "VIT.STEM_TYPE": "patchify",
        "VIT.CLASSIFIER_TYPE": "pooled", "OPTIM.OPTIMIZER": "adamw",
        "OPTIM.LR_POLICY": "cos", "OPTIM.BASE_LR": 0.001, "OPTIM.MIN_LR": 0.005,
        "OPTIM.MAX_EPOCH": 100, "OPTIM.WEIGHT_DECAY": 0.24, "OPTIM.WARMUP_EPOCHS": 5,
        "OPTIM.EMA_ALPHA": 1e-5, "OPTIM.EMA_UPDATE_PERIOD": 32, "OPTIM.MTA": True,
        "OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY": True,
        "OPTIM.BIAS_CUSTOM_WEIGHT_DECAY": 0.0, "LN.EPS": 1e-6,
        "LN.USE_CUSTOM_WEIGHT_DECAY": True, "LN.CUSTOM_WEIGHT_DECAY": 0.0,
        "TRAIN.DATASET": "imagenet", "TRAIN.IM_SIZE": 224, "TRAIN.MIXUP_ALPHA": 0.8,
        "TRAIN.CUTMIX_ALPHA": 1.0, "TRAIN.LABEL_SMOOTHING": 0.1,
        "TRAIN.AUGMENT": "AutoAugment", "TRAIN.MIXED_PRECISION": True,
        "TEST.DATASET": "imagenet", "TEST.IM_SIZE": 224, "DATA_LOADER.NUM_WORKERS": 10,
        "LOG_PERIOD": 100,
    }.items()
}  # fmt: skip
# Not recipes: every file of configs/vit/ (the reason above), named so that a new
# file there has to say what it is.
VIT_NOT_RECIPES = {
    f"ViT-{size}.yaml"
    for size in ("Ti-16", "S-16", "B-16", "L-16", "H-16", "H-14",
                 "g-14", "G-14", "e-14", "22B-14")
}  # fmt: skip


def _get(cfg, key):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


@pytest.mark.parametrize(
    "folder, listed",
    [
        ("configs/deit", {*REFERENCES, *NOT_RECIPES}),
        ("configs/pycls", set(PYCLS_REFERENCES)),
        ("configs/augreg", set(AUGREG_REFERENCES)),
        ("configs/vit", VIT_NOT_RECIPES),  # speed configs, not recipes
    ],
)
def test_every_config_of_a_recipe_folder_is_listed(folder, listed):
    """A new file in a recipe folder fails until its reference (or its reason for
    having none) is in the tables above."""
    assert set(os.listdir(os.path.join(ROOT, folder))) == listed


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


@pytest.mark.parametrize("name", sorted(PYCLS_REFERENCES))
def test_pycls_recipe_matches_pycls(name):
    _check("configs/pycls", name, PYCLS_REFERENCES[name])
    with open(os.path.join(ROOT, "configs/pycls", name)) as f:
        assert "Source: facebookresearch/pycls, branch vitconfigs" in f.read()


def _uncited(folder, name, table):
    """The keys of `table` that the file sets on a line without a comment."""
    section, uncited = None, []
    with open(os.path.join(ROOT, folder, name)) as f:
        for line in f:
            if line[:1].isalpha():
                section = line.split(":")[0]
            elif line.startswith("  ") and ":" in line:
                key = f"{section}.{line.split(':')[0].strip()}"
                if key in table and "#" not in line:
                    uncited.append(key)
    return uncited


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_recipe_cites_its_sources(name):
    """The header names the source, and every key the reference table checks that
    the file sets carries its source in a comment on its line (the keys the file
    leaves out take pycls_fast's defaults, which the table checks too)."""
    with open(os.path.join(ROOT, "configs/deit", name)) as f:
        text = f.read()
    header = text.split("\nDESC:")[0]
    assert "facebookresearch/deit" in header
    assert _uncited("configs/deit", name, REFERENCES[name]) == []


@pytest.mark.parametrize("name", sorted(AUGREG_REFERENCES))
def test_augreg_recipe_matches_big_vision(name):
    _check("configs/augreg", name, AUGREG_REFERENCES[name])
    with open(os.path.join(ROOT, "configs/augreg", name)) as f:
        header = f.read().split("\nDESC:")[0]
    assert "google-research/big_vision" in header and "commit 8921d51" in header
    assert _uncited("configs/augreg", name, AUGREG_REFERENCES[name]) == []


@pytest.mark.parametrize("name", sorted(VIT_NOT_RECIPES))
def test_vit_speed_config_keeps_pyclss_fsdp_example(name):
    """Not a recipe, but its training keys are its source's, and it says so."""
    _check("configs/vit", name, VIT_SPEED)
    with open(os.path.join(ROOT, "configs/vit", name)) as f:
        header = f.read().split("\nDESC:")[0]
    assert "not an accuracy recipe" in header
    assert "configs/fsdp/example.yaml (commit 0a97464" in header


def test_augreg_weight_decay_is_big_visions():
    """big_vision's update (optax.py at 8921d51: scale_by_adam, scale(lr),
    additive_weight_decay(wd), scale_by_schedule(s), scale(-1)) decays by s x wd,
    not lr x s x wd; torch's AdamW at lr = BASE_LR x s with the file's WEIGHT_DECAY
    (wd / lr) takes the same steps. Steps at the file's own schedule values."""
    cfg = load_cfg(
        os.path.join(ROOT, "configs/augreg/ViT-B-16.yaml"), ["OPTIM.MTA", "False"]
    )
    o = cfg.OPTIM
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(5, 3, dtype=torch.float64, generator=gen)
    grads = [torch.randn(5, 3, dtype=torch.float64, generator=gen) for _ in range(4)]
    ours = start.clone().requires_grad_()
    opt = construct_optimizer(
        [{"params": [ours], "weight_decay": o.WEIGHT_DECAY, "lr_scale": 1.0}], cfg
    )
    theirs, mu, nu = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    b1, b2, eps = 0.9, 0.999, 1e-8  # optax.scale_by_adam's defaults
    for t, (epoch, g) in enumerate(zip((1.0, 20.0, 150.0, 290.0), grads), 1):
        lr = lr_at(cfg, epoch)
        set_lr(opt, lr)
        ours.grad = g.clone()
        opt.step()
        mu, nu = b1 * mu + (1 - b1) * g, b2 * nu + (1 - b2) * g * g
        adam = (mu / (1 - b1**t)) / ((nu / (1 - b2**t)).sqrt() + eps)
        s = lr / _BV_LR  # the schedule's value at this step
        theirs = theirs - s * (_BV_LR * adam + _BV_WD * theirs)
    torch.testing.assert_close(ours.detach(), theirs, **EXACT)
