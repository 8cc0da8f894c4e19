"""components/precise_bn.py: pycls's precise BatchNorm statistics, checked against
the batch statistics of the BatchNorm's own inputs."""

import torch

from pycls_fast.components.precise_bn import compute_precise_bn_stats, precise_iters
from pycls_fast.models import build_model
from tests.helpers import EXACT, float64_default, tiny_cfg

CONV = ["VIT.STEM_TYPE", "conv", "VIT.C_STEM_KERNELS", "[3, 3, 1]",
        "VIT.C_STEM_STRIDES", "[2, 2, 2]",
        "VIT.C_STEM_DIMS", "[8, 16, 48]"]  # fmt: skip


def test_running_stats_are_the_average_of_the_batches():
    with float64_default():  # float64: the averages agree with the reference at EXACT
        model = build_model(tiny_cfg(*CONV)).eval()
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    seen = []
    bn.register_forward_hook(lambda m, args, out: seen.append(args[0].double()))
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64) * (i + 1)
        for i in range(5)
    ]
    used = compute_precise_bn_stats(model, iter(batches), num_iter=3)
    assert used == 3 and len(seen) == 3  # only num_iter batches
    assert not model.training and bn.momentum == 0.1  # both restored
    mean = torch.stack([x.mean(dim=(0, 2, 3)) for x in seen]).mean(0)
    # BatchNorm's running var is the unbiased batch variance.
    var = torch.stack([x.var(dim=(0, 2, 3), unbiased=True) for x in seen]).mean(0)
    assert bn.running_mean.dtype == torch.float64
    torch.testing.assert_close(bn.running_mean, mean, **EXACT)
    torch.testing.assert_close(bn.running_var, var, **EXACT)


def test_a_model_without_batch_norm_is_left_alone():
    model = build_model(tiny_cfg())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert compute_precise_bn_stats(model, iter([torch.randn(2, 3, 32, 32)]), 1) == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_iterations_follow_pycls():
    # 8192 samples / (64 per rank x 2 ranks) = 64 batches, at most what there is.
    assert precise_iters(8192, 64, 2, 100) == 64
    assert precise_iters(8192, 64, 2, 10) == 10
    assert precise_iters(10, 64, 2, 10) == 1
