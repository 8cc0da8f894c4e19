#!/usr/bin/env bash
# Every open GPU question in one command (docs/PERFORMANCE.md, "First measurements on
# a GPU" and the sections after it), most important first, in about 8 minutes on one
# H100; a phase that would not fit the budget left (BUDGET_S, 510) is skipped and
# says so. Logs and figures go to $OUT_DIR (default out/bench/gpu_node).
#
#   bash benchmarks/gpu_node.sh [OUT_DIR]        # or: make bench-gpu
#   FULL=1 bash benchmarks/gpu_node.sh           # also the first session's phases
#
# A node that reaches no package registry: `make gpu-wheels` here first, carry
# build/wheels with the checkout, run with the node's python (PY=python3): the
# wheels are installed, and the package is imported from this checkout.
#
# Phases, in order:
#   check_node   the node's health: device, AMP modes' losses (CHECKS)
#   images       photo-like JPEGs, 10 classes x IMAGES (no class signal: speed only)
#   real_O3      a real run against its step (benchmarks/real_run.py): loader modes
#                (REAL_MODES) x recipes (RECIPES: DeiT's) at O3, plus EXTRA_CELLS
#                (DeiT's RandAugment on the GPU: TRAIN.AUGMENT_BACKEND device) and one
#                cell with CUDA graphs; the slowest cell profiled (trace + operators)
#   real_pycls   the same with pycls's recipe (AutoAugment), PYCLS_MODES
#   fp8          float8 vs bf16 (benchmarks/fp8.py: ViT-L/16 and ViT-H/14 steps,
#                ViT-L/16's loss curves; GPUs with fp8 matmuls)
#   gpu_tests    tests/integration/test_gpu.py (CUDA copies, the side-stream
#                prefetcher, the device augmentation against the CPU, no syncs)
#   augment      each recipe's per-image CPU, and TRAIN.AUGMENT_BACKEND device's
#                policies timed on the GPU per batch (benchmarks/augment_cost.py)
#   real_O1      the same as real_O3 at O1, fewer cells (O1_MODES)
#   loader       the loader alone, per mode, on the node's cores (benchmarks/loader.py)
#   with FULL=1: time_net in each AMP mode (MODES) and compiled, the distributed
#   ladder, a short train_net run per AMP mode (the first session's measurements)
#
# Smaller runs (tests/integration/test_gpu_node.py runs it on a CPU this way): CFG,
# BATCH (128), STEPS (timed steps per real-run cell, 200), WARMUP (20), IMAGES (320),
# AUG_IMAGES (128: the augment phase's JPEGs), AUG_SIZE (224: its crops),
# REAL_MODES ("threads subprocess processes"), EXTRA_CELLS ("deit+device:subprocess";
# "" none), PYCLS_MODES ("threads subprocess"; "" skips), O1_MODES ("subprocess"), RECIPES ("deit"), GRAPHS (1: the
# CUDA graphs cell), CHECKS, LOADER (1: the loader phase), FP8 (1), and for FULL:
# MODES ("fp32 O1 O2 O3"), SECONDS_EACH (30), COMPILE (1), EPOCHS (3), LARGE (256),
# ROUNDS (3), ITERS (5).
set -u
OUT_DIR=${1:-out/bench/gpu_node}
CFG=${CFG:-configs/vit/ViT-B-16.yaml}
BATCH=${BATCH:-128}
STEPS=${STEPS:-200}
WARMUP=${WARMUP:-20}
IMAGES=${IMAGES:-320}
AUG_IMAGES=${AUG_IMAGES:-128}
AUG_SIZE=${AUG_SIZE:-224}
REAL_MODES=${REAL_MODES:-threads subprocess processes}
PYCLS_MODES=${PYCLS_MODES-threads subprocess}
O1_MODES=${O1_MODES:-subprocess}
RECIPES=${RECIPES:-deit}
EXTRA_CELLS=${EXTRA_CELLS-deit+device:subprocess}
GRAPHS=${GRAPHS:-1}
CHECKS=${CHECKS:-device,amp}
LOADER=${LOADER:-1}
FP8=${FP8:-1}
BUDGET_S=${BUDGET_S:-510}
FULL=${FULL:-0}
MODES=${MODES:-fp32 O1 O2 O3}
SECONDS_EACH=${SECONDS_EACH:-30}
COMPILE=${COMPILE:-1}
EPOCHS=${EPOCHS:-3}
LARGE=${LARGE:-256}
ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-5}
PY=${PY:-python}
if [ ! -f "$CFG" ]; then echo "gpu_node: no config file $CFG" >&2; exit 2; fi
NPROC=${NPROC:-$($PY -c "import torch; print(max(torch.cuda.device_count(), 1))")}
WORKERS=${WORKERS:-$(( $(nproc) / NPROC - 2 > 1 ? $(nproc) / NPROC - 2 : 1 ))}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
# The package from this checkout, installed or not (a node's own python).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Wheels carried to a node that reaches no package registry (`make gpu-wheels`).
if ls build/wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install --quiet --no-deps --no-index build/wheels/*.whl \
    > "$OUT_DIR/wheels.log" 2>&1 || echo "gpu_node: wheel install failed, see $OUT_DIR/wheels.log"
fi

FAILED=0
START=$SECONDS
phase() {  # phase NAME EST_S CMD...: skipped when EST_S exceeds the budget left
  local name=$1 est=$2 t0=$SECONDS rc left; shift 2
  left=$(( BUDGET_S - (SECONDS - START) ))
  if [ "$est" -gt "$left" ]; then
    echo "gpu_node: $name skipped: ~$est s, $left s of the budget left"
    return
  fi
  echo "gpu_node: $name (~$est s) ..."
  "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  [ $rc = 0 ] || FAILED=1
  echo "gpu_node: $name exit $rc in $(( SECONDS - t0 )) s; log $OUT_DIR/$name.log"
}
csv() { echo "$*" | tr ' ' ','; }

echo "gpu_node: $CFG, batch $BATCH per GPU, $NPROC GPU(s), $WORKERS loader threads;" \
  "budget $BUDGET_S s"
phase check_node 40 $PY tools/check_node.py --cfg "$CFG" --checks "$CHECKS"
phase images 30 $PY -c "
from pycls_fast.datasets.formats.synthetic import make_image_folder
make_image_folder('$OUT_DIR/images', splits=('train',), num_classes=10, images_per_class=$IMAGES)"
GRAPHS_CELL=()
[ "$GRAPHS" = 1 ] && GRAPHS_CELL=(--graphs-cell "deit:subprocess")
REAL=(--cfg "$CFG" --data "$OUT_DIR/images" --steps "$STEPS" --warmup "$WARMUP"
  NUM_GPUS 1 TRAIN.BATCH_SIZE "$BATCH" MODEL.NUM_CLASSES 10
  DATA_LOADER.NUM_WORKERS "$WORKERS")
phase real_O3 190 $PY -m benchmarks.real_run --amp O3 --modes "$(csv $REAL_MODES)" \
  --recipes "$(csv $RECIPES)" --extra-cells "$(csv $EXTRA_CELLS)" "${GRAPHS_CELL[@]}" \
  --out "$OUT_DIR/real_O3" "${REAL[@]}"
if [ -n "$PYCLS_MODES" ]; then
  phase real_pycls 60 $PY -m benchmarks.real_run --amp O3 --modes "$(csv $PYCLS_MODES)" \
    --recipes pycls --profile-steps 0 --out "$OUT_DIR/real_pycls" "${REAL[@]}"
fi
if [ "$FP8" = 1 ] && $PY -c "import torch,sys; sys.exit(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)))"; then
  phase fp8 210 $PY -m benchmarks.fp8 --loss-cfgs configs/vit/ViT-L-16.yaml \
    --out-dir "$OUT_DIR/fp8"
fi
if $PY -c "import pytest, torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  phase gpu_tests 30 $PY -m pytest -q -p no:cacheprovider --gpu tests/integration/test_gpu.py
fi
phase augment 40 $PY -m benchmarks.augment_cost --root "$OUT_DIR/augment_images" \
  --images "$AUG_IMAGES" --im-size "$AUG_SIZE" --rounds 2 --gil-rounds 1 --batch "$BATCH" \
  --json "$OUT_DIR/augment_cost.json"
phase real_O1 50 $PY -m benchmarks.real_run --amp O1 --modes "$(csv $O1_MODES)" \
  --recipes deit --profile-steps 0 --out "$OUT_DIR/real_O1" "${REAL[@]}"
if [ "$LOADER" = 1 ]; then
  phase loader 45 $PY -m benchmarks.loader --data "$OUT_DIR/images" \
    --images $(( 10 * IMAGES < 1024 ? 10 * IMAGES : 1024 )) \
    --batch-size "$BATCH" --workers "$WORKERS" --rounds 1 --no-memory --max-tries 1 --json
fi
if [ "$FULL" = 1 ]; then
  for m in $MODES; do
    phase "time_$m" 45 $PY tools/time_net.py --cfg "$CFG" --seconds "$SECONDS_EACH" --json \
      NUM_GPUS 1 TRAIN.BATCH_SIZE "$BATCH" TEST.BATCH_SIZE $(( 2 * BATCH )) DATA.PATH "" \
      AMP.MODE $m OUT_DIR "$OUT_DIR/time_$m"
  done
  if [ "$COMPILE" = 1 ]; then
    phase time_O1_compile 60 $PY tools/time_net.py --cfg "$CFG" --seconds "$SECONDS_EACH" \
      --json NUM_GPUS 1 TRAIN.BATCH_SIZE "$BATCH" TEST.BATCH_SIZE $(( 2 * BATCH )) \
      DATA.PATH "" AMP.MODE O1 TRAIN.COMPILE block OUT_DIR "$OUT_DIR/time_O1_compile"
  fi
  phase ladder 120 torchrun --standalone --nproc_per_node "$NPROC" -m benchmarks.ladder_dist \
    --cfg "$CFG" --batch $(( NPROC * BATCH )) --rounds "$ROUNDS" --iters "$ITERS" \
    --warmup 2 --large-size "$LARGE" \
    --json-out "$OUT_DIR/ladder.json" --plot-dir "$OUT_DIR/ladder"
  $PY -c "
from pycls_fast.datasets.formats.synthetic import make_image_folder
make_image_folder('$OUT_DIR/images', splits=('val',), num_classes=10, images_per_class=max($IMAGES // 10, 1), seed=1)"
  for m in $MODES; do
    phase "train_$m" 90 torchrun --standalone --nproc_per_node "$NPROC" tools/train_net.py \
      --cfg "$CFG" NUM_GPUS "$NPROC" TRAIN.BATCH_SIZE $(( NPROC * BATCH )) \
      TEST.BATCH_SIZE $(( NPROC * BATCH )) MODEL.NUM_CLASSES 10 \
      DATA.PATH "$OUT_DIR/images" OPTIM.MAX_EPOCH "$EPOCHS" OPTIM.WARMUP_EPOCHS 1 \
      AMP.MODE $m LOG_PERIOD 5 DATA_LOADER.NUM_WORKERS "$WORKERS" \
      OUT_DIR "$OUT_DIR/train_$m"
  done
fi
echo "gpu_node: real runs against their step (real_run.md in each real_* folder):"
for f in "$OUT_DIR"/real_*/real_run.md; do
  [ -f "$f" ] && cat "$f"
done
echo "gpu_node: done in $(( SECONDS - START )) s"
exit $FAILED
