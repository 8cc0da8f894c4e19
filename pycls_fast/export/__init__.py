"""Export: a trained checkpoint in the formats other tools load.

    source.py       the checkpoint and config to export (a run or a weights file)
    timm_format.py  safetensors with timm's names + timm's config.json (local-dir:)
    onnx_format.py  ONNX through torch's exporter, checked with onnxruntime on the CPU
    model_card.py   README.md beside the export: config, metrics, complexity, speed

The layer above engine/ (it reads test_net's reports and times inference with
engine/inference.py); tools/export.py is its command line.
"""
