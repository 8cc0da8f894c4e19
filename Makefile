# The README's commands. Everything installs from nothing into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The runtime (requirements-runtime.lock: the demo's and the tools' packages), then
# the test stack on top (requirements.lock: pytest, ruff, moto's server, ...).
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: setup setup-dev test test-slow test-all test-unit test-integration slurm lint format demo sweep-demo \
	distill-demo \
	check-node bench bench-dist bench-attention \
	bench-loader bench-index bench-shards bench-loader-scaling bench-augment bench-contention \
	bench-optimizer bench-progressive bench-infer bench-build-memory mutation \
	bench-checkpoint bench-gpu gpu-wheels test-kernels test-intel-mkl clean

setup: $(STAMP)

$(STAMP): requirements-runtime.lock setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-runtime.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup-dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP) requirements.lock
	$(PY) -m pip install --quiet -r requirements.lock
	touch $(DEV_STAMP)

# The developer's suite: lint, then every test not marked slow (unit and
# integration; about 15 minutes on 2 cores, within its 25-minute budget). The slow
# scenario tests (SLURM cluster, S3 server, multi-process resharding, kills and
# resumes, exports; docs/RELIABILITY.md, "The slow scenario tests") are
# `make test-slow`; `make test-all` (what CI runs) is both. The summary lists the
# 15 slowest tests. TEST_WORKERS pytest-xdist processes run the test files side by
# side (a file's tests stay in one process, in order): most tests are one core's
# work (their training subprocesses run one intra-op thread), so one at a time
# left a 2-core machine a third idle. TEST_WORKERS=0 runs them in this process, one
# after the other.
TEST_WORKERS ?= 2
PYTEST_SUITE = $(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile
test: setup-dev lint
	$(PYTEST_SUITE) -m "not slow"

# The slow scenario tests alone (about 13 minutes on 2 cores). SLURM (for the
# cluster tests, tests/slurm/cluster.sh) is installed when missing and this is root
# with apt-get; otherwise those tests skip and say why (under CI=true they fail).
test-slow: setup-dev slurm
	$(PYTEST_SUITE) -m slow

# Everything, as CI runs it (.ci/run): `make test`, then `make test-slow`.
test-all: test test-slow

# In-process tests only (about a minute): tests/unit.
test-unit: setup-dev
	$(PY) -m pytest -q tests/unit

# Subprocesses, signals, process groups, benchmarks' smoke runs: tests/integration.
test-integration: setup-dev slurm
	$(PY) -m pytest -q tests/integration

# The numerical parity tests (layouts, kernels, precision, TP/PP) under the kernels
# another CPU would pick: ATen's AVX2 and plain (no SIMD) paths, oneDNN capped at AVX2
# and SSE4.1. No tolerance may depend on this machine's kernels (docs/RELIABILITY.md,
# "Tolerances"); about 15 minutes on 2 cores.
PARITY_TESTS := tests/unit/models tests/unit/components tests/unit/parallel \
	tests/integration/test_tensor_parallel.py tests/integration/test_pipeline.py \
	tests/integration/test_pipeline_parallel.py
test-kernels: setup-dev
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q $(PARITY_TESTS)
	ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 $(PY) -m pytest -q $(PARITY_TESTS)

# The whole suite with MKL on the kernels an Intel Xeon runs (AVX-512 with bf16), on
# any x86 CPU with AVX-512: MKL chooses its code by vendor, not by instruction set,
# and that choice is where AMD and Intel machines' fp32 matmuls differ. The pytest
# header says which MKL branch a run took (docs/RELIABILITY.md, "Tolerances").
MKL_INTEL_SHIM := build/mkl_intel_path.so
$(MKL_INTEL_SHIM): tests/cpu_kinds/mkl_intel_path.c
	@command -v cc >/dev/null || { echo "test-intel-mkl needs a C compiler: apt-get install gcc"; exit 2; }
	mkdir -p build
	cc -shared -fPIC -O2 -o $@ $<
test-intel-mkl: setup-dev lint slurm $(MKL_INTEL_SHIM)
	LD_PRELOAD=$(CURDIR)/$(MKL_INTEL_SHIM) $(PYTEST_SUITE)

# Under CI=true a failed install fails the run (cluster.sh says why); elsewhere the
# SLURM tests skip, and the summary counts them.
slurm:
	@bash tests/slurm/cluster.sh install || { \
	  if [ "$$CI" = true ]; then echo "SLURM install failed under CI=true"; exit 1; fi; \
	  echo "SLURM not installed: the SLURM tests will skip"; }

lint: setup-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup-dev
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The embedded demo: scikit-learn's digits as an ImageNet folder, a small ViT trained
# with the default fast stack, evaluated; prints the top-1 and where logs and plots are.
# A stop (Ctrl-C: 130, SIGTERM: 143) is not a failure: train_net has said how to
# resume (`make demo` again), so make adds no "Error 130" and skips the plot.
demo: setup
	$(PY) tools/prepare_digits.py --root data/digits
	$(PY) tools/train_net.py --cfg configs/examples/vit_digits.yaml && \
		$(PY) tools/plot_log.py out/digits || \
		{ status=$$?; [ $$status -eq 130 ] || [ $$status -eq 143 ] || exit $$status; }

# DeiT distillation on digits (docs/RECIPES.md): the demo ViT trained as the teacher
# (30 epochs, once), then a DeiT-S-shaped student with a distillation token learning
# from it (hard distillation); a few minutes on 2 cores.
TEACHER := out/digits_teacher/checkpoints/model_epoch_0030.pyth
distill-demo: setup
	$(PY) tools/prepare_digits.py --root data/digits
	test -f $(TEACHER) || $(PY) tools/train_net.py --cfg configs/examples/vit_digits.yaml \
		OPTIM.MAX_EPOCH 30 OUT_DIR out/digits_teacher
	$(PY) tools/train_net.py --cfg configs/deit/deit_s_digits_distill.yaml

# The example sweep (docs/SWEEPS.md): 3 learning rates x 2 depths of the digits ViT,
# 2 runs at a time (a few minutes on a laptop); the page: out/sweeps/digits_lr_depth/
# analysis/index.html. Setting up again needs `rm -rf out/sweeps/digits_lr_depth`;
# launching again reruns only what is not done.
SWEEP_CFG := configs/sweeps/digits_lr_depth.yaml
sweep-demo: setup
	$(PY) tools/prepare_digits.py --root data/digits
	test -d out/sweeps/digits_lr_depth/cfgs || \
		$(PY) tools/sweep_setup.py --sweep-cfg $(SWEEP_CFG)
	$(PY) tools/sweep_launch.py --sweep-cfg $(SWEEP_CFG)
	$(PY) tools/sweep_collect.py --sweep-cfg $(SWEEP_CFG)
	$(PY) tools/sweep_analyze.py --sweep-cfg $(SWEEP_CFG)

# Mutation testing of the core modules (docs/RELIABILITY.md): a seeded sample of
# MUTANTS mutants per module, each run against the module's fast tests; prints
# progress and an ETA, writes out/mutation/. Not part of `make test`.
MUTANTS ?= 6
mutation: setup
	$(PY) tools/mutation.py --per-module $(MUTANTS)

# Checks a new node: devices, AMP modes, DDP vs FSDP, all-reduce, matmul peaks, loader.
check-node: setup
	$(PY) tools/check_node.py

# Benchmarks (benchmarks/, run from here, not installed); figures: docs/PERFORMANCE.md.
# The optimization ladder and its timm peers on ViT-P-4GF dims (a few minutes on 2 cores).
bench: setup
	$(PY) -m benchmarks.ladder --cfg configs/pycls/ViT-P-4GF.yaml \
		--plot out/bench/ladder_ViT-P-4GF.png

# The article's ladder on every local device (GPUs, or 2 gloo processes on a CPU) and
# its figures; ViT-H/16 at global batch 560 on GPUs (docs/PERFORMANCE.md).
NPROC ?= 2
LADDER_CFG ?= configs/vit/ViT-S-16.yaml
LADDER_BATCH ?= 16
bench-dist: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m benchmarks.ladder_dist \
		--cfg $(LADDER_CFG) --batch $(LADDER_BATCH) \
		--json-out out/bench/ladder_dist_$(NPROC).json --plot-dir out/bench/ladder_dist

bench-attention: setup
	$(PY) -m benchmarks.attention

bench-loader: setup
	$(PY) -m benchmarks.loader

# Tar shards vs a folder of the same images, and the file system calls of each.
bench-shards: setup
	$(PY) -m benchmarks.shards

# Per-image CPU and GIL-held time; images/s projected for many cores; cores per GPU.
bench-loader-scaling: setup
	$(PY) -m benchmarks.loader_scaling

# CPU and GIL-held ms per image of each recipe family, PIL path against tensor path
# and the policy on the device (timed there per batch), cores per H100
# (docs/PERFORMANCE.md, "Augmentation cost per recipe"); about 2 minutes.
bench-augment: setup
	mkdir -p out/bench
	$(PY) -m benchmarks.augment_cost --ops --json out/bench/augment_cost.json

# The loader beside a host-bound step, per mode and recipe (docs/PERFORMANCE.md,
# "The loader beside the step"; about 5 minutes).
bench-contention: setup
	mkdir -p out/bench
	$(PY) -m benchmarks.contention --rounds 5 --seconds 3 --recipes crop-flip,deit \
		--batch-size 2 --json out/bench/contention.json

# The file index on an ImageNet-shaped tree of 1.28M hard links (docs/PERFORMANCE.md).
bench-index: setup
	$(PY) -m benchmarks.index

bench-optimizer: setup
	$(PY) -m benchmarks.optimizer

# Progressive resolution (TRAIN.SIZE_SCHEDULE) vs a fixed 224 px, ViT-S/16, side by side.
bench-progressive: setup
	$(PY) -m benchmarks.progressive --cfg configs/vit/ViT-S-16.yaml \
		--json-out out/bench/progressive.json

# Inference images/s against batch size, ours and timm's in turns (docs/PERFORMANCE.md).
INFER_CFG ?= configs/vit/ViT-Ti-16.yaml
INFER_BATCHES ?= 1,8,32
bench-infer: setup
	mkdir -p out/bench
	$(PY) tools/time_net.py --cfg $(INFER_CFG) --infer --batch-sizes $(INFER_BATCHES) \
		--csv out/bench/infer.csv

# Peak memory per rank while building and stepping ViT-g/14 (1.01B parameters) under
# FSDP on 2 ranks: each builds its half, never the whole. About 13 GB of host memory
# on a CPU (2 ranks) and ten minutes on 2 cores: check `free -g` first.
bench-build-memory: setup
	$(PY) -m benchmarks.build_memory --json-out out/bench/build_memory_ViT-g-14.json

# Checkpoint stall, synchronous vs TRAIN.CHECKPOINT_ASYNC, for a 2.4 GB state
# (ViT-L width, 12 blocks, AdamW), and the step time while a write runs.
bench-checkpoint: setup
	$(PY) -m benchmarks.checkpoint_stall --json-out out/bench/checkpoint_stall.json

# The first measurements on a GPU node (docs/PERFORMANCE.md): check_node, time_net per
# AMP mode, the ladder on the node's GPUs, a short run per AMP mode. ~10 min on one H100.
bench-gpu: setup
	PY=$(PY) PATH=$(abspath $(VENV))/bin:$$PATH bash benchmarks/gpu_node.sh out/bench/gpu_node

# The packages a GPU node without a package registry lacks, for its own torch (2.11,
# Python 3.12 when last seen): wheels into build/wheels/ (about 17 MB), which
# benchmarks/gpu_node.sh installs first when present (docs/PERFORMANCE.md, "First
# measurements on a GPU"). torchao 0.18.0 is built against torch 2.11 (abi3 wheel).
GPU_WHEELS := torchao==0.18.0 spdl==0.8.0 spdl_core==0.8.0 spdl_io==0.8.0 \
	yacs==0.1.8 submitit==1.5.4 cloudpickle==3.1.2
gpu-wheels: setup
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		$(GPU_WHEELS) -d build/wheels

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
