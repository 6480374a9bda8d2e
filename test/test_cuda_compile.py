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


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_compiles_for_every_architecture(src: Path, tmp_path):
    out = tmp_path / (src.stem + ".fatbin")
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHS]
    proc = subprocess.run([NVCC, "-fatbin", *gencode, "-O3", "-std=c++17", "-I", str(CUDA_DIR), "-Xptxas", "-v",
                           "-o", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0
    # ptxas: "Compiling entry function 'NAME' for 'sm_XY'", then its "N bytes spill stores"
    report: dict[str, dict[str, int]] = {a: {} for a in ARCHS}
    entry = None
    for line in proc.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line)
        if m:
            entry = m.groups()
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and entry is not None:
            report[entry[1]][entry[0]] = int(m.group(1))
            entry = None
    want = {k.name for k in KERNELS + BENCH_KERNELS if k.file == src.name}
    for arch in ARCHS:
        assert set(report[arch]) == want, (arch, sorted(report[arch]))
        spilling = {k: v for k, v in report[arch].items() if v > MAX_SPILL_BYTES}
        assert not spilling, (arch, spilling)
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump and src.name in ("gemm_skinny.cu", "rope_attention.cu"):
        sass = subprocess.run([cuobjdump, "--dump-sass", str(out)], capture_output=True, text=True).stdout
        assert sass.count("HMMA") > 0, "tensor-core kernels without HMMA instructions"
