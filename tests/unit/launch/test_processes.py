"""launch/processes.py's words: a rank killed by SIGKILL is said to be most likely
out of memory; more CPU ranks than cores are warned of before they start."""

import os

from pycls_fast.launch.processes import killed_message, warn_cpu_oversubscription


def test_sigkill_is_said_to_be_likely_out_of_memory():
    assert "most likely out of memory" in killed_message(1, "SIGKILL")
    assert killed_message(0, "SIGTERM") == (
        "rank 0 was killed by SIGTERM; the other ranks were stopped"
    )


def test_more_cpu_ranks_than_cores_are_warned_of(capsys):
    cores = len(os.sched_getaffinity(0))
    warn_cpu_oversubscription(cores, gpus=False)
    assert capsys.readouterr().err == ""
    warn_cpu_oversubscription(cores + 1, gpus=False)
    err = capsys.readouterr().err
    assert (
        f"NUM_GPUS {cores + 1} starts {cores + 1} CPU processes on {cores} core" in err
    )
    warn_cpu_oversubscription(cores + 1, gpus=True)
    assert capsys.readouterr().err == ""


SLURM_VARS = ("SLURM_CPUS_PER_TASK", "SLURM_STEP_TASKS_PER_NODE",
              "SLURM_TASKS_PER_NODE", "SLURM_NODEID")  # fmt: skip


def test_cpu_threads_are_the_ranks_share_of_its_cpus(monkeypatch):
    from pycls_fast.launch.processes import cpu_threads

    for key in SLURM_VARS:
        monkeypatch.delenv(key, raising=False)
    cores = len(os.sched_getaffinity(0))
    # A local spawn or torchrun: the node's ranks share the cores.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cpu_threads() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))
    assert cpu_threads() == 1
    # LAUNCH.MODE slurm: every rank is a task of 10 CPUs (8 tasks on node 1 of 2).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "10")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "8(x2)")
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert cpu_threads() == 10
    # sbatch running torchrun: one task of 80 CPUs per node runs the 8 ranks.
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "80")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x2)")
    assert cpu_threads() == 10
    # Uneven steps are read per node; an unreadable one falls back to the cores.
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1,8")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "10")
    assert cpu_threads() == 10
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert cpu_threads() == 1
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "weird")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cpu_threads() == cores


def test_ports_are_not_drawn_from_the_seeded_random_module():
    """seed_everything seeds `random` with RNG_SEED: two jobs of one seed on a node
    (parallel tests, a sweep's runs) must still draw different ports."""
    import random

    from pycls_fast.config import get_cfg
    from pycls_fast.launch.processes import _free_port

    cfg = get_cfg()
    draws = []
    for _ in range(3):
        random.seed(0)
        draws.append(_free_port(cfg))
    lo, hi = cfg.PORT_RANGE
    assert all(lo <= p <= hi for p in draws)
    # Three equal draws from 55,001 ports: a chance of 3e-10 unless seeded.
    assert len(set(draws)) > 1
