"""Which GPU features the CUDA kernels may use on a given device: decided without PyCUDA, so it is unit-tested on
machines without a GPU.

The kernels are tuned on sm_90 (H100 / H200) and also build for sm_80 .. sm_89: A100 (8.0), RTX 30 / A-series (8.6),
Jetson AGX / Orin NX (8.7), RTX 40 / L4 / L40 (8.9), the GPUs robots carry. Below sm_90 programmatic dependent
launch (``griddepcontrol``) is missing: cuda/common.cuh compiles ``pdl_wait`` / ``pdl_trigger`` to nothing there,
which is what they mean without the launch attribute, and the host launches without it (+2.2 ms per chunk when this
build runs on an H200).

Shared memory per block also differs (sm_80 / sm_87 / sm_90: 163-227 KB opt-in, sm_86 / sm_89: 99 KB):
``fit_shared_memory`` moves the prefill GEMMs whose ``gemm32v4`` needs more than the device has onto the split-K
``gemm32`` (it needs no large shared memory), and says so.

``VLA_CUDA_ARCH=compute_80`` (or any ``compute_XY`` not above the device) builds the kernels as PTX for that
architecture and lets the driver compile it for the device: the pre-Hopper code paths, checked on an H200.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from vla_edge_ros.engine.interface import EngineError

MIN_CC = (8, 0)  # bf16 mma.sync, cp.async
HOPPER = (9, 0)  # griddepcontrol (PDL)

_ARCH_RE = re.compile(r"^(sm|compute)_(\d)(\d+)$")


@dataclass(frozen=True)
class ArchPlan:
    device_cc: tuple[int, int]
    build_cc: tuple[int, int]  # what the kernels are compiled for (the device's own unless overridden)
    nvcc_arch: str | None      # PyCUDA compile(arch=...): None = the device's own sm_XY
    target: str                # "cubin", or "ptx" (the driver compiles it for the device at load time)
    pdl: bool                  # kernels may be launched with programmatic dependent launch

    def describe(self) -> str:
        built = (f"built as {self.nvcc_arch} {self.target}" if self.nvcc_arch
                 else f"built for sm_{self.build_cc[0]}{self.build_cc[1]}")
        return built + ("" if self.pdl else "; without programmatic dependent launch (an sm_90 feature)")


def plan_arch(device_cc: tuple[int, int], override: str = "") -> ArchPlan:
    """What to build for a device of compute capability ``device_cc``; ``override`` is VLA_CUDA_ARCH."""
    device_cc = (int(device_cc[0]), int(device_cc[1]))
    if device_cc < MIN_CC:
        raise EngineError(f"compute capability {device_cc[0]}.{device_cc[1]}: the kernels need >= "
                          f"{MIN_CC[0]}.{MIN_CC[1]} (bf16 tensor cores, cp.async)")
    override = (override or "").strip()
    nvcc_arch, target, build_cc = None, "cubin", device_cc
    if override:
        m = _ARCH_RE.match(override)
        if not m:
            raise EngineError(f"VLA_CUDA_ARCH={override!r}: expected compute_XY (PTX, compiled by the driver) or "
                              "sm_XY (the device's own)")
        kind, cc = m.group(1), (int(m.group(2)), int(m.group(3)))
        if cc < MIN_CC:
            raise EngineError(f"VLA_CUDA_ARCH={override}: the kernels need >= sm_{MIN_CC[0]}{MIN_CC[1]}")
        if kind == "sm" and cc != device_cc:
            raise EngineError(f"VLA_CUDA_ARCH={override}: a cubin for {override} cannot run on this "
                              f"sm_{device_cc[0]}{device_cc[1]} device; use compute_{m.group(2)}{m.group(3)} (PTX)")
        if kind == "compute" and cc > device_cc:
            raise EngineError(f"VLA_CUDA_ARCH={override}: PTX for a newer architecture than this "
                              f"sm_{device_cc[0]}{device_cc[1]} device does not load")
        if kind == "compute":
            nvcc_arch, target = override, "ptx"
        build_cc = cc
    return ArchPlan(device_cc, build_cc, nvcc_arch, target, pdl=build_cc >= HOPPER)


def fit_shared_memory(gemm_v4_uses: set[str], g4_smem: int, optin: int) -> tuple[set[str], str]:
    """The prefill GEMMs that stay on gemm32v4 (g4_smem bytes of dynamic shared memory per block) on a device
    that allows ``optin`` bytes per block, and a note for the log ("" when nothing moved)."""
    if g4_smem <= optin or not gemm_v4_uses:
        return set(gemm_v4_uses), ""
    moved = ", ".join(sorted(gemm_v4_uses))
    return set(), (f"gemm_v4 ({moved}) needs {g4_smem} B of shared memory per block, this device allows {optin}: "
                   "those prefill GEMMs use the split-K gemm32 instead")
