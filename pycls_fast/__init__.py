"""pycls_fast: fast Vision Transformer training on ImageNet-style data."""

__version__ = "0.1.0"

from pycls_fast import moved

moved.install()  # pycls_fast.core.* and other pre-split paths keep importing
