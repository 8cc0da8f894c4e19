"""pycls_fast: fast Vision Transformer training on ImageNet-style data."""

from setuptools import find_packages, setup

setup(
    name="pycls_fast",
    version="0.1.0",
    description="Fast ViT training in the style of pycls: AMP modes, FSDP, MTA "
    "optimizers, pooled classifier, batch-second layout, threaded data loading",
    # Only the library: benchmarks/ and tests/ run from a checkout, never installed.
    packages=find_packages(
        include=["pycls_fast", "pycls_fast.*"],
        exclude=["benchmarks", "benchmarks.*", "tests", "tests.*"],
    ),
    python_requires=">=3.10",
    # What the package imports, as ranges, so that GPU boxes keep their CUDA build
    # of torch. Not here: fairscale (torch's FSDP2 replaces it; its last release fails
    # on current torch), apex (not on PyPI; torch's fused optimizers and autocast
    # replace it), iopath (nothing uses it). torchvision comes with timm.
    # The floors are the releases the suite runs with (requirements.lock); older
    # ones were seen to fail (runtime/device_info.py TESTED_FLOORS, which warns).
    install_requires=[
        "torch>=2.14",
        "timm>=1.0.31,<2",
        "spdl>=0.1",
        "yacs>=0.1.8",
        "numpy>=1.24",
        "pillow>=10",
        "pyyaml>=6",
        "psutil>=5.9",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "submitit>=1.5",
        "fsspec>=2023.1",
    ],
    extras_require={
        # s3fs and moto's server: the remote-storage tests run against a real
        # S3-compatible server on 127.0.0.1.
        # The embedded demo's dataset (tools/prepare_digits.py).
        "demo": ["scikit-learn>=1.3"],
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2",
            "pytest-xdist>=3",
            "ruff>=0.6",
            "scikit-learn>=1.3",
            "s3fs>=2023.1",
            "moto[server]>=5",
            "onnx>=1.17",
            "onnxruntime>=1.20",
            "onnxscript>=0.2",
            "wandb>=0.19",
            "torchao>=0.18",
        ],
        # LOG_TENSORBOARD: event files through torch.utils.tensorboard.
        "tensorboard": ["tensorboard>=2.14"],
        # tools/export.py --format onnx: torch's exporter (onnxscript) and the
        # onnxruntime check; the export tests need them too.
        "export": ["onnx>=1.17", "onnxruntime>=1.20", "onnxscript>=0.2"],
        # LOG_WANDB: a Weights & Biases run (offline mode needs no account).
        "wandb": ["wandb>=0.19"],
        # AMP.FP8: float8 linears (torchao.float8), imported only when it is on. An
        # extra, not install_requires: each torchao release is built against one
        # torch release (0.18 against 2.11) and a floor here would tie the torch of
        # GPU boxes that keep their own CUDA build; the locks pin it for make.
        "fp8": ["torchao>=0.18"],
    },
)
