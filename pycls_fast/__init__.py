"""pycls_fast: fast Vision Transformer training on ImageNet-style data."""

__version__ = "0.1.0"
