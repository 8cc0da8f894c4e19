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
