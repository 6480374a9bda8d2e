"""tools/sass_counts.py: the per-kernel instruction mix read from nvdisasm's SASS (the parser on a canned listing;
the whole tool when nvcc and nvdisasm are both here)."""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "sass_counts.py"
_spec = importlib.util.spec_from_file_location("sass_counts", TOOL)
sass_counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_counts)

LISTING = """
//--------------------- .text.gemv_gateup_i4      --------------------------
	.section	.text.gemv_gateup_i4,"ax",@progbits
.text.gemv_gateup_i4:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*04e0*/                   LDG.E.CONSTANT R84, desc[UR6][R84.64] ;
        /*0510*/                   LDG.E.U8.CONSTANT R15, desc[UR6][R14.64] ;
        /*0730*/                   I2FP.F32.U32 R15, R15 ;
        /*0c20*/              @!P2 LDG.E.U16.CONSTANT R64, desc[UR6][R64.64] ;
        /*0dd0*/                   ACQBULK ;
        /*1150*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_12:
        /*1160*/               @P0 BRA `(.L_x_12) ;
//--------------------- .text.gemm32_atomic_i8      --------------------------
.text.gemm32_atomic_i8:
        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0010*/                   F2FP.BF16.F32.PACK_AB R3, R2, R1 ;
        /*0020*/                   EXIT ;
"""


def test_the_parser_counts_base_opcodes_per_kernel_with_predicates_and_without_labels():
    counts = sass_counts.parse_sass(LISTING)
    assert set(counts) == {"gemv_gateup_i4", "gemm32_atomic_i8"}
    assert counts["gemv_gateup_i4"] == {"LDC": 1, "LDG": 3, "I2FP": 1, "ACQBULK": 1, "BAR": 1, "BRA": 1}
    assert counts["gemm32_atomic_i8"] == {"HMMA": 1, "F2FP": 1, "EXIT": 1}


def test_the_report_filters_kernels_and_shows_the_base_counts_beside():
    now = sass_counts.parse_sass(LISTING)
    base = {"gemv_gateup_i4": sass_counts.collections.Counter({"LDG": 5, "I2FP": 4})}
    text = sass_counts.report(now, base, "_i4$", top=2)
    assert text.splitlines()[0] == "gemv_gateup_i4: 8 instructions (base 9)"
    assert text.splitlines()[1] == "    LDG 3 (5), LDC 1 (0)"
    assert "gemm32" not in text
    assert sass_counts.report(now, None, "nothing", 3) == "no kernel matches 'nothing'"


@pytest.mark.skipif(not (shutil.which("nvcc") and (os.environ.get("NVDISASM") or shutil.which("nvdisasm"))),
                    reason="needs nvcc and nvdisasm")
def test_the_tool_counts_the_quantised_gemms_conversions(capsys):
    sass_counts.main([str(TOOL.parents[1] / "cuda" / "gemm_quant.cu"), "--kernels", "^gemm32_atomic_i8$"])
    out = capsys.readouterr().out
    assert out.startswith("gemm32_atomic_i8: ") and "F2FP" in out and "HMMA" in out
