"""Benchmarks of pycls_fast, run from the repository root (not installed):

    python -m benchmarks.ladder --cfg configs/pycls/ViT-P-4GF.yaml  # make bench
    python -m benchmarks.loader                                     # make bench-loader
    python -m benchmarks.attention                               # make bench-attention
    python -m benchmarks.optimizer                               # make bench-optimizer

`harness` holds the side-by-side timing they share; the figures are in
docs/PERFORMANCE.md. These modules import pycls_fast, never the reverse.
"""
