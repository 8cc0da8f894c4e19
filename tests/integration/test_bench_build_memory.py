"""benchmarks/build_memory.py on 2 gloo ranks of a small ViT: the tensors' bytes it
reports next to resident memory are the rank's shards (values, never timings)."""

import json

from tests.helpers import run_benchmark

SMALL = ["VIT.NUM_LAYERS", "4", "VIT.HIDDEN_DIM", "256", "VIT.MLP_DIM", "1024",
         "VIT.NUM_HEADS", "4", "MODEL.NUM_CLASSES", "10"]  # fmt: skip


def test_tensor_bytes_are_the_ranks_shards(tmp_path):
    out = tmp_path / "build.json"
    result = run_benchmark(
        "build_memory", "--cfg", "configs/vit/ViT-B-16.yaml", "--im-size", "32",
        "--json-out", str(out), *SMALL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[tensors]" in result.stdout
    ranks = json.loads(out.read_text())["ranks"]
    # FSDP pads every rank's shard storage to the largest one's.
    padded = max(r["held"]["params"] for r in ranks)
    for r in ranks:
        params, whole = r["held"]["params"], r["whole_fp32_bytes"]
        # Built: its parameter shard (about half the model) and a few scalars; the
        # meta model it was built from holds nothing.
        assert params <= r["built_tensor_bytes"] <= padded + 4096
        assert 0.45 * whole < params < 0.55 * whole
        # Building: the shard and the full tensors being cut, never the model.
        assert r["built_tensor_bytes"] <= r["build_tensor_peak"] < 0.75 * whole
        # The step adds at least the gradients' shard (fp32, as the parameters).
        assert r["step_tensor_peak"] >= 2 * params
