"""Every cuda/*.cu compiles with nvcc (no GPU needed; skipped when nvcc is not on PATH), once per file for all the
architectures the engine builds for: Hopper (sm_90, where the kernels are tuned) and the pre-Hopper GPUs robots
carry, built without PDL (engine/cuda/arch.py): A100 (sm_80), Jetson Orin (sm_87), RTX 40 / L4 (sm_89). This is
the project's only compile check (the Makefile's test-cuda-compile runs this file).

From ptxas's report, per architecture: every kernel of the table (engine/cuda/kernels.py) is an entry of the file,
none spills to local memory; the tensor-core files contain HMMA instructions (when cuobjdump is available).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from vla_edge_ros.engine.cuda.kernels import BENCH_KERNELS, BENCH_KERNEL_FILES, KERNEL_FILES, KERNELS
from vla_edge_ros.engine.cuda.probe import CUDA_DIR

# $NVCC (the Makefile passes its own), else nvcc on PATH, else the CUDA toolkit's default place
NVCC = (os.environ.get("NVCC") or shutil.which("nvcc")
        or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None))
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
ARCHS = ("sm_90", "sm_80", "sm_87", "sm_89")
MAX_SPILL_BYTES = 0  # at 617beaf only the removed non-default prefill attention spilled (24 B on sm_80)


def test_kernel_file_list_matches_directory():
    assert sorted(p.name for p in SOURCES) == sorted(KERNEL_FILES + BENCH_KERNEL_FILES)


def _ptxas(src: Path, out: Path, archs=ARCHS, defines=()) -> dict[str, dict[str, tuple[int, int]]]:
    """Compile ``src`` for ``archs``; per architecture, kernel -> (registers, spill-store bytes) from ptxas -v."""
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    proc = subprocess.run([NVCC, "-fatbin", *gencode, "-O3", "-std=c++17", "-I", str(CUDA_DIR), "-Xptxas", "-v",
                           *("-D" + d for d in defines), "-o", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0
    # ptxas: "Compiling entry function 'NAME' for 'sm_XY'", then "N bytes spill stores", then "Used R registers"
    report: dict[str, dict[str, tuple[int, int]]] = {a: {} for a in archs}
    entry, spill = None, None
    for line in proc.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line)
        if m:
            entry, spill = m.groups(), None
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and entry is not None:
            spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and entry is not None and spill is not None:
            report[entry[1]][entry[0]] = (int(m.group(1)), spill)
            entry = None
    return report


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_compiles_for_every_architecture(src: Path, tmp_path):
    out = tmp_path / (src.stem + ".fatbin")
    report = {a: {k: spill for k, (_, spill) in r.items()} for a, r in _ptxas(src, out).items()}
    want = {k.name for k in KERNELS + BENCH_KERNELS if k.file == src.name}
    for arch in ARCHS:
        assert set(report[arch]) == want, (arch, sorted(report[arch]))
        spilling = {k: v for k, v in report[arch].items() if v > MAX_SPILL_BYTES}
        assert not spilling, (arch, spilling)
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump and src.name in ("gemm_skinny.cu", "rope_attention.cu"):
        sass = subprocess.run([cuobjdump, "--dump-sass", str(out)], capture_output=True, text=True).stdout
        assert sass.count("HMMA") > 0, "tensor-core kernels without HMMA instructions"


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_the_int4_gemv_occupancy_knobs_compile_and_fit_two_blocks(tmp_path):
    """cuda/gemv_quant.cu's measuring knobs (docs/KERNEL_NOTES.md, session 29) still build for every architecture:
    GEMV_U_I4=2 holds every int4 GEMV at <= 128 registers without spilling (two 256-thread blocks per SM, where the
    default's 173-181 hold one), and the __launch_bounds__ forms cap the registers where they say."""
    src = CUDA_DIR / "gemv_quant.cu"
    int4 = {"gemv_qkv_i4", "gemv_resid_i4", "gemv_gateup_i4"}
    u2 = _ptxas(src, tmp_path / "u2.fatbin", defines=("GEMV_U_I4=2",))
    for arch in ARCHS:
        assert {k: u2[arch][k] for k in int4} == {k: (u2[arch][k][0], 0) for k in int4}, (arch, u2[arch])
        assert all(u2[arch][k][0] <= 128 for k in int4), (arch, u2[arch])
    minb = _ptxas(src, tmp_path / "minb.fatbin", archs=("sm_90",),
                  defines=("GEMV_MINB_I4=2", "GEMV_MINB_I8=3", "GEMV_MINB_F8=3"))["sm_90"]
    assert all(minb[k][0] <= 128 for k in int4), minb
    assert all(regs <= 80 for k, (regs, _) in minb.items() if k.endswith(("_i8", "_f8"))), minb
