"""launch/submit.py's pure pieces: the job's shape and submitit parameters from pycls's
LAUNCH keys, and each task's torch.distributed environment."""

import os

import pytest

from pycls_fast.config import load_cfg
from pycls_fast.errors import ConfigError
from pycls_fast.launch.submit import job_parameters, job_shape, rank_environment
from tests.helpers import ROOT, tiny_cfg


def _cfg(*opts):
    return tiny_cfg("TRAIN.BATCH_SIZE", "384", "TEST.BATCH_SIZE", "384", *opts)


@pytest.mark.parametrize(
    "gpus,per_node,shape",
    [(1, 8, (1, 1)), (2, 8, (1, 2)), (8, 8, (1, 8)), (16, 8, (2, 8)), (64, 8, (8, 8)),
     (4, 2, (2, 2))],
)  # fmt: skip
def test_nodes_are_num_gpus_over_gpus_per_node(gpus, per_node, shape):
    cfg = _cfg("NUM_GPUS", str(gpus), "MAX_GPUS_PER_NODE", str(per_node))
    assert job_shape(cfg) == shape


def test_a_partial_last_node_is_refused():
    cfg = _cfg("NUM_GPUS", "32", "MAX_GPUS_PER_NODE", "12", "LAUNCH.MODE", "slurm")
    with pytest.raises(ConfigError, match="multiple of MAX_GPUS_PER_NODE"):
        job_shape(cfg)


def test_slurm_parameters_follow_pycls_launch_keys():
    cfg = _cfg(
        "NUM_GPUS", "16", "LAUNCH.MODE", "slurm", "LAUNCH.NAME", "vit_h",
        "LAUNCH.PARTITION", "learnfair", "LAUNCH.GPU_TYPE", "volta32gb",
        "LAUNCH.CPUS_PER_GPU", "10", "LAUNCH.MEM_PER_GPU", "60",
        "LAUNCH.TIME_LIMIT", "4200", "LAUNCH.COMMENT", "deadline",
        "LAUNCH.EMAIL", "me@example.org", "LAUNCH.SIGNAL_DELAY_S", "300",
    )  # fmt: skip
    assert job_parameters(cfg) == {
        "timeout_min": 4200, "nodes": 2, "tasks_per_node": 8, "gpus_per_node": 8,
        "name": "vit_h", "cpus_per_task": 10, "mem_gb": 480,
        "slurm_partition": "learnfair", "slurm_signal_delay_s": 300,
        "slurm_comment": "deadline", "slurm_constraint": "volta32gb",
        "slurm_additional_parameters": {
            "mail-user": "me@example.org", "mail-type": "END,FAIL"
        },
    }  # fmt: skip


def test_cpu_partitions_and_the_local_executor_ask_for_no_gpus():
    cpu = _cfg("NUM_GPUS", "2", "LAUNCH.MODE", "slurm", "LAUNCH.CPU_ONLY", "True")
    params = job_parameters(cpu)
    assert "gpus_per_node" not in params and "slurm_constraint" not in params
    assert params["tasks_per_node"] == 2
    local = _cfg("NUM_GPUS", "2", "LAUNCH.MODE", "submitit_local",
                 "LAUNCH.CPU_ONLY", "True", "LAUNCH.TIME_LIMIT", "30")  # fmt: skip
    assert job_parameters(local) == {
        "timeout_min": 30,
        "nodes": 1,
        "tasks_per_node": 2,
        "signal_delay_s": 120,
    }


def test_each_task_is_one_rank_of_the_job():
    env = rank_environment("4242", 9, 1, 16, 2, "node-a")
    assert env["RANK"] == "9" and env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == "16" and env["LOCAL_WORLD_SIZE"] == "8"
    assert env["MASTER_ADDR"] == "node-a"
    # The port comes from the job id: two jobs on one node do not collide.
    ports = {rank_environment(j, 0, 0, 1, 1, "n")["MASTER_PORT"] for j in ("1", "2")}
    # Below the ephemeral range (32768+), where outgoing connections take ports.
    assert len(ports) == 2 and all(10000 <= int(p) < 30000 for p in ports)


def test_slurm_defaults_are_the_clusters_and_extra_sbatch_args_pass():
    extra = "['account=vision', 'qos=high', 'exclusive']"
    cfg = _cfg("NUM_GPUS", "8", "LAUNCH.MODE", "slurm", "LAUNCH.SBATCH_ARGS", extra)
    params = job_parameters(cfg)
    # No partition, memory or constraint: what the cluster defaults to.
    for key in ("slurm_partition", "mem_gb", "slurm_constraint"):
        assert key not in params, key
    assert params["slurm_additional_parameters"] == {
        "account": "vision", "qos": "high", "exclusive": True,
    }  # fmt: skip


def test_pycls_fair_launch_values_still_load():
    cfg = load_cfg(os.path.join(ROOT, "configs/launch/pycls_fair.yaml"),
                   ["LAUNCH.MODE", "slurm", "NUM_GPUS", "8"])  # fmt: skip
    params = job_parameters(cfg)
    assert params["slurm_partition"] == "devlab"
    assert params["slurm_constraint"] == "volta" and params["mem_gb"] == 480


def test_bad_sbatch_args_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="LAUNCH.SBATCH_ARGS"):
        _cfg("LAUNCH.SBATCH_ARGS", "['--account vision']")
