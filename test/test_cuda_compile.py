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


def _ptx(src: Path, out: Path, defines=()) -> str:
    """``src``'s sm_90 PTX (what the quantised GEMMs' and the PACK_CVT knob's instruction checks read)."""
    proc = subprocess.run([NVCC, "-ptx", "-arch=sm_90", "-O3", "-std=c++17", "-I", str(CUDA_DIR),
                           *("-D" + d for d in defines), "-o", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out.read_text()


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
def test_the_int4_gemvs_fit_two_blocks_per_sm_and_the_occupancy_knobs_compile(tmp_path):
    """Every int4 decode GEMV stays at <= 128 registers without spilling on every architecture: two 256-thread blocks
    per SM (GEMV_U_I4 = 2, wtype.cuh; with the 3 loads per row of before, ptxas took 173-181 registers, one block,
    and the 7-pass int4 chunk was 11.92 ms against 10.57 on an H100, docs/KERNEL_NOTES.md session 29). The measuring
    knobs still build: the old form (GEMV_U_I4=3) and __launch_bounds__ caps for int8 / fp8 (GEMV_MINB_*=3). (int8 /
    fp8 warps of 2 rows x 3 loads, 64 registers and four blocks per SM, measured slower: KERNEL_NOTES session 30.)"""
    src = CUDA_DIR / "gemv_quant.cu"
    int4 = {"gemv_qkv_i4", "gemv_resid_i4", "gemv_gateup_i4"}
    default = _ptxas(src, tmp_path / "default.fatbin")
    for arch in ARCHS:
        assert all(default[arch][k][0] <= 128 and default[arch][k][1] == 0 for k in int4), (arch, default[arch])
    old = _ptxas(src, tmp_path / "u3.fatbin", archs=("sm_90",), defines=("GEMV_U_I4=3",))["sm_90"]
    assert all(old[k][0] > 128 for k in int4), old  # what the default avoids (and what makes this test able to fail)
    minb = _ptxas(src, tmp_path / "minb.fatbin", archs=("sm_90",),
                  defines=("GEMV_MINB_I8=3", "GEMV_MINB_F8=3"))["sm_90"]
    assert all(regs <= 80 for k, (regs, _) in minb.items() if k.endswith(("_i8", "_f8"))), minb


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_the_int4_prefill_pair_knob_builds_without_spills_on_every_architecture(tmp_path):
    """GEMM_I4_PAIR=1 (cuda/gemm_quant.cu: int4 gemm32v4 lanes load 8 bytes, two k32 steps, where the default loads 4)
    builds every int4 skinny GEMM without spilling, and holds fewer registers than the default (one group's scale
    and zero point per pair of steps instead of per step): the knob compiles what it claims to change."""
    src = CUDA_DIR / "gemm_quant.cu"
    v4 = {"gemm32v4_atomic_i4", "gemm32v4_silu_i4"}
    default = _ptxas(src, tmp_path / "default.fatbin", archs=("sm_90",))["sm_90"]
    pair = _ptxas(src, tmp_path / "pair.fatbin", defines=("GEMM_I4_PAIR=1",))
    for arch in ARCHS:
        assert all(pair[arch][k][1] == 0 for k in pair[arch]), (arch, pair[arch])
    assert all(pair["sm_90"][k][0] < default[k][0] for k in v4), (pair["sm_90"], default)
    assert {k: pair["sm_90"][k] for k in default if not k.endswith("_i4")} == \
        {k: v for k, v in default.items() if not k.endswith("_i4")}  # the other types' kernels untouched


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_the_int4_half_load_gemv_knob_builds_two_blocks_per_sm_on_every_architecture(tmp_path):
    """GEMV_HALF_I4=1 (wtype.cuh: int4 GEMV lanes load 8 bytes, 3 per row in flight, where the default loads 16, 2 per
    row) keeps the int4 GEMVs at <= 128 registers without spilling everywhere (two blocks per SM, as the default)
    and changes no other weight type's kernel."""
    src = CUDA_DIR / "gemv_quant.cu"
    default = _ptxas(src, tmp_path / "default.fatbin", archs=("sm_90",))["sm_90"]
    half = _ptxas(src, tmp_path / "half.fatbin", defines=("GEMV_HALF_I4=1",))
    for arch in ARCHS:
        assert all(r <= 128 and spill == 0 for k, (r, spill) in half[arch].items() if k.endswith("_i4")), \
            (arch, half[arch])
    assert {k: v for k, v in half["sm_90"].items() if not k.endswith("_i4")} == \
        {k: v for k, v in default.items() if not k.endswith("_i4")}


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_the_quantised_prefill_gemms_round_their_weights_with_the_conversion_instruction(tmp_path):
    """Every quantised skinny GEMM (int8 / fp8 / int4) turns its dequantised weights into bf16 pairs with
    cvt.rn.bf16x2.f32, not with common.cuh's integer rounding (its `+ 0x7fff` carry add), which was most of their
    instructions: the int8 / fp8 prefill 22 % slower (docs/KERNEL_NOTES.md, session 31). The atomic forms have no
    bf16 epilogue, so any 32767 in them is the integer rounding come back; the bf16 GEMMs convert nothing."""
    ptx = _ptx(CUDA_DIR / "gemm_quant.cu", tmp_path / "gemm_quant.ptx")
    bodies = dict(re.findall(r"\.entry (\w+)\((.*?)\n\}\n", ptx, re.S))
    quantised = {k for k in KERNELS if k.file == "gemm_quant.cu"}
    assert {k.name for k in quantised} <= set(bodies)
    for k in quantised:
        assert "cvt.rn.bf16x2.f32" in bodies[k.name], k.name
        if "atomic" in k.name:
            assert "32767" not in bodies[k.name], k.name


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_the_hardware_bf16_rounding_knob_builds_the_attention_without_spills_on_every_architecture(tmp_path):
    """PACK_CVT=1 (common.cuh: pack_bf16x2 / f32_to_bf16 by cvt.rn.bf16[x2].f32) builds the attention kernels on
    every architecture without spilling, with every table kernel present, and the conversions do reach them (the
    default build has no cvt.rn.bf16x2 in rope_attention.cu at all: what makes this test able to fail)."""
    src = CUDA_DIR / "rope_attention.cu"
    report = _ptxas(src, tmp_path / "cvt.fatbin", defines=("PACK_CVT=1",))
    want = {k.name for k in KERNELS if k.file == src.name}
    for arch in ARCHS:
        assert want <= set(report[arch]) and all(spill == 0 for _, spill in report[arch].values()), (arch, report[arch])
    assert "cvt.rn.bf16x2.f32" not in _ptx(src, tmp_path / "default.ptx")
    assert _ptx(src, tmp_path / "cvt.ptx", ("PACK_CVT=1",)).count("cvt.rn.bf16x2.f32") > 10


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_the_denormal_code_gemv_knob_builds_with_fewer_registers_and_no_spills_on_every_architecture(tmp_path):
    """GEMV_DENORM=1 (wtype.cuh: int8 / int4 GEMV codes as denormal floats against a vector scaled by 2^100, one FADD
    a weight fewer) builds every quantised GEMV without spilling, int8 / int4 at <= 128 registers (two blocks per
    SM), fp8's kernels as the default's; the int4 GEMVs hold fewer registers than the default's 127-128 (the biased
    floats gone: what makes this test able to fail if the knob stops reaching them)."""
    src = CUDA_DIR / "gemv_quant.cu"
    default = _ptxas(src, tmp_path / "default.fatbin", archs=("sm_90",))["sm_90"]
    den = _ptxas(src, tmp_path / "den.fatbin", defines=("GEMV_DENORM=1",))
    for arch in ARCHS:
        assert all(spill == 0 for _, spill in den[arch].values()), (arch, den[arch])
        assert all(r <= 128 for k, (r, _) in den[arch].items() if k.endswith(("_i8", "_i4"))), (arch, den[arch])
    assert {k: v for k, v in den["sm_90"].items() if k.endswith("_f8")} == \
        {k: v for k, v in default.items() if k.endswith("_f8")}
    assert all(den["sm_90"][k][0] < default[k][0] for k in ("gemv_gateup_i4", "gemv_resid_i4", "gemv_qkv_i4"))
