"""Configuration (yacs): defaults, load + merge + validate, dump.

Every key of pycls's config schema is accepted with pycls's meaning, so a pycls ViT
config file loads unchanged. Keys that are new to pycls_fast live in their own nodes
(AMP, DATA) or are marked "pycls_fast" in their comment. The comment above each key is
its documentation: docs/CONFIG.md is generated from it (tools/gen_config_doc.py).

Usage:
    cfg = load_cfg("configs/vit/ViT-B-16.yaml", ["OPTIM.BASE_LR", "0.001"])
    model = build_model(cfg)

There is no global config: `get_cfg()` returns a fresh copy of the defaults.
"""

import ast
import contextlib
import difflib
import os

import yaml
from yacs.config import CfgNode

from pycls_fast.errors import ConfigError

_C = CfgNode()


# ---------------------------------- Model options ----------------------------------- #
_C.MODEL = CfgNode()

# Model type (only 'vit' is implemented)
_C.MODEL.TYPE = "vit"

# Number of weight layers (pycls; unused by ViT, which reads VIT.NUM_LAYERS)
_C.MODEL.DEPTH = 0

# Number of classes
_C.MODEL.NUM_CLASSES = 1000

# Loss function ('cross_entropy'; label smoothing and mixup targets are handled by it)
_C.MODEL.LOSS_FUN = "cross_entropy"

# Activation function for conv layers (the conv stem uses relu, the MLP uses gelu)
_C.MODEL.ACTIVATION_FUN = "relu"

# Perform activation inplace if implemented
_C.MODEL.ACTIVATION_INPLACE = True

# Model scaling type (pycls; unused by ViT)
_C.MODEL.SCALING_TYPE = ""

# Model scaling factor (pycls; unused by ViT)
_C.MODEL.SCALING_FACTOR = 1.0


# ---------------------------------- ResNet options ---------------------------------- #
# pycls's CNN families: accepted so that pycls config files load, unused by ViT.
_C.RESNET = CfgNode()

# Transformation function (pycls; unused)
_C.RESNET.TRANS_FUN = "basic_transform"

# Number of groups (pycls; unused)
_C.RESNET.NUM_GROUPS = 1

# Width of each group (pycls; unused)
_C.RESNET.WIDTH_PER_GROUP = 64

# Apply stride to 1x1 conv (pycls; unused)
_C.RESNET.STRIDE_1X1 = True


# ---------------------------------- AnyNet options ---------------------------------- #
_C.ANYNET = CfgNode()

# Stem type (pycls; unused)
_C.ANYNET.STEM_TYPE = "simple_stem_in"

# Stem width (pycls; unused)
_C.ANYNET.STEM_W = 32

# Block type (pycls; unused)
_C.ANYNET.BLOCK_TYPE = "res_bottleneck_block"

# Depth for each stage (pycls; unused)
_C.ANYNET.DEPTHS = []

# Width for each stage (pycls; unused)
_C.ANYNET.WIDTHS = []

# Strides for each stage (pycls; unused)
_C.ANYNET.STRIDES = []

# Bottleneck multipliers for each stage (pycls; unused)
_C.ANYNET.BOT_MULS = []

# Group widths for each stage (pycls; unused)
_C.ANYNET.GROUP_WS = []

# Head width (pycls; unused)
_C.ANYNET.HEAD_W = 0

# Whether SE is enabled (pycls; unused)
_C.ANYNET.SE_ON = False

# SE ratio (pycls; unused)
_C.ANYNET.SE_R = 0.25


# ---------------------------------- RegNet options ---------------------------------- #
_C.REGNET = CfgNode()

# Stem type (pycls; unused)
_C.REGNET.STEM_TYPE = "simple_stem_in"

# Stem width (pycls; unused)
_C.REGNET.STEM_W = 32

# Block type (pycls; unused)
_C.REGNET.BLOCK_TYPE = "res_bottleneck_block"

# Stride of each stage (pycls; unused)
_C.REGNET.STRIDE = 2

# Squeeze-and-Excitation on (pycls; unused)
_C.REGNET.SE_ON = False

# Squeeze-and-Excitation ratio (pycls; unused)
_C.REGNET.SE_R = 0.25

# Depth (pycls; unused)
_C.REGNET.DEPTH = 10

# Initial width (pycls; unused)
_C.REGNET.W0 = 32

# Slope (pycls; unused)
_C.REGNET.WA = 5.0

# Quantization (pycls; unused)
_C.REGNET.WM = 2.5

# Group width (pycls; unused)
_C.REGNET.GROUP_W = 16

# Bottleneck multiplier (pycls; unused)
_C.REGNET.BOT_MUL = 1.0

# Head width (pycls; unused)
_C.REGNET.HEAD_W = 0


# ------------------------------- EfficientNet options ------------------------------- #
_C.EN = CfgNode()

# Stem width (pycls; unused)
_C.EN.STEM_W = 32

# Depth for each stage (pycls; unused)
_C.EN.DEPTHS = []

# Width for each stage (pycls; unused)
_C.EN.WIDTHS = []

# Expansion ratios for MBConv blocks (pycls; unused)
_C.EN.EXP_RATIOS = []

# Squeeze-and-Excitation ratio (pycls; unused)
_C.EN.SE_R = 0.25

# Strides for each stage (pycls; unused)
_C.EN.STRIDES = []

# Kernel sizes for each stage (pycls; unused)
_C.EN.KERNELS = []

# Head width (pycls; unused)
_C.EN.HEAD_W = 1280

# Drop connect ratio (pycls; unused)
_C.EN.DC_RATIO = 0.0

# Dropout ratio (pycls; unused)
_C.EN.DROPOUT_RATIO = 0.0


# ---------------------------- Vision Transformer options ---------------------------- #
_C.VIT = CfgNode()

# Patch size (TRAIN.IM_SIZE must be divisible by PATCH_SIZE)
_C.VIT.PATCH_SIZE = 16

# Type of stem, 'patchify' or 'conv' (https://arxiv.org/abs/2106.14881)
_C.VIT.STEM_TYPE = "patchify"

# Conv-stem kernel sizes; all but the last are 3x3 convs, the last is typically 1
_C.VIT.C_STEM_KERNELS = []

# Conv-stem strides (their product must equal PATCH_SIZE)
_C.VIT.C_STEM_STRIDES = []

# Conv-stem output widths (the last must equal HIDDEN_DIM)
_C.VIT.C_STEM_DIMS = []

# Number of encoder blocks
_C.VIT.NUM_LAYERS = 12

# Number of self-attention heads (HIDDEN_DIM must be divisible by it)
_C.VIT.NUM_HEADS = 12

# Hidden (token) width
_C.VIT.HIDDEN_DIM = 768

# Width of the MLP in each encoder block
_C.VIT.MLP_DIM = 3072

# Classifier: 'token' (class token) or 'pooled' (final LayerNorm, mean over tokens)
_C.VIT.CLASSIFIER_TYPE = "token"

# pycls_fast: token tensor layout inside the encoder, 'batch_second' (seq, batch,
# hidden) or 'batch_first' (batch, seq, hidden); both give identical outputs
_C.VIT.LAYOUT = "batch_second"

# pycls_fast: attention kernel, 'auto' (fastest measured for the device and dtype),
# 'sdpa' (torch scaled_dot_product_attention, backend picked by torch), 'sdpa_flash',
# 'sdpa_math', 'sdpa_efficient', 'sdpa_cudnn' (one SDPA backend) or 'explicit'
# (matmul, softmax, matmul)
_C.VIT.ATTENTION = "auto"

# pycls_fast: stochastic depth rate of the last block (linearly increasing from 0)
_C.VIT.DROP_PATH = 0.0


# -------------------------------- Batch norm options -------------------------------- #
_C.BN = CfgNode()

# BN epsilon (used by the conv stem)
_C.BN.EPS = 1e-5

# BN momentum (BN momentum in PyTorch = 1 - BN momentum in Caffe2)
_C.BN.MOM = 0.1

# Precise BN stats (pycls; ViT has no BN outside the conv stem)
_C.BN.USE_PRECISE_STATS = False

# Number of samples for precise BN stats
_C.BN.NUM_SAMPLES_PRECISE = 8192

# Initialize the gamma of the final BN of each block to zero (pycls; unused by ViT)
_C.BN.ZERO_INIT_FINAL_GAMMA = False

# Use a different weight decay for BN layers
_C.BN.USE_CUSTOM_WEIGHT_DECAY = False

# The weight decay for BN layers when USE_CUSTOM_WEIGHT_DECAY is on
_C.BN.CUSTOM_WEIGHT_DECAY = 0.0


# -------------------------------- Layer norm options -------------------------------- #
_C.LN = CfgNode()

# LayerNorm epsilon (timm's ViT uses 1e-6)
_C.LN.EPS = 1e-5

# Use a different weight decay for LN layers
_C.LN.USE_CUSTOM_WEIGHT_DECAY = False

# The weight decay for LN layers when USE_CUSTOM_WEIGHT_DECAY is on
_C.LN.CUSTOM_WEIGHT_DECAY = 0.0


# -------------------------------- Optimizer options --------------------------------- #
_C.OPTIM = CfgNode()

# Optimizer: 'sgd', 'adam', 'adamw' or 'lamb'
_C.OPTIM.OPTIMIZER = "sgd"

# Base learning rate
_C.OPTIM.BASE_LR = 0.1

# The learning rate decays from BASE_LR to MIN_LR * BASE_LR according to LR_POLICY
_C.OPTIM.MIN_LR = 0.0

# Learning rate policy: 'cos', 'exp', 'lin' or 'steps'
_C.OPTIM.LR_POLICY = "cos"

# Steps for the 'steps' policy, in epochs (the first must be 0)
_C.OPTIM.STEPS = []

# Learning rate multiplier for the 'steps' policy
_C.OPTIM.LR_MULT = 0.1

# Exponential decay factor (older pycls configs; 'exp' now decays to MIN_LR)
_C.OPTIM.GAMMA = 0.1

# Maximal number of epochs
_C.OPTIM.MAX_EPOCH = 200

# Momentum (sgd)
_C.OPTIM.MOMENTUM = 0.9

# Momentum dampening (sgd)
_C.OPTIM.DAMPENING = 0.0

# Nesterov momentum (sgd)
_C.OPTIM.NESTEROV = True

# Beta1 (adam, adamw, lamb)
_C.OPTIM.BETA1 = 0.9

# Beta2 (adam, adamw, lamb)
_C.OPTIM.BETA2 = 0.999

# Weight decay (L2 for sgd/adam, decoupled for adamw/lamb)
_C.OPTIM.WEIGHT_DECAY = 5e-4

# Use a different weight decay for all biases (excluding those in BN/LN layers)
_C.OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY = False

# The weight decay for biases when BIAS_USE_CUSTOM_WEIGHT_DECAY is on
_C.OPTIM.BIAS_CUSTOM_WEIGHT_DECAY = 0.0

# Start the warm up from BASE_LR * WARMUP_FACTOR
_C.OPTIM.WARMUP_FACTOR = 0.1

# Gradually warm up to BASE_LR over this number of epochs
_C.OPTIM.WARMUP_EPOCHS = 0

# Exponential moving average (EMA) of the weights, update value (0 turns EMA off)
_C.OPTIM.EMA_ALPHA = 1e-5

# Iteration period with which to update the EMA weights
_C.OPTIM.EMA_UPDATE_PERIOD = 32

# Multi-tensor-apply optimizer updates (torch foreach / fused) instead of a loop
_C.OPTIM.MTA = False

# pycls_fast: clip the global gradient norm to this value (0 turns clipping off)
_C.OPTIM.GRAD_CLIP = 0.0

# pycls_fast: update the learning rate every iteration (False: once per epoch, as pycls)
_C.OPTIM.LR_PER_ITER = True


# --------------------------------- Training options --------------------------------- #
_C.TRAIN = CfgNode()

# Dataset name (pycls; pycls_fast reads images from DATA.PATH)
_C.TRAIN.DATASET = "imagenet"

# Split (folder under DATA.PATH) to train on
_C.TRAIN.SPLIT = "train"

# Total mini-batch size, over all processes
_C.TRAIN.BATCH_SIZE = 128

# Training image size (random-resized-crop output; the model's input size)
_C.TRAIN.IM_SIZE = 224

# Evaluate the model every this many epochs
_C.TRAIN.EVAL_PERIOD = 1

# Save a checkpoint every this many epochs
_C.TRAIN.CHECKPOINT_PERIOD = 1

# pycls_fast: also save a checkpoint every this many iterations (0: only per epoch)
_C.TRAIN.CHECKPOINT_ITER_PERIOD = 0

# pycls_fast: keep only the newest this many checkpoints (epoch and iteration ones
# alike), deleting older ones after each save (0: keep all)
_C.TRAIN.CHECKPOINT_KEEP = 0

# pycls_fast: never delete the checkpoint of lowest test top-1 error (of the model,
# not the EMA); checkpoints/best.json names it with its epoch and top1_err
_C.TRAIN.CHECKPOINT_KEEP_BEST = False

# Resume training from the newest complete checkpoint in OUT_DIR
_C.TRAIN.AUTO_RESUME = True

# Weights to start training from
_C.TRAIN.WEIGHTS = ""

# Train with mixed precision (autocast, fp32 weights): AMP mode O1 unless AMP.MODE set
_C.TRAIN.MIXED_PRECISION = False

# Label smoothing value in 0 to 1 (0 gives no smoothing)
_C.TRAIN.LABEL_SMOOTHING = 0.0

# Batch mixup alpha (0 gives no mixup)
_C.TRAIN.MIXUP_ALPHA = 0.0

# Batch cutmix alpha (0 gives no cutmix)
_C.TRAIN.CUTMIX_ALPHA = 0.0

# Standard deviation of AlexNet-style PCA lighting jitter (0 gives none)
_C.TRAIN.PCA_STD = 0.1

# Data augmentation ('', 'AutoAugment', 'RandAugment_N2_M0.5', ...)
_C.TRAIN.AUGMENT = ""


# --------------------------------- Testing options ---------------------------------- #
_C.TEST = CfgNode()

# Dataset name (pycls; pycls_fast reads images from DATA.PATH)
_C.TEST.DATASET = "imagenet"

# Split (folder under DATA.PATH) to evaluate on
_C.TEST.SPLIT = "val"

# Total mini-batch size, over all processes
_C.TEST.BATCH_SIZE = 200

# Resize the shorter side to this size, then center-crop TRAIN.IM_SIZE (pycls)
_C.TEST.IM_SIZE = 256

# Weights to evaluate
_C.TEST.WEIGHTS = ""

# pycls_fast: evaluate the EMA weights of TEST.WEIGHTS when the checkpoint has them
_C.TEST.USE_EMA = False


# ----------------------------------- Data options ----------------------------------- #
# pycls_fast: where the images are.
_C.DATA = CfgNode()

# Dataset root: one folder per split (TRAIN.SPLIT, TEST.SPLIT), one folder per class
_C.DATA.PATH = ""

# pycls_fast: random-resized-crop area range, as fractions of the image (timm's scale)
_C.DATA.CROP_SCALE = [0.08, 1.0]

# pycls_fast: probability of a horizontal flip of a train image
_C.DATA.HFLIP = 0.5

# Cache each split's file index in OUT_DIR/data_index (rescanned when a folder changes)
_C.DATA.INDEX_CACHE = True


# ------------------------------- Data loader options -------------------------------- #
_C.DATA_LOADER = CfgNode()

# Number of decoding threads ('threads', 'spdl' modes) or worker processes ('processes')
_C.DATA_LOADER.NUM_WORKERS = 8

# Load data to pinned host memory (applies when training on a GPU)
_C.DATA_LOADER.PIN_MEMORY = True

# pycls_fast: 'threads' (in-process decoding threads), 'spdl' (the same in an
# spdl.pipeline) or 'processes' (torch DataLoader)
_C.DATA_LOADER.MODE = "threads"

# pycls_fast: abort when more than this fraction of images fail to decode
_C.DATA_LOADER.MAX_BAD_FRAC = 0.01

# pycls_fast: batches decoded or being decoded ahead of the training step, per process
# (at least one per worker plus one)
_C.DATA_LOADER.PREFETCH = 4

# pycls_fast: log decoding throughput, task time and queue occupancy every this many
# seconds ('threads' mode: logger pycls_fast.datasets.threaded; 'spdl' mode: logger
# spdl.pipeline; 0 turns it off)
_C.DATA_LOADER.STATS_PERIOD = 0.0


# ------------------------------ Mixed precision options ----------------------------- #
# pycls_fast: automatic mixed precision modes.
_C.AMP = CfgNode()

# '' (follow TRAIN.MIXED_PRECISION), 'fp32', 'O1' (autocast, fp32 weights), 'O2' (half
# weights, fp32 master weights in the optimizer), 'O3' (everything in half precision)
_C.AMP.MODE = ""

# Half-precision type: 'bf16' or 'fp16' (fp16 uses dynamic loss scaling)
_C.AMP.DTYPE = "bf16"

# Keep LayerNorm weights and compute in fp32 under O2
_C.AMP.LAYER_NORM_FP32 = True


# ---------------------------------- CUDNN options ----------------------------------- #
_C.CUDNN = CfgNode()

# Let cuDNN benchmark convolution algorithms (GPU only; best for fixed input sizes)
_C.CUDNN.BENCHMARK = True


# ---------------------------------- Memory options ---------------------------------- #
# Older pycls configs carry this node.
_C.MEM = CfgNode()

# Perform ReLU inplace (older pycls; see MODEL.ACTIVATION_INPLACE)
_C.MEM.RELU_INPLACE = True


# ------------------------------- Precise time options ------------------------------- #
_C.PREC_TIME = CfgNode()

# Number of iterations to warm up the caches before timing
_C.PREC_TIME.WARMUP_ITER = 3

# Number of iterations to average the time over
_C.PREC_TIME.NUM_ITER = 30


# ---------------------------------- Launch options ---------------------------------- #
# pycls's launcher keys; 'local' spawns NUM_GPUS processes, the SLURM keys are accepted
# and documented in docs/DISTRIBUTED.md (GPU cluster only).
_C.LAUNCH = CfgNode()

# Launch mode: 'local', 'slurm' or 'submitit_local'
_C.LAUNCH.MODE = "local"

# Maximum number of retries of a preempted SLURM job (GPU cluster only)
_C.LAUNCH.MAX_RETRY = 3

# SLURM job name (GPU cluster only)
_C.LAUNCH.NAME = "pycls_fast_job"

# SLURM job comment (GPU cluster only)
_C.LAUNCH.COMMENT = ""

# CPUs per GPU requested from SLURM (GPU cluster only)
_C.LAUNCH.CPUS_PER_GPU = 10

# Memory per GPU in GB requested from SLURM (GPU cluster only)
_C.LAUNCH.MEM_PER_GPU = 60

# SLURM partition (GPU cluster only)
_C.LAUNCH.PARTITION = "devlab"

# SLURM GPU type constraint (GPU cluster only)
_C.LAUNCH.GPU_TYPE = "volta"

# SLURM time limit in minutes (GPU cluster only)
_C.LAUNCH.TIME_LIMIT = 4200

# Email for SLURM notifications (GPU cluster only)
_C.LAUNCH.EMAIL = ""


# ----------------------------------- FSDP options ----------------------------------- #
_C.FSDP = CfgNode()

# Shard parameters, gradients and optimizer state across processes (torch fully_shard)
_C.FSDP.ENABLED = False

# Free the gathered parameters after forward (saves memory, costs communication)
_C.FSDP.RESHARD_AFTER_FW = True

# Keep LayerNorm parameters and compute in fp32 under mixed precision
_C.FSDP.LAYER_NORM_FP32 = True

# Older pycls FSDP key: the inverse of RESHARD_AFTER_FW (True overrides it)
_C.FSDP.DO_NOT_RESHARD_AFTER_FW = False

# Older pycls FSDP key: half-precision FSDP compute (the AMP mode decides in pycls_fast)
_C.FSDP.MIXED_PRECISION = False

# pycls_fast: recompute each encoder block's activations in backward (saves memory);
# also without FSDP
_C.FSDP.ACTIVATION_CHECKPOINT = False


# ------------------------------- Distributed options -------------------------------- #
# pycls_fast: multi-process runs (see docs/DISTRIBUTED.md).
_C.DIST = CfgNode()

# Seconds a collective may wait for the other ranks before the job stops with an error
# (a rank that died or hangs never stalls the others for longer)
_C.DIST.TIMEOUT_S = 600


# ----------------------------------- Misc options ----------------------------------- #
# Optional description of a config
_C.DESC = ""

# If True output additional info to the log
_C.VERBOSE = True

# Number of processes (devices) to use; outside torchrun, N local processes are spawned
_C.NUM_GPUS = 1

# Maximum number of GPUs per node (pycls; used to split NUM_GPUS across SLURM nodes)
_C.MAX_GPUS_PER_NODE = 8

# Output directory (logs, checkpoints, config.yaml)
_C.OUT_DIR = "/tmp/pycls_fast"

# Config destination (in OUT_DIR)
_C.CFG_DEST = "config.yaml"

# Random seed (CPU runs are deterministic; GPU kernels may not be)
_C.RNG_SEED = 1

# Log destination: 'stdout' (stdout and OUT_DIR/stdout.log) or 'file' (only the file)
_C.LOG_DEST = "stdout"

# Log period in iterations
_C.LOG_PERIOD = 10

# Distributed backend ('nccl' on GPUs; CPU runs always use 'gloo')
_C.DIST_BACKEND = "nccl"

# Hostname for multi-process groups outside torchrun
_C.HOST = "localhost"

# Port range for multi-process groups (the port is picked at random)
_C.PORT_RANGE = [10000, 65000]

# Fixed port (older pycls configs; 0 means pick one from PORT_RANGE)
_C.PORT = 0

# Local cache for weights referred to by URL (pycls; pycls_fast never downloads)
_C.DOWNLOAD_CACHE = "/tmp/pycls-download-cache"


# Keys that older pycls versions had and that mean nothing now: accepted, ignored.
_DEPRECATED_KEYS = {"PREC_TIME.BATCH_SIZE", "PREC_TIME.ENABLED"}

_DEFAULTS = _C.clone()
_DEFAULTS.freeze()


def get_cfg():
    """Returns a fresh, mutable copy of the default config."""
    cfg = _DEFAULTS.clone()
    cfg.defrost()
    return cfg


def _flat_keys(node, prefix=""):
    keys = []
    for k, v in node.items():
        full = f"{prefix}{k}"
        keys.extend(_flat_keys(v, full + ".") if isinstance(v, CfgNode) else [full])
    return keys


def _suggest(name, choices):
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(key, value, default):
    """Returns `value` with the type of `default`, or raises ConfigError."""
    if isinstance(value, str) and not isinstance(default, str):
        # Command-line overrides arrive as strings: parse them as Python literals.
        with contextlib.suppress(ValueError, SyntaxError):
            value = ast.literal_eval(value)
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-6" (no dot) as a string: accept it as the number it is.
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(default, (list, tuple)):
        if isinstance(value, (list, tuple)):
            return list(value)
    elif isinstance(default, str):
        if isinstance(value, str):
            return value
    elif default is None:
        return value
    want = type(default).__name__
    raise ConfigError(f"config key {key}: expected {want}, got {value!r}")


def _merge(cfg, src, prefix=""):
    for k, v in src.items():
        key = f"{prefix}{k}"
        if key in _DEPRECATED_KEYS:
            continue
        if k not in cfg:
            while isinstance(v, dict) and v:
                # An unknown section: name its first key, the closest real key to it.
                k, v = next(iter(v.items()))
                key = f"{key}.{k}"
            where = _flat_keys(_DEFAULTS)
            raise ConfigError(f"unknown config key {key}{_suggest(key, where)}")
        if isinstance(cfg[k], CfgNode):
            if not isinstance(v, dict):
                raise ConfigError(f"config key {key}: expected a section, got {v!r}")
            _merge(cfg[k], v, key + ".")
        else:
            cfg[k] = _coerce(key, v, cfg[k])


def merge_from_file(cfg, path):
    """Merges the YAML file at `path` into `cfg` (checked key by key)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as f:
            src = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "invalid YAML"
        raise ConfigError(f"config file {path} is not valid YAML: {first}") from None
    if not isinstance(src, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys")
    if "_BASE_" in src:
        base = os.path.join(os.path.dirname(path), src.pop("_BASE_"))
        merge_from_file(cfg, base)
    _merge(cfg, src)


def merge_from_list(cfg, opts):
    """Merges command-line overrides `[KEY, VALUE, KEY, VALUE, ...]` into `cfg`."""
    if len(opts) % 2:
        raise ConfigError(f"overrides come in KEY VALUE pairs; got {opts[-1]!r} alone")
    for key, value in zip(opts[0::2], opts[1::2]):
        node = {}
        cursor = node
        parts = key.split(".")
        for p in parts[:-1]:
            cursor = cursor.setdefault(p, {})
        cursor[parts[-1]] = value
        _merge(cfg, node)


_CHOICES = {
    "MODEL.TYPE": ["vit"],
    "MODEL.LOSS_FUN": ["cross_entropy"],
    "VIT.STEM_TYPE": ["patchify", "conv"],
    "VIT.CLASSIFIER_TYPE": ["token", "pooled"],
    "VIT.LAYOUT": ["batch_second", "batch_first"],
    "VIT.ATTENTION": [
        "auto",
        "sdpa",
        "sdpa_flash",
        "sdpa_math",
        "sdpa_efficient",
        "sdpa_cudnn",
        "explicit",
    ],
    "OPTIM.OPTIMIZER": ["sgd", "adam", "adamw", "lamb"],
    "OPTIM.LR_POLICY": ["cos", "exp", "lin", "steps"],
    "AMP.MODE": ["", "fp32", "O1", "O2", "O3"],
    "AMP.DTYPE": ["bf16", "fp16"],
    "DATA_LOADER.MODE": ["threads", "spdl", "processes"],
    "LOG_DEST": ["stdout", "file"],
    "LAUNCH.MODE": ["local", "slurm", "submitit_local"],
}

_POSITIVE = [
    "MODEL.NUM_CLASSES",
    "VIT.PATCH_SIZE",
    "VIT.NUM_LAYERS",
    "VIT.NUM_HEADS",
    "VIT.HIDDEN_DIM",
    "VIT.MLP_DIM",
    "OPTIM.MAX_EPOCH",
    "OPTIM.EMA_UPDATE_PERIOD",
    "TRAIN.BATCH_SIZE",
    "TRAIN.IM_SIZE",
    "TRAIN.EVAL_PERIOD",
    "TRAIN.CHECKPOINT_PERIOD",
    "TEST.BATCH_SIZE",
    "TEST.IM_SIZE",
    "DATA_LOADER.PREFETCH",
    "NUM_GPUS",
    "LOG_PERIOD",
    "PREC_TIME.NUM_ITER",
    "DIST.TIMEOUT_S",
    "LN.EPS",
    "BN.EPS",
]

_NON_NEGATIVE = [
    "OPTIM.BASE_LR",
    "OPTIM.MIN_LR",
    "OPTIM.WEIGHT_DECAY",
    "OPTIM.WARMUP_EPOCHS",
    "OPTIM.EMA_ALPHA",
    "OPTIM.GRAD_CLIP",
    "TRAIN.MIXUP_ALPHA",
    "TRAIN.CUTMIX_ALPHA",
    "TRAIN.PCA_STD",
    "DATA_LOADER.NUM_WORKERS",
    "DATA_LOADER.STATS_PERIOD",
    "PREC_TIME.WARMUP_ITER",
    "TRAIN.CHECKPOINT_ITER_PERIOD",
    "TRAIN.CHECKPOINT_KEEP",
]

_FRACTIONS = [
    "TRAIN.LABEL_SMOOTHING",
    "VIT.DROP_PATH",
    "DATA_LOADER.MAX_BAD_FRAC",
]


def _get(cfg, key):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def check_cfg(cfg):
    """Checks values and combinations; raises ConfigError naming the first bad key."""
    for key, choices in _CHOICES.items():
        value = _get(cfg, key)
        if key == "MODEL.TYPE":
            value = value.lower()
        if value not in choices:
            hint = _suggest(value, choices) if isinstance(value, str) else ""
            raise ConfigError(f"{key} must be one of {choices}, got {value!r}{hint}")
    for key in _POSITIVE:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"{key} must be > 0, got {_get(cfg, key)!r}")
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {_get(cfg, key)!r}")
    for key in _FRACTIONS:
        if not 0.0 <= _get(cfg, key) < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {_get(cfg, key)!r}")
    _check_vit(cfg.VIT, cfg.TRAIN.IM_SIZE)
    lo_hi = cfg.DATA.CROP_SCALE
    if len(lo_hi) != 2 or not 0.0 < lo_hi[0] <= lo_hi[1] <= 1.0:
        raise ConfigError(f"DATA.CROP_SCALE must be [min, max] in (0, 1], got {lo_hi}")
    if not 0.0 <= cfg.DATA.HFLIP <= 1.0:
        raise ConfigError(f"DATA.HFLIP must be in [0, 1], got {cfg.DATA.HFLIP}")
    if cfg.OPTIM.STEPS and cfg.OPTIM.STEPS[0] != 0:
        raise ConfigError(f"OPTIM.STEPS must start at 0, got {cfg.OPTIM.STEPS}")
    if cfg.OPTIM.LR_POLICY == "steps" and not cfg.OPTIM.STEPS:
        raise ConfigError("OPTIM.STEPS must be set when OPTIM.LR_POLICY is 'steps'")
    for key in ("TRAIN.BATCH_SIZE", "TEST.BATCH_SIZE"):
        if _get(cfg, key) % cfg.NUM_GPUS:
            raise ConfigError(
                f"{key} ({_get(cfg, key)}) must be divisible by NUM_GPUS "
                f"({cfg.NUM_GPUS})"
            )
    if cfg.AMP.MODE == "fp32" and cfg.TRAIN.MIXED_PRECISION:
        raise ConfigError(
            "AMP.MODE is 'fp32' but TRAIN.MIXED_PRECISION is True: set one of them"
        )


def _check_vit(vit, im_size):
    if im_size % vit.PATCH_SIZE:
        raise ConfigError(
            f"TRAIN.IM_SIZE ({im_size}) must be divisible by VIT.PATCH_SIZE "
            f"({vit.PATCH_SIZE})"
        )
    if vit.HIDDEN_DIM % vit.NUM_HEADS:
        raise ConfigError(
            f"VIT.HIDDEN_DIM ({vit.HIDDEN_DIM}) must be divisible by VIT.NUM_HEADS "
            f"({vit.NUM_HEADS})"
        )
    if vit.STEM_TYPE != "conv":
        return
    ks, ss, ws = vit.C_STEM_KERNELS, vit.C_STEM_STRIDES, vit.C_STEM_DIMS
    if not ks or not len(ks) == len(ss) == len(ws):
        raise ConfigError(
            "VIT.C_STEM_KERNELS, VIT.C_STEM_STRIDES and VIT.C_STEM_DIMS must be "
            f"non-empty and of equal length, got {len(ks)}, {len(ss)}, {len(ws)}"
        )
    if any(k % 2 == 0 or k < 1 for k in ks):
        raise ConfigError(f"VIT.C_STEM_KERNELS must be odd, got {list(ks)}")
    prod = 1
    for s in ss:
        prod *= s
    if prod != vit.PATCH_SIZE:
        raise ConfigError(
            f"VIT.C_STEM_STRIDES {list(ss)} multiply to {prod}, not VIT.PATCH_SIZE "
            f"({vit.PATCH_SIZE})"
        )
    if ws[-1] != vit.HIDDEN_DIM:
        raise ConfigError(
            f"VIT.C_STEM_DIMS ends with {ws[-1]}, not VIT.HIDDEN_DIM ({vit.HIDDEN_DIM})"
        )


def load_cfg(path=None, opts=()):
    """Returns the default config merged with the file at `path` and `opts`, checked.

    Raises ConfigError (a ValueError) with one line naming the bad key or file.
    """
    cfg = get_cfg()
    if path:
        merge_from_file(cfg, path)
    merge_from_list(cfg, list(opts))
    check_cfg(cfg)
    return cfg


def dump_cfg(cfg, out_dir=None):
    """Writes `cfg` to OUT_DIR/CFG_DEST (atomically) and returns the path."""
    out_dir = out_dir or cfg.OUT_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, cfg.CFG_DEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(cfg.dump())
    os.replace(tmp, path)
    return path
