"""export/onnx_format.py: what --format onnx needs is named before any work."""

import importlib.util

import pytest

from pycls_fast.errors import UserError, exit_code
from pycls_fast.export import onnx_format


def test_a_missing_onnx_package_is_named_with_its_install_command(monkeypatch):
    onnx_format.check_onnx_packages()  # the test environment has all three
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "onnxscript" else find_spec(name, *a),
    )
    with pytest.raises(UserError) as e:
        onnx_format.check_onnx_packages()
    assert str(e.value) == (
        "--format onnx needs onnxscript: pip install onnx onnxscript onnxruntime "
        "(or pip install -e '.[export]')"
    )
    assert exit_code(e.value) == 2
