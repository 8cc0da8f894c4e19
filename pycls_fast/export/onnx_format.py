"""ONNX through torch's exporter (torch.export, `dynamo=True`), checked with
onnxruntime on the CPU against the model's own fp32 logits.

The graph takes `images` (float32, N x 3 x S x S, normalized as the test transform
does: resize, center crop, ImageNet mean and std) and returns `logits` (float32,
N x classes). The batch dimension is symbolic (any N), or fixed with `batch`.
"""

import importlib.util
import math

import numpy as np
import torch
from torch import nn
from yacs.config import CfgNode

from pycls_fast.errors import PyclsFastError, UserError
from pycls_fast.models.vit import ViTParams

INPUT, OUTPUT = "images", "logits"
MAX_SINGLE_FILE_BYTES = 1_800_000_000


class ExportCheckError(PyclsFastError):
    """The exported model computes other logits than the model (exit status 1)."""


# What --format onnx imports: torch's exporter (onnx, onnxscript) and the check.
PACKAGES = ("onnx", "onnxscript", "onnxruntime")


def check_onnx_packages() -> None:
    """UserError naming the missing packages and the one command that installs them
    (`make`'s environment has them: requirements-runtime.lock)."""
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise UserError(
            f"--format onnx needs {', '.join(missing)}: pip install "
            f"{' '.join(PACKAGES)} (or pip install -e '.[export]')"
        )


def export_onnx(model: nn.Module, cfg: CfgNode, path: str, batch: int | None) -> None:
    """Writes `model` (fp32, CPU, eval) to `path`; `batch`: a fixed batch size, or
    None for a symbolic one."""
    size = cfg.TRAIN.IM_SIZE
    example = torch.zeros(batch or 2, 3, size, size)
    dynamic = None
    if batch is None:
        dynamic = ({0: torch.export.Dim("batch", min=1, max=65536)},)
    # A protobuf file holds at most 2 GB: larger weights go to `path`.data beside it.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.onnx.export(
        model,
        (example,),
        path,
        dynamo=True,
        input_names=[INPUT],
        output_names=[OUTPUT],
        dynamic_shapes=dynamic,
        external_data=weight_bytes > MAX_SINGLE_FILE_BYTES,
        verbose=False,
    )


def logit_tolerance(cfg: CfgNode, logit_scale: float) -> float:
    """Largest difference accepted between two float32 implementations' logits of
    size `logit_scale` (onnxruntime or timm against the model).

    Both run the same float32 arithmetic in other summation orders: a reduction of
    K terms differs by about eps * sqrt(K) relative, and the logits come out of
    2 + 4 x layers chained reductions (stem, head; attention and MLP projections of
    each block), K at most the widest of them; times 8 for softmax, GELU and the
    normalizations, which amplify their inputs' differences by a small factor.
    """
    p = ViTParams.from_cfg(cfg)
    eps = torch.finfo(torch.float32).eps
    widest = max(p.mlp_d, p.hidden_d, 3 * p.patch_size**2)
    steps = 2 + 4 * p.n_layers
    return 8 * eps * math.sqrt(widest) * steps * (1.0 + logit_scale)


def onnx_session(path: str):
    """An onnxruntime CPU session of the ONNX file `path`."""
    import onnxruntime

    return onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])


def check_onnx(
    path: str, model: nn.Module, cfg: CfgNode, batch_sizes: list[int], seed: int = 0
) -> dict:
    """Runs the ONNX file with onnxruntime on the CPU at each batch size and compares
    its logits with `model`'s (fp32) on the same random normalized images; returns
    {"max_abs_diff", "tolerance", "batch_sizes"}; ExportCheckError beyond
    logit_tolerance."""
    session = onnx_session(path)
    size = cfg.TRAIN.IM_SIZE
    g = torch.Generator().manual_seed(seed)
    worst, tol = 0.0, 0.0
    for n in batch_sizes:
        images = torch.randn(n, 3, size, size, generator=g)
        with torch.no_grad():
            expected = model(images).double().numpy()
        got = session.run([OUTPUT], {INPUT: images.numpy()})[0]
        if got.shape != expected.shape:
            raise ExportCheckError(
                f"{path}: logits of shape {got.shape} for a batch of {n}, the "
                f"model's are {expected.shape}"
            )
        diff = float(np.abs(got.astype(np.float64) - expected).max())
        tol = max(tol, logit_tolerance(cfg, float(np.abs(expected).max())))
        worst = max(worst, diff)
        if diff > tol:
            raise ExportCheckError(
                f"{path}: onnxruntime's logits differ from the model's by {diff:.3g} "
                f"at batch {n}, over the tolerance {tol:.3g}"
            )
    return {"max_abs_diff": worst, "tolerance": tol, "batch_sizes": list(batch_sizes)}
