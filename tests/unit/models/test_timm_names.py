"""models/timm_names.py: a timm ViT name builds timm's own model, so that timm's
weights load into it strictly."""

import pytest
import timm
import torch

from pycls_fast.models import build_model
from pycls_fast.models.timm_compat import from_timm
from pycls_fast.models.timm_names import timm_cfg, timm_config
from tests.helpers import EXACT


def test_a_timm_name_builds_timms_model():
    name = "vit_tiny_patch16_224"
    cfg = timm_cfg(name, ["MODEL.NUM_CLASSES", "10"])
    assert cfg.VIT.HIDDEN_DIM == 192 and cfg.VIT.CLASSIFIER_TYPE == "token"
    ref = timm.create_model(name, pretrained=False, num_classes=10).eval()
    ours = build_model(cfg).eval()
    ours.load_state_dict(from_timm(ref.state_dict(), cfg), strict=True)
    x = torch.randn(2, 3, 224, 224, dtype=torch.float64)
    with torch.no_grad():
        # The same function, summed by other kernels: float64 agrees at EXACT.
        torch.testing.assert_close(ours.double()(x), ref.double()(x), **EXACT)


def test_sizes_and_tags_are_read_from_the_name():
    path, opts = timm_config("vit_base_patch16_384.augreg_in21k_ft_in1k")
    assert path.endswith("configs/vit/ViT-B-16.yaml")
    assert opts[opts.index("TRAIN.IM_SIZE") + 1] == "384"
    assert timm_config("resnet50") is None
    with pytest.raises(ValueError, match="vit_small_patch16_224"):
        timm_cfg("vit_smol_patch16_224")
