"""docs/GETTING_STARTED.md's section 6 run as written (average, evaluate, export to
safetensors and ONNX, load in timm and onnxruntime) on a run trained here, and what
the exports must be: timm's model and onnxruntime's graph computing the model's
logits, at any batch or a fixed one, with a model card."""

import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch

from pycls_fast.config import load_cfg
from pycls_fast.export.onnx_format import logit_tolerance
from pycls_fast.models import build_model, complexity
from tests.helpers import DIGITS_CFG, ROOT, run_tool

# The module runs the doc's commands as a user does, each a fresh Python process
# (torch, timm and onnx imports, torch's ONNX exporter): minutes, not seconds.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# The reduced size the doc states: 3 epochs at 16 px, 1 block of width 32, a
# checkpoint every epoch.
SMALL = ["VIT.NUM_LAYERS", "1", "VIT.HIDDEN_DIM", "32", "VIT.MLP_DIM", "64",
         "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "3",
         "OPTIM.WARMUP_EPOCHS", "0", "TRAIN.CHECKPOINT_PERIOD", "1"]  # fmt: skip
SECTION = "## 6. After training"


def _doc_blocks():
    """The code blocks of GETTING_STARTED's section 6: (shell lines, python code)."""
    with open(os.path.join(ROOT, "docs", "GETTING_STARTED.md")) as f:
        text = f.read()
    section = text[text.index(SECTION) :]
    section = section[: section.find("\n## ", 1)]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)
    shell = [b for lang, b in blocks if not lang][0].strip().splitlines()
    python = [b for lang, b in blocks if lang == "python"][0]
    return shell, python


def _tool(cwd, script, *args):
    """`python <repository>/<script> args` run in `cwd`, output captured."""
    cmd = [sys.executable, os.path.join(ROOT, script), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def demo(digits, tmp_path_factory):
    """A folder laid out as the repository after `make demo` (data/digits, a trained
    out/digits), and the outputs of section 6's commands run there as written."""
    home = tmp_path_factory.mktemp("home")
    os.makedirs(home / "data")
    os.symlink(digits, home / "data" / "digits")
    train = _tool(home, "tools/train_net.py", "--cfg", DIGITS_CFG, *SMALL,
                  "DATA.PATH", "data/digits", "OUT_DIR", "out/digits")  # fmt: skip
    assert train.returncode == 0, train.stderr
    shell, python = _doc_blocks()
    outputs = []
    for line in shell:
        args = shlex.split(line)
        assert args[0] == ".venv/bin/python" and args[1].startswith("tools/"), line
        result = _tool(home, *args[1:])
        assert result.returncode == 0, (line, result.stderr)
        outputs.append(result.stdout)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # timm must not need the network
    result = subprocess.run([sys.executable, "-c", python], cwd=home, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    outputs.append(result.stdout)
    return home, outputs


def _snippet_logit_scale(home):
    """The largest |logit| timm's export gives the snippet's image."""
    import timm
    from PIL import Image

    model = timm.create_model(
        f"local-dir:{home}/out/digits/export_timm", pretrained=True
    ).eval()
    config = timm.data.resolve_data_config({}, model=model)
    transform = timm.data.create_transform(**config)
    path = home / "data/digits/val/digit_3/0023.jpg"
    image = transform(Image.open(path).convert("RGB"))[None]
    with torch.no_grad():
        return float(model(image).abs().max())


def _our_model(home):
    cfg = load_cfg(DIGITS_CFG, SMALL)
    model = build_model(cfg).eval()
    avg = torch.load(home / "out/digits/avg_last3.pyth", weights_only=True)
    model.load_state_dict(avg["model_state"])
    return cfg, model


def _images(n, seed=0):
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def test_doc_commands_and_snippet(demo, monkeypatch):
    home, outputs = demo
    assert "the mean of 3 checkpoints" in outputs[0]
    assert "top-1 accuracy:" in outputs[1]
    # The snippet: timm's and onnxruntime's predictions agree on a real digit.
    timm_pred, onnx_pred, diff = re.match(
        r"\[(\d+)\] \[(\d+)\] (\S+)", outputs[-1].strip()
    ).groups()
    assert timm_pred == onnx_pred
    # timm's and onnxruntime's logits are each within logit_tolerance of the
    # model's, at the snippet's image's logit scale.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg, _ = _our_model(home)
    scale = _snippet_logit_scale(home)
    assert float(diff) <= 2 * logit_tolerance(cfg, scale)


def test_timm_loads_the_same_function(demo, monkeypatch):
    import timm

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    home, _ = demo
    cfg, ours = _our_model(home)
    dst = home / "out/digits/export_timm"
    config = json.loads((dst / "config.json").read_text())
    x = _images(4)
    with torch.no_grad():
        expected = ours(x).double()
        scale = expected.abs().max().item()
        tol = logit_tolerance(cfg, scale)
        # The documented way, and the weights file named by pretrained_cfg_overlay.
        by_dir = timm.create_model(f"local-dir:{dst}", pretrained=True).eval()
        by_file = timm.create_model(
            config["architecture"],
            pretrained=True,
            pretrained_cfg_overlay=dict(
                file=str(dst / "model.safetensors"), num_classes=10
            ),
            **config["model_args"],
        ).eval()
        for model in (by_dir, by_file):
            assert (model(x).double() - expected).abs().max().item() <= tol
    assert scale > 0.1  # trained logits, not a zero head
    assert config["pretrained_cfg"]["crop_pct"] == 1.0
    assert config["pretrained_cfg"]["mean"] == [0.485, 0.456, 0.406]


def test_onnx_any_batch_equals_the_model(demo):
    import onnxruntime

    home, _ = demo
    cfg, ours = _our_model(home)
    path = str(home / "out/digits/export_onnx/model.onnx")
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert isinstance(session.get_inputs()[0].shape[0], str)  # symbolic batch
    for n in (1, 5):
        x = _images(n, seed=n)
        with torch.no_grad():
            expected = ours(x).double().numpy()
        got = session.run(["logits"], {"images": x.numpy()})[0]
        assert got.shape == (n, 10) and got.dtype == np.float32
        tol = logit_tolerance(cfg, float(np.abs(expected).max()))
        assert np.abs(got - expected).max() <= tol


def test_model_cards(demo):
    home, _ = demo
    cfg, _ = _our_model(home)
    evaluation = json.loads((home / "out/digits/eval/eval_avg_last3.json").read_text())
    for fmt in ("timm", "onnx"):
        card = (home / f"out/digits/export_{fmt}/README.md").read_text()
        assert evaluation["table"] in card  # test_net's result for this checkpoint
        assert "| val | 10 | 16 | " in card  # its split, classes and size
        assert "model weights of " in card and "(epoch 3/3)" in card
        assert f"| parameters | {complexity(cfg)['params'] / 1e6:.3f} M |" in card
        assert "| 1 | pycls_fast |" in card and "| 32 | timm |" in card
        assert "torch " + torch.__version__ in card
        assert "largest logit difference" in card
        assert "avg_last3.pyth" in card and "NUM_LAYERS: 1" in card


def test_onnx_fixed_batch_and_refusals(demo, tmp_path):
    import onnxruntime

    home, _ = demo
    run = str(home / "out/digits")
    # A --dst ending in .onnx is the file; the model card goes beside it.
    dst = tmp_path / "fixed.onnx"
    result = run_tool("export.py", "--run", run, "--format", "onnx",
                      "--dst", str(dst), "--batch", "4", "--no-throughput")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["fixed.md", "fixed.onnx"]
    assert '"fixed.onnx"' in (tmp_path / "fixed.md").read_text()
    session = onnxruntime.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape[0] == 4
    cfg, _ = _our_model(home)
    weights = torch.load(
        home / "out/digits/checkpoints/model_epoch_0003.pyth", weights_only=True
    )
    ours = build_model(cfg).eval()
    ours.load_state_dict(weights["model_state"])
    x = _images(4)
    with torch.no_grad():
        expected = ours(x).double().numpy()
    got = session.run(["logits"], {"images": x.numpy()})[0]
    assert np.abs(got - expected).max() <= logit_tolerance(
        cfg, float(np.abs(expected).max())
    )
    with pytest.raises(onnxruntime.capi.onnxruntime_pybind11_state.InvalidArgument):
        session.run(["logits"], {"images": _images(2).numpy()})
    result = run_tool("export.py", "--run", run, "--format", "onnx",
                      "--dst", str(tmp_path / "m.safetensors"))  # fmt: skip
    assert result.returncode == 2
    assert "a .safetensors file, but --format onnx" in result.stderr
    # timm's LayerNorm eps is 1e-6: a model trained with another is refused, in one
    # line, before any work.
    eps = str(tmp_path / "eps")
    result = run_tool("export.py", "--run", run, "LN.EPS", "1e-5",
                      "--format", "safetensors", "--dst", eps)  # fmt: skip
    assert result.returncode == 2
    assert "LN.EPS" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "eps").exists()
    for args, text in (
        (["--batch", "0"], "--batch must be >= 1"),
        (["--batch-sizes", "8,x"], "--batch-sizes"),
        (["--weights", run], "not both"),
    ):
        result = run_tool("export.py", "--run", run, "--format", "onnx",
                          "--dst", str(tmp_path / "no"), *args)  # fmt: skip
        assert result.returncode == 2 and text in result.stderr, result.stderr
    assert not (tmp_path / "no").exists()


def test_a_safetensors_dst_is_the_file_with_its_config_and_card_beside(
    demo, tmp_path, monkeypatch
):
    import timm

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    home, _ = demo
    dst = str(tmp_path / "digits.safetensors")
    result = run_tool("export.py", "--run", str(home / "out/digits"),
                      "--format", "safetensors", "--dst", dst,
                      "--no-throughput")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == [
        "digits.json",
        "digits.md",
        "digits.safetensors",
    ]
    # The card's loading snippet, run in the folder, builds the same function.
    card = (tmp_path / "digits.md").read_text()
    snippet = card.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(snippet, scope)
    cfg, _ = _our_model(home)
    ours = build_model(cfg).eval()
    last = torch.load(
        home / "out/digits/checkpoints/model_epoch_0003.pyth", weights_only=True
    )
    ours.load_state_dict(last["model_state"])
    x = _images(2)
    with torch.no_grad():
        expected = ours(x).double()
        got = scope["model"](x).double()
    assert isinstance(scope["model"], timm.models.VisionTransformer)
    assert (got - expected).abs().max().item() <= logit_tolerance(
        cfg, expected.abs().max().item()
    )
