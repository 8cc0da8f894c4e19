"""`make test-intel-mkl`'s shim does what it claims: MKL runs Intel's AVX-512 kernels
under it, and (off Intel) those kernels sum in another order than the native ones, so
the suite under the shim is a run on an Intel Xeon's fp32 matmuls."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import MKL_AVX512_BRANCHES, MKL_COMPATIBLE, ROOT, one_thread_env

SHIM_SOURCE = os.path.join(ROOT, "tests/cpu_kinds/mkl_intel_path.c")

# One fp32 matmul whose reduction (512 long) MKL blocks differently per branch; the
# digest of its bits tells two kernel branches apart.
PROBE = """
import hashlib, json, torch
from tests.helpers import mkl_branch
g = torch.Generator().manual_seed(0)
a = torch.randn(64, 512, generator=g)
b = torch.randn(512, 64, generator=g)
digest = hashlib.sha1((a @ b).numpy().tobytes()).hexdigest()
print(json.dumps({"branch": mkl_branch(), "digest": digest}))
"""


def _cpu_info() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _probe(preload: str | None) -> dict:
    env = one_thread_env()
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = preload
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_shim_runs_intels_avx512_kernels(tmp_path):
    cpuinfo = _cpu_info()
    if "avx512f" not in cpuinfo:
        pytest.skip("no AVX-512 on this CPU: MKL has no Intel AVX-512 branch to take")
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build the MKL shim")
    shim = tmp_path / "mkl_intel_path.so"
    build = ["cc", "-shared", "-fPIC", "-O2", "-o", str(shim), SHIM_SOURCE]
    subprocess.run(build, check=True)

    native, shimmed = _probe(None), _probe(str(shim))
    if native["branch"] is None:
        pytest.skip("this torch build has no MKL inside")
    assert shimmed["branch"] in MKL_AVX512_BRANCHES, shimmed
    if "GenuineIntel" in cpuinfo:
        # An Intel CPU already runs that branch: the shim changes nothing.
        assert shimmed == native
    else:
        # Another vendor's CPU: MKL's generic code natively, other sums under the shim.
        assert native["branch"] == MKL_COMPATIBLE, native
        assert shimmed["digest"] != native["digest"]
