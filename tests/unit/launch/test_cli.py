"""The tools' config loading (launch/cli.py) under a launcher: torchrun's world size
wins over the config's NUM_GPUS, and the documented multi-node commands load."""

import os

import pytest

from benchmarks.ladder_dist import rung_configs
from pycls_fast.config import check_launch
from pycls_fast.errors import ConfigError, UserError
from pycls_fast.launch.cli import cfg_from_args, config_parser, without_wandb
from pycls_fast.launch.submit import job_shape
from tests.helpers import DIGITS_CFG, ROOT, tiny_cfg

VIT_H_14 = os.path.join(ROOT, "configs/vit/ViT-H-14.yaml")
VIT_H_16 = os.path.join(ROOT, "configs/vit/ViT-H-16.yaml")


def _load(monkeypatch, world, *argv):
    """cfg_from_args as train_net calls it, in rank 0 of a torchrun of `world`."""
    if world is None:
        for key in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(key, raising=False)
    else:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world))
    return cfg_from_args(config_parser("test").parse_args(list(argv)))


def test_torchrun_world_wins_over_the_configs_num_gpus(monkeypatch, caplog):
    # docs/DISTRIBUTED.md: 4 nodes x 8 GPUs (torchrun, or sbatch running torchrun)
    # on ViT-H-14.yaml, whose NUM_GPUS is 8.
    with caplog.at_level("WARNING"):
        cfg = _load(
            monkeypatch, 32, "--cfg", VIT_H_14, "FSDP.ENABLED", "True",
            "OUT_DIR", "/shared/out/vit_h14",
        )  # fmt: skip
    assert cfg.NUM_GPUS == 32
    assert "NUM_GPUS 8 of the config is replaced by the launcher's world size, 32" in (
        caplog.text
    )
    assert cfg.TRAIN.BATCH_SIZE // cfg.NUM_GPUS == 32  # global, split over the ranks


def test_tensor_parallel_under_torchrun_with_num_gpus_left_at_1(monkeypatch):
    # docs/DISTRIBUTED.md's rule: leave NUM_GPUS at 1 under torchrun. The check
    # NUM_GPUS % (TP x PP) runs at the launcher's world size.
    cfg = _load(monkeypatch, 2, "--cfg", DIGITS_CFG, "PARALLEL.TP", "2")
    assert cfg.NUM_GPUS == 2 and cfg.PARALLEL.TP == 2
    cfg = _load(
        monkeypatch, 8, "--cfg", DIGITS_CFG, "PARALLEL.TP", "2", "PARALLEL.PP", "2",
        "FSDP.ENABLED", "True", "TRAIN.BATCH_SIZE", "128",
    )  # fmt: skip
    assert cfg.NUM_GPUS == 8
    # Without a launcher NUM_GPUS is the world: one process cannot hold TP 2.
    with pytest.raises(ConfigError, match="must be a multiple of PARALLEL.TP"):
        _load(monkeypatch, None, "--cfg", DIGITS_CFG, "PARALLEL.TP", "2")


def test_the_documented_slurm_command_lays_out_4_nodes(monkeypatch):
    cfg = _load(
        monkeypatch, None, "--cfg", VIT_H_14, "NUM_GPUS", "32", "FSDP.ENABLED", "True",
        "OUT_DIR", "/shared/out/vit_h14", "LAUNCH.MODE", "slurm",
        "LAUNCH.PARTITION", "learnfair", "LAUNCH.GPU_TYPE", "volta32gb",
        "LAUNCH.TIME_LIMIT", "4320", "LAUNCH.NAME", "vit_h14",
    )  # fmt: skip
    check_launch(cfg)
    assert job_shape(cfg) == (4, 8)


def test_the_64_gpu_ladder_batch_splits_over_its_ranks():
    # docs/PERFORMANCE.md: --batch is global; on 64 GPUs it must be a multiple of 64.
    rungs = rung_configs(VIT_H_16, ["AMP.DTYPE", "fp16"], 4480, 64, 256)
    assert {cfg.TRAIN.BATCH_SIZE // cfg.NUM_GPUS for _, _, cfg in rungs} == {70}
    with pytest.raises(ConfigError, match="TRAIN.BATCH_SIZE \\(560\\) must be div"):
        rung_configs(VIT_H_16, ["AMP.DTYPE", "fp16"], 560, 64, 256)


def test_an_evaluation_skips_wandb_and_says_so(capsys, tmp_path):
    """test_net of a LOG_WANDB run needs no W&B login: W&B is left out, said once."""
    cfg = tiny_cfg("LOG_WANDB", "True", "OUT_DIR", str(tmp_path))
    out = without_wandb(cfg)
    assert out.LOG_WANDB is False and out.OUT_DIR == cfg.OUT_DIR
    assert capsys.readouterr().out == (
        "LOG_WANDB: W&B skipped for this evaluation; its records are in "
        f"{tmp_path}/stdout.log\n"
    )
    assert without_wandb(out) is out and capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--opts", "OPTIM.MAX_EPOCH", "1", "OUT_DIR", "/x"],
         "--opts is not needed here: config overrides go as bare KEY VALUE pairs "
         "after the flags: OPTIM.MAX_EPOCH 1 OUT_DIR /x"),
        (["--cfg-options"],
         "--cfg-options is not needed here: config overrides go as bare KEY VALUE "
         "pairs after the flags, e.g. OPTIM.MAX_EPOCH 1"),
        (["--output-dir=/x"],
         "--output-dir is not a flag here; it is the config key OUT_DIR: OUT_DIR /x"),
        (["--bogus"], "unrecognized arguments: --bogus (see test --help)"),
    ],
)  # fmt: skip
def test_argument_mistakes_are_user_errors_of_one_line(argv, message):
    parser = config_parser("test")
    parser.prog = "test"
    with pytest.raises(UserError) as e:
        parser.parse_args(["--cfg", DIGITS_CFG, *argv])
    assert str(e.value) == message


def test_a_tools_own_flag_is_never_taken_for_a_habit():
    parser = config_parser("test")
    parser.add_argument("--out-dir")
    args = parser.parse_args(["--cfg", DIGITS_CFG, "--out-dir", "/x", "A", "1"])
    assert args.out_dir == "/x" and args.opts == ["A", "1"]


def test_a_bug_keeps_its_traceback_a_mistake_is_one_line(capsys):
    from pycls_fast.errors import UserError
    from pycls_fast.launch.cli import run

    def mistake():
        raise UserError("TRAIN.WEIGHTS: checkpoint not found: x.pyth")

    def bug():
        return {}["missing"]

    with pytest.raises(SystemExit) as e:
        run(mistake)
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: TRAIN.WEIGHTS: checkpoint not found: x.pyth\n"
    )
    with pytest.raises(SystemExit) as e:
        run(bug)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "Traceback (most recent call last):"
    assert 'return {}["missing"]' in "\n".join(err)
    assert err[-2:] == ["KeyError: 'missing'", "error: KeyError: 'missing'"]
