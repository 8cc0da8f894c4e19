"""Trained models from Python: load a run or checkpoint in one call, predict images.

    from pycls_fast.engine.predict import load_trained

    trained = load_trained("out/digits")              # a run folder or checkpoint
    trained.predict("digit.jpg", k=3)                 # [(class, name, prob), ...]
    logits = trained.model(trained.preprocess(im))    # a PIL image, as evaluated

The config is the one the weights were trained with (the checkpoint's `cfg`, else
the run's config.yaml); images go through the evaluation path: resize the shorter
side to TEST.IM_SIZE, center-crop TRAIN.IM_SIZE, normalize by DATA.MEAN / DATA.STD,
in DATA.CHANNEL_ORDER.
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image
from yacs.config import CfgNode

from pycls_fast.checkpoint.files import resolve_weights
from pycls_fast.checkpoint.run_record import saved_config_text
from pycls_fast.checkpoint.weights import LoadedWeights, load_model_weights
from pycls_fast.config import load_cfg, load_cfg_text
from pycls_fast.datasets.formats.index import class_names
from pycls_fast.datasets.images.decode import EncodedImage
from pycls_fast.datasets.images.transforms import build_transform
from pycls_fast.datasets.to_device.transform import DeviceBatchTransform
from pycls_fast.engine.lifecycle import resolve_channel_order
from pycls_fast.errors import ConfigError, UserError
from pycls_fast.models import build_model

logger = logging.getLogger(__name__)


class _Decoded:
    """A PIL image in the shape of an EncodedImage (`size`, `pil()`), so that it
    takes the evaluation transform's own path."""

    def __init__(self, im: Image.Image) -> None:
        self.size = im.size
        self._im = im

    def pil(self) -> Image.Image:
        return self._im


@dataclass
class TrainedModel:
    """A trained model in eval mode on `device`, with its config and how it was
    loaded; `classes` are the class folder names (DATA.PATH/TEST.SPLIT when it is
    there), else empty."""

    model: torch.nn.Module
    cfg: CfgNode
    device: torch.device
    loaded: LoadedWeights
    classes: list[str] = field(default_factory=list)

    def preprocess(self, image: "str | os.PathLike[str] | Image.Image") -> torch.Tensor:
        """An image file or PIL image as evaluation feeds it: float32 (1, 3, S, S)
        on `device`, S = TRAIN.IM_SIZE."""
        source = (
            _Decoded(image)
            if isinstance(image, Image.Image)
            else EncodedImage.read(os.fspath(image))
        )
        size = self.cfg.TRAIN.IM_SIZE
        pixels = np.empty((size, size, 3), dtype=np.uint8)
        build_transform(self.cfg, train=False)(source, None, pixels)
        batch = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)
        prepare = DeviceBatchTransform(self.cfg, self.device, torch.float32, False)
        inputs, _ = prepare(batch, torch.zeros(1, dtype=torch.int64))
        return inputs

    @torch.no_grad()
    def predict(
        self, image: "str | os.PathLike[str] | Image.Image", k: int = 5
    ) -> list[tuple[int, str, float]]:
        """The top-`k` classes of an image: [(class index, class name or '',
        softmax probability)], most probable first."""
        probs = self.model(self.preprocess(image)).float().softmax(dim=1)[0]
        top = probs.topk(min(k, probs.numel()))
        return [
            (int(i), self.classes[i] if i < len(self.classes) else "", float(p))
            for p, i in zip(top.values.tolist(), top.indices.tolist())
        ]


def _config_of(checkpoint: str, source: str, opts) -> CfgNode:
    """The config the weights were trained with: the checkpoint's saved `cfg`, else
    config.yaml of the run holding it; `opts` override it."""
    text = saved_config_text(checkpoint)
    if text is not None:
        return load_cfg_text(text, opts)
    folder = os.path.dirname(os.path.abspath(checkpoint))
    for run in (source, folder, os.path.dirname(folder)):
        path = os.path.join(run, "config.yaml")
        if os.path.isfile(path):
            return load_cfg(path, opts)
    raise UserError(
        f"checkpoint {checkpoint} does not hold its config and no config.yaml is "
        "beside it: pass cfg=load_cfg(...)"
    )


def _class_names(cfg: CfgNode) -> list[str]:
    try:
        return class_names(cfg.DATA.PATH, cfg.TEST.SPLIT)
    except (UserError, ConfigError, OSError):
        return []


def load_trained(
    path: str,
    *,
    ema: bool = False,
    device: str | torch.device = "cpu",
    cfg: CfgNode | None = None,
    opts: Any = (),
) -> TrainedModel:
    """Loads trained weights in one call: `path` is a run folder (its newest
    complete checkpoint), its checkpoints folder, a checkpoint file or a sharded
    checkpoint directory. `ema`: the EMA weights (CheckpointError when the
    checkpoint has none); `device`: where the model goes (fp32, eval mode;
    UserError for a device this machine lacks); `cfg`: the config to build
    (default: the one the weights were trained with, `opts` overriding its keys).
    Logs which weights of which checkpoint it loaded, from where in training (a
    warning for a run that had not finished)."""
    checkpoint, _ = resolve_weights(path)
    device = check_device(device)
    if cfg is None:
        cfg = _config_of(checkpoint, path, list(opts))
    cfg = resolve_channel_order(cfg, checkpoint)
    model = build_model(cfg)
    loaded = load_model_weights(model, checkpoint, use_ema=ema)
    # Said in one line; a warning (shown without any logging set up) when the
    # weights are of a run that had not finished.
    unfinished = loaded.unfinished(cfg.OPTIM.MAX_EPOCH)
    level = logging.WARNING if unfinished else logging.INFO
    logger.log(level, "load_trained: %s", loaded.summary(cfg.OPTIM.MAX_EPOCH))
    model.to(device).eval()
    return TrainedModel(model, cfg, device, loaded, _class_names(cfg))


def check_device(device: "str | torch.device") -> torch.device:
    """`device` as a torch.device; UserError, in one line, for one this machine
    does not have (a CUDA device without a GPU, or beyond the GPUs visible)."""
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise UserError(f"device {device!r}: {e}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = device.index or 0
        if count == 0:
            raise UserError(f"device {str(device)!r}: no CUDA GPU is visible here")
        if index >= count:
            raise UserError(
                f"device {str(device)!r}: only {count} CUDA GPU(s) are visible"
            )
    return device
