"""The model card: README.md beside an export, saying what the weights are (source
checkpoint, epoch, config), how well they do (test_net's table, when the checkpoint
was evaluated), what they cost (parameters, FLOPs, activations) and how fast they run
(inference images/s measured at export time, with the hardware and versions), and
how to load them."""

import os
import platform

import torch
from yacs.config import CfgNode

from pycls_fast.engine.inference import format_rows
from pycls_fast.models import complexity

README = "README.md"


def _loading(fmt: str, files: dict) -> list[str]:
    if fmt == "safetensors" and files["config"] != "config.json":  # named files
        return [
            "```python",
            "import json",
            "import timm",
            f'config = json.load(open("{files["config"]}"))',
            "model = timm.create_model(",
            '    config["architecture"],',
            "    pretrained=True,",
            f'    pretrained_cfg_overlay=dict(file="{files["weights"]}", '
            'num_classes=config["num_classes"]),',
            '    **config["model_args"],',
            ")",
            "```",
        ]
    if fmt == "safetensors":
        return [
            "```python",
            "import timm",
            'model = timm.create_model("local-dir:THIS_FOLDER", pretrained=True)',
            "config = timm.data.resolve_data_config({}, model=model)",
            "transform = timm.data.create_transform(**config)",
            "```",
        ]
    return [
        "```python",
        "import onnxruntime",
        f'session = onnxruntime.InferenceSession("{files["onnx"]}")',
        'logits = session.run(["logits"], {"images": images})[0]',
        "# images: float32 N x 3 x S x S, resized, center-cropped and normalized",
        "# with the ImageNet mean and std (see Preprocessing)",
        "```",
    ]


def model_card(
    cfg: CfgNode,
    fmt: str,
    source: dict,
    files: dict,
    evaluation: dict | None,
    throughput: list[dict] | None,
    check: dict | None,
) -> str:
    """The README text. `source`: {checkpoint, epoch, ema, summary: which weights
    of which file, from where in training}; `files`: what was
    written; `evaluation`: test_net's report; `throughput`: inference rows;
    `check`: how the export was validated ({what, max_abs_diff, tolerance})."""
    cx = complexity(cfg)
    size = cfg.TRAIN.IM_SIZE
    lines = [
        f"# {cfg.DESC or 'ViT'} ({fmt})",
        "",
        f"Exported by pycls_fast's tools/export.py: {source['summary']}.",
        "",
        "## Files",
        "",
        *[f"- `{name}`" for name in files.values()],
        "",
        "## Loading",
        "",
        *_loading(fmt, files),
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| layers x width x heads | {cfg.VIT.NUM_LAYERS} x {cfg.VIT.HIDDEN_DIM} x "
        f"{cfg.VIT.NUM_HEADS} (MLP {cfg.VIT.MLP_DIM}) |",
        f"| patch, input | {cfg.VIT.PATCH_SIZE} px, {size} x {size} |",
        f"| classifier | {cfg.VIT.CLASSIFIER_TYPE}, {cfg.MODEL.NUM_CLASSES} classes |",
        f"| parameters | {cx['params'] / 1e6:.3f} M |",
        f"| FLOPs (multiply-adds) / image | {cx['flops'] / 1e9:.4f} G |",
        f"| activations / image | {cx['acts'] / 1e6:.3f} M |",
        "",
        "## Preprocessing",
        "",
        f"Resize the shorter side to {cfg.TEST.IM_SIZE} (bilinear), center-crop "
        f"{size}, scale to [0, 1], normalize with mean (0.485, 0.456, 0.406) and std "
        "(0.229, 0.224, 0.225), RGB.",
        "",
        "## Evaluation",
        "",
    ]
    if evaluation:
        lines += [
            f"test_net.py on `{cfg.DATA.PATH}` (epoch {evaluation.get('epoch')}):",
            "",
            evaluation["table"],
        ]
    else:
        lines += ["Not evaluated (run tools/test_net.py on the checkpoint first)."]
    lines += ["", "## Inference throughput", ""]
    if throughput:
        device = throughput[0]["device"]
        hardware = (
            torch.cuda.get_device_name(torch.device(device))
            if device.startswith("cuda")
            else f"{platform.processor() or platform.machine()} CPU, "
            f"{torch.get_num_threads()} threads"
        )
        lines += [
            f"Measured at export on {hardware}, {throughput[0]['amp']}, compile "
            f"{throughput[0]['compile']}; torch {torch.__version__}; ours and timm's "
            "VisionTransformer of the same shape in turns (medians):",
            "",
            format_rows(throughput),
        ]
    else:
        lines += ["Not measured (--no-throughput)."]
    if check:
        lines += [
            "",
            "## Validation",
            "",
            f"{check['what']}: largest logit difference {check['max_abs_diff']:.3g} "
            f"(tolerance {check['tolerance']:.3g}) on random images.",
        ]
    lines += ["", "## Training config", "", "```yaml", cfg.dump().rstrip(), "```", ""]
    return "\n".join(lines)


def write_model_card(dst: str, text: str, stem: str | None = None) -> str:
    """Writes DST/README.md (DST/<stem>.md beside an export's named files); returns
    its path."""
    path = os.path.join(dst, README if stem is None else f"{stem}.md")
    with open(path, "w") as f:
        f.write(text)
    return path
