"""DeiT distillation: the loss (DeiT's DistillationLoss), the distillation-token
model, and the teacher (pycls_fast and timm weights, eval, no gradients)."""

import pytest
import torch
import torch.nn.functional as F

from pycls_fast.components.precision import AmpMode
from pycls_fast.config import ConfigError
from pycls_fast.engine import timing
from pycls_fast.engine.distill import build_distiller, distillation_loss
from pycls_fast.engine.trainer import build_components, train_step
from pycls_fast.models import build_model, complexity
from pycls_fast.models.timm_compat import build_timm_vit, from_timm
from tests.helpers import tiny_cfg


def test_soft_distillation_is_the_tempered_kl_divergence():
    gen = torch.Generator().manual_seed(0)
    student, teacher = (
        torch.randn(6, 10, generator=gen),
        torch.randn(6, 10, generator=gen),
    )
    base = torch.tensor(2.0)
    tau = 3.0
    got = distillation_loss(base, student, teacher, "soft", 0.5, tau)
    p_t = F.softmax(teacher / tau, 1)
    kl = (p_t * (p_t.log() - F.log_softmax(student / tau, 1))).sum()
    want = 0.5 * 2.0 + 0.5 * kl * tau * tau / student.numel()
    torch.testing.assert_close(got, want)
    # A student that agrees with its teacher pays only the base loss.
    same = distillation_loss(base, teacher, teacher, "soft", 0.3, tau)
    torch.testing.assert_close(same, torch.tensor(0.7 * 2.0))


def test_hard_distillation_is_cross_entropy_to_the_teachers_class():
    gen = torch.Generator().manual_seed(1)
    student, teacher = (
        torch.randn(6, 10, generator=gen),
        torch.randn(6, 10, generator=gen),
    )
    got = distillation_loss(torch.tensor(1.0), student, teacher, "hard", 0.5, 1.0)
    want = 0.5 + 0.5 * F.cross_entropy(student, teacher.argmax(1))
    torch.testing.assert_close(got, want)


def _teacher_files(tmp_path):
    tcfg = tiny_cfg("VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64")
    cfg_path = tmp_path / "teacher.yaml"
    cfg_path.write_text(tcfg.dump())
    torch.manual_seed(0)
    teacher = build_model(tcfg)
    with torch.no_grad():
        for p in teacher.parameters():
            p.normal_(std=0.2)
    weights = tmp_path / "teacher.pyth"
    torch.save(teacher.state_dict(), weights)
    return tcfg, str(cfg_path), str(weights), teacher.eval()


def test_the_teacher_loads_pycls_fast_and_timm_weights(tmp_path):
    tcfg, cfg_path, weights, reference = _teacher_files(tmp_path)
    opts = ["DISTILL.TYPE", "hard", "DISTILL.TEACHER_CFG", cfg_path]
    cfg = tiny_cfg(*opts, "DISTILL.TEACHER_WEIGHTS", weights)
    distiller = build_distiller(cfg, torch.device("cpu"), AmpMode.FP32, torch.float32)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(distiller.teacher_logits(x), reference(x))
    assert not distiller.teacher.training
    assert not any(p.requires_grad for p in distiller.teacher.parameters())
    total = len(reference.state_dict())
    assert f"{total}/{total} tensors" in distiller.note
    # timm's state dict of the same function, converted on load.
    timm_model = build_timm_vit(tcfg).eval()
    with torch.no_grad():
        for p in timm_model.parameters():
            p.normal_(std=0.2)
    timm_weights = tmp_path / "timm.pth"
    torch.save(timm_model.state_dict(), timm_weights)
    cfg = tiny_cfg(*opts, "DISTILL.TEACHER_WEIGHTS", str(timm_weights))
    distiller = build_distiller(cfg, torch.device("cpu"), AmpMode.FP32, torch.float32)
    # timm's tensors, converted, exactly (that the two models then compute the same
    # function is test_timm_compat's claim, checked there in float64).
    want = from_timm(timm_model.state_dict(), tcfg)
    got = distiller.teacher.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert "converted" in distiller.note


def test_distillation_token_model():
    cfg = tiny_cfg("VIT.DISTILL_TOKEN", "True", "DISTILL.TYPE", "hard",
                   "DISTILL.TEACHER_CFG", "t.yaml",
                   "DISTILL.TEACHER_WEIGHTS", "t.pyth")  # fmt: skip
    model = build_model(cfg)
    assert model.pos_embedding.shape[1] == 16 + 2
    assert sum(p.numel() for p in model.parameters()) == complexity(cfg)["params"]
    x = torch.randn(2, 3, 32, 32)
    cls_logits, dist_logits = model.train()(x)
    assert cls_logits.shape == dist_logits.shape == (2, 10)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(x),
            (model.head(_tokens(model, x)[0]) + model.head_dist(_tokens(model, x)[1]))
            / 2,
        )


def _tokens(model, x):
    """The encoder's class and distillation tokens (batch-second layout)."""
    t = model.stem(x).flatten(2).permute(2, 0, 1)
    prefix = [model.class_token.expand(-1, 2, -1), model.dist_token.expand(-1, 2, -1)]
    out = model.encoder(
        torch.cat([*prefix, t], 0) + model.pos_embedding.transpose(0, 1)
    )
    return out[0], out[1]


def test_a_step_with_a_teacher_trains_both_heads(tmp_path):
    _, cfg_path, weights, _ = _teacher_files(tmp_path)
    cfg = tiny_cfg("VIT.DISTILL_TOKEN", "True", "DISTILL.TYPE", "soft",
                   "DISTILL.TEACHER_CFG", cfg_path, "DISTILL.TEACHER_WEIGHTS", weights,
                   "TRAIN.BATCH_SIZE", "8", "OPTIM.OPTIMIZER", "adamw")  # fmt: skip
    parts = build_components(cfg, loaders=False)
    inputs, targets = timing.synthetic_batch(parts, 8, 32)
    before = {n: p.detach().clone() for n, p in parts.model.named_parameters()}
    teacher_before = {
        n: p.clone() for n, p in parts.distiller.teacher.state_dict().items()
    }
    with torch.no_grad():  # the two heads before the step (no dropout, no drop path)
        for head in (parts.model.head, parts.model.head_dist):  # zero at init
            torch.nn.init.normal_(head.head_fc.weight, std=0.1)
        cls_logits, dist_logits = parts.model.train()(inputs)
    loss, logits, _ = train_step(parts, inputs, targets)
    assert torch.isfinite(loss) and logits.shape == (8, 10)
    # The step's logits (for the train error) are the mean of the two heads'.
    torch.testing.assert_close(logits, (cls_logits + dist_logits) / 2)
    for name in ("head.head_fc.weight", "head_dist.head_fc.weight", "dist_token"):
        assert not torch.equal(parts.model.state_dict()[name], before[name]), name
    for n, t in parts.distiller.teacher.state_dict().items():
        assert torch.equal(t, teacher_before[n])  # the teacher does not learn


def test_config_mistakes_are_one_line():
    with pytest.raises(
        ConfigError, match="DISTILL.TYPE soft needs DISTILL.TEACHER_CFG"
    ):
        tiny_cfg("DISTILL.TYPE", "soft")
    with pytest.raises(ConfigError, match="VIT.DISTILL_TOKEN True needs DISTILL.TYPE"):
        tiny_cfg("VIT.DISTILL_TOKEN", "True")
