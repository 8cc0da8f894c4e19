"""TFLOP/s and MFU from the model's FLOPs: the convention, the peak table, the CPU's
measured peak cached, a stated peak."""

import json

import pytest
import torch

from pycls_fast.observe import throughput
from pycls_fast.observe.throughput import Throughput, device_peak_flops


def test_model_and_hardware_flops_per_device():
    # 1 GMAC forward per image: 2 GFLOP forward, 6 GFLOP for a training image;
    # recomputation adds one forward (2 GFLOP) as hardware FLOPs only.
    model = Throughput(1e9, world_size=4, peak_flops=100e12, recompute=True)
    fields = model.fields(img_per_s=4000.0)  # 1000 images/s per device
    assert fields["tflops"] == pytest.approx(6.0)
    assert fields["hw_tflops"] == pytest.approx(8.0)
    assert fields["mfu"] == pytest.approx(0.06)
    assert fields["hfu"] == pytest.approx(0.08)
    unknown = Throughput(1e9, 1, None).fields(1000.0)
    assert unknown["mfu"] == 0.0 and unknown["tflops"] == pytest.approx(6.0)


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "tf32", 417.5),
        ("NVIDIA H200", "fp16", 989.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA L40S", "bf16", 366.5),
        ("NVIDIA L4", "fp32", 30.3),
        ("NVIDIA A10", "tf32", 62.5),
        ("Tesla V100-SXM2-32GB", "fp16", 125.0),
        ("Tesla V100-SXM2-32GB", "bf16", None),  # no bf16 tensor cores
        ("NVIDIA GeForce GTX 1080", "fp32", None),
    ],
)
def test_peak_table_matches_device_names(name, dtype, peak):
    assert throughput.table_peak_tflops(name, dtype) == peak


def test_cpu_peak_is_measured_once_and_cached(tmp_path):
    first = throughput.cpu_peak_flops(torch.float32, str(tmp_path))
    assert first > 0
    cache = tmp_path / "matmul_peak.json"
    stored = json.loads(cache.read_text())
    assert list(stored.values()) == [first]
    # A planted value is read back, not measured again.
    key = next(iter(stored))
    cache.write_text(json.dumps({key: 123.0}))
    assert throughput.cpu_peak_flops(torch.float32, str(tmp_path)) == 123.0


def test_a_stated_peak_wins_and_the_seeded_stream_is_untouched(tmp_path):
    peak, source = device_peak_flops(torch.device("cpu"), torch.float32, 2.5)
    assert peak == 2.5e12 and source == "MFU.PEAK_TFLOPS"
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    throughput.measure_matmul_flops(torch.float32, size=64, iters=1)
    assert torch.equal(torch.rand(3), expected)
