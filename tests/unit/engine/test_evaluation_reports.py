"""engine/evaluation.py's reports: test_net's records kept per checkpoint (and per
weights: the model's, its EMA's), and found again by the exports' model cards."""

import os

from pycls_fast.engine.evaluation import write_report
from pycls_fast.export.source import find_evaluation


def test_a_checkpoint_and_its_ema_keep_their_own_evaluations(tmp_path):
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "model_epoch_0003.pyth"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"")
    record = {"epoch": "3/3", "split": "val", "im_size": 16, "top5_err": 0.0}
    model = write_report(
        str(run / "eval"), str(checkpoint), [{**record, "top1_err": 30.0}]
    )
    ema = write_report(
        str(run / "eval"), str(checkpoint), [{**record, "top1_err": 9.0}], ema=True
    )
    assert os.path.basename(model) == "eval_model_epoch_0003.json"
    assert os.path.basename(ema) == "eval_model_epoch_0003_ema.json"
    # An export of the EMA weights reads the EMA's evaluation, not the model's.
    found = find_evaluation(str(checkpoint), str(run), ema=True)
    assert found["ema"] and found["records"][0]["top1_err"] == 9.0
    assert find_evaluation(str(checkpoint), str(run))["records"][0]["top1_err"] == 30.0
