#!/usr/bin/env bash
# The first measurements on a GPU node, in one command (docs/PERFORMANCE.md "First
# measurements on a GPU"): check_node, time_net in each AMP mode and compiled, the
# distributed ladder on the node's GPUs, and a short training run in each AMP mode on
# generated photo-like JPEGs (10 classes, no class signal: it shows each mode trains
# end to end and what a real loader delivers, not accuracy). About 10 minutes on one
# H100. Logs and figures go to $OUT_DIR (default out/bench/gpu_node).
#
#   bash benchmarks/gpu_node.sh [OUT_DIR]        # or: make bench-gpu
#   CFG=configs/vit/ViT-L-16.yaml BATCH=64 bash benchmarks/gpu_node.sh
#
# Smaller runs (tests/integration/test_gpu_node.py runs it on a CPU this way): MODES
# (AMP modes, "fp32 O1 O2 O3"), SECONDS_EACH (time_net's budget, 30), COMPILE (1: also
# time O1 compiled), IMAGES (train images per class, 320), EPOCHS (3), LARGE (the
# ladder's im256 rung's image size, 256), ROUNDS and ITERS (the ladder's, 3 and 5),
# CHECKS (check_node's, all).
set -u
OUT_DIR=${1:-out/bench/gpu_node}
CFG=${CFG:-configs/vit/ViT-B-16.yaml}
BATCH=${BATCH:-128}
MODES=${MODES:-fp32 O1 O2 O3}
SECONDS_EACH=${SECONDS_EACH:-30}
COMPILE=${COMPILE:-1}
IMAGES=${IMAGES:-320}
EPOCHS=${EPOCHS:-3}
LARGE=${LARGE:-256}
ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-5}
CHECKS=${CHECKS:-device,amp,parallel,matmul,loader}
PY=${PY:-python}
if [ ! -f "$CFG" ]; then echo "gpu_node: no config file $CFG" >&2; exit 2; fi
NPROC=${NPROC:-$($PY -c "import torch; print(max(torch.cuda.device_count(), 1))")}
WORKERS=${WORKERS:-$(( $(nproc) / NPROC - 2 > 1 ? $(nproc) / NPROC - 2 : 1 ))}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

FAILED=0
phase() {  # phase NAME CMD...: one line when it starts and ends, its log in OUT_DIR
  local name=$1 t0=$SECONDS rc; shift
  echo "gpu_node: $name ..."
  "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  [ $rc = 0 ] || FAILED=1
  echo "gpu_node: $name exit $rc in $(( SECONDS - t0 )) s; log $OUT_DIR/$name.log"
}

echo "gpu_node: $CFG, batch $BATCH per GPU, $NPROC GPU(s), $WORKERS loader threads; ~10 min"
phase check_node $PY tools/check_node.py --cfg "$CFG" --checks "$CHECKS"
for m in $MODES; do
  phase "time_$m" $PY tools/time_net.py --cfg "$CFG" --seconds "$SECONDS_EACH" --json NUM_GPUS 1 \
    TRAIN.BATCH_SIZE "$BATCH" TEST.BATCH_SIZE $(( 2 * BATCH )) DATA.PATH "" \
    AMP.MODE $m OUT_DIR "$OUT_DIR/time_$m"
done
if [ "$COMPILE" = 1 ]; then
  phase time_O1_compile $PY tools/time_net.py --cfg "$CFG" --seconds "$SECONDS_EACH" \
    --json NUM_GPUS 1 TRAIN.BATCH_SIZE "$BATCH" TEST.BATCH_SIZE $(( 2 * BATCH )) \
    DATA.PATH "" AMP.MODE O1 TRAIN.COMPILE block OUT_DIR "$OUT_DIR/time_O1_compile"
fi
phase ladder torchrun --standalone --nproc_per_node "$NPROC" -m benchmarks.ladder_dist \
  --cfg "$CFG" --batch $(( NPROC * BATCH )) --rounds "$ROUNDS" --iters "$ITERS" --warmup 2 \
  --large-size "$LARGE" \
  --json-out "$OUT_DIR/ladder.json" --plot-dir "$OUT_DIR/ladder"
phase images $PY -c "
from pycls_fast.datasets.formats.synthetic import make_image_folder
make_image_folder('$OUT_DIR/images', splits=('train',), num_classes=10, images_per_class=$IMAGES)
make_image_folder('$OUT_DIR/images', splits=('val',), num_classes=10, images_per_class=max($IMAGES // 10, 1), seed=1)"
for m in $MODES; do
  phase "train_$m" torchrun --standalone --nproc_per_node "$NPROC" tools/train_net.py \
    --cfg "$CFG" NUM_GPUS "$NPROC" TRAIN.BATCH_SIZE $(( NPROC * BATCH )) \
    TEST.BATCH_SIZE $(( NPROC * BATCH )) MODEL.NUM_CLASSES 10 \
    DATA.PATH "$OUT_DIR/images" OPTIM.MAX_EPOCH "$EPOCHS" OPTIM.WARMUP_EPOCHS 1 AMP.MODE $m \
    LOG_PERIOD 5 DATA_LOADER.NUM_WORKERS "$WORKERS" OUT_DIR "$OUT_DIR/train_$m"
done
# float8 vs bf16 on GPUs with float8 matmuls (benchmarks/fp8.py; torchao from build/wheels, `make gpu-wheels`, when present)
$PY -c "import torch,sys; sys.exit(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)))" && phase fp8 bash -c "if ls build/wheels/torchao-*.whl >/dev/null 2>&1; then $PY -m pip install --no-index --find-links build/wheels torchao; fi; $PY -m benchmarks.fp8 --out-dir '$OUT_DIR/fp8'"
echo "gpu_node: the step in each mode (time_net) and in a real run (train_net, last epoch):"
for m in $MODES; do
  step=$(grep -h '"train_img_per_s"' "$OUT_DIR/time_$m.log" | $PY -c \
    "import json,sys; print(round(json.loads(sys.stdin.read())['train_img_per_s']))")
  run=$(grep -h '"_type": "train_epoch"' "$OUT_DIR/train_$m/stdout.log" | tail -1 | \
    $PY -c "import json,sys; print(round(json.loads(sys.stdin.read().split('json_stats: ')[1])['img_per_s']))")
  echo "  $m: time_net $step img/s, train_net $run img/s"
done
exit $FAILED
