# The README's commands. Everything installs from nothing into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow lint format demo check-node bench bench-attention \
	bench-loader bench-optimizer clean

setup: $(STAMP)

$(STAMP): requirements.lock setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: setup lint
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The embedded demo: scikit-learn's digits as an ImageNet folder, a small ViT trained
# with the default fast stack, evaluated; prints the top-1 and where logs and plots are.
demo: setup
	$(PY) tools/prepare_digits.py --root data/digits
	$(PY) tools/train_net.py --cfg configs/examples/vit_digits.yaml
	$(PY) tools/plot_log.py out/digits

# Scenario tests marked slow (also part of `make test`), alone.
test-slow: setup
	$(PY) -m pytest -q -m slow

# Checks a new node: devices, AMP modes, DDP vs FSDP, all-reduce, matmul peaks, loader.
check-node: setup
	$(PY) tools/check_node.py

# Benchmarks (benchmarks/, run from here, not installed); figures: docs/PERFORMANCE.md.
# The optimization ladder and its timm peers on ViT-P-4GF dims (a few minutes on 2 cores).
bench: setup
	$(PY) -m benchmarks.ladder --cfg configs/pycls/ViT-P-4GF.yaml \
		--plot out/bench/ladder_ViT-P-4GF.png

bench-attention: setup
	$(PY) -m benchmarks.attention

bench-loader: setup
	$(PY) -m benchmarks.loader

bench-optimizer: setup
	$(PY) -m benchmarks.optimizer

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
