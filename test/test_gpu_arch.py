"""engine/cuda/arch.py: what the kernels are built with on each GPU generation (no GPU needed)."""
from __future__ import annotations

import pytest

from vla_edge_ros.engine.cuda.arch import fit_shared_memory, plan_arch
from vla_edge_ros.engine.interface import EngineError


@pytest.mark.parametrize("cc,sm90", [((9, 0), True), ((10, 0), True), ((8, 0), False), ((8, 6), False),
                                     ((8, 7), False), ((8, 9), False)])
def test_device_build_uses_sm90_features_only_on_sm90(cc, sm90):
    a = plan_arch(cc)
    assert a.pdl == sm90
    assert a.build_cc == cc and a.nvcc_arch is None and a.target == "cubin"
    assert ("without" in a.describe()) == (not sm90)


def test_ptx_override_builds_the_older_path_on_a_newer_device():
    a = plan_arch((9, 0), "compute_80")
    assert (a.nvcc_arch, a.target, a.build_cc, a.pdl) == ("compute_80", "ptx", (8, 0), False)
    assert "compute_80 ptx" in a.describe() and "without programmatic dependent launch" in a.describe()
    a = plan_arch((9, 0), " compute_90 ")
    assert a.target == "ptx" and a.pdl
    assert plan_arch((8, 7), "sm_87") == plan_arch((8, 7))  # the device's own cubin


@pytest.mark.parametrize("cc,override,match", [
    ((7, 5), "", "need >= 8.0"),                   # Turing: no bf16 mma
    ((9, 0), "sm_80", "cannot run"),               # a cubin of another architecture
    ((8, 7), "compute_90", "newer architecture"),  # PTX the driver cannot lower
    ((9, 0), "compute_75", "need >= sm_80"),
    ((9, 0), "hopper", "expected compute_XY"),
])
def test_bad_devices_and_overrides_are_refused_with_the_reason(cc, override, match):
    with pytest.raises(EngineError, match=match):
        plan_arch(cc, override)


def test_gemm_v4_moves_off_when_its_shared_memory_does_not_fit():
    uses = {"gateup", "down"}
    assert fit_shared_memory(uses, 147456, 232448) == (uses, "")    # H100 / H200: 227 KB
    assert fit_shared_memory(uses, 147456, 166912) == (uses, "")    # A100 / Jetson Orin: 163 KB
    kept, note = fit_shared_memory(uses, 147456, 101376)            # RTX 30/40, L4: 99 KB
    assert kept == set() and "down, gateup" in note and "101376" in note and "split-K gemm32" in note
    assert fit_shared_memory(set(), 147456, 101376) == (set(), "")
