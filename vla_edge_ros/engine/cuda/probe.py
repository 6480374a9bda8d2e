"""Can the CUDA engine run here, and where are its kernel sources?

PyCUDA is imported lazily and every failure becomes a reason string: backend selection (engine/factory.py) must work
on a machine without a driver, and an operator must be told why the GPU path was not taken.
"""
from __future__ import annotations

import os
from pathlib import Path


def _find_cuda_dir() -> Path:
    """$VLA_CUDA_DIR, else the source tree's cuda/, else the installed share/vla_edge_ros/cuda (colcon)."""
    if os.environ.get("VLA_CUDA_DIR"):
        return Path(os.environ["VLA_CUDA_DIR"])
    here = Path(__file__).resolve().parents[3] / "cuda"
    if here.is_dir():
        return here
    try:
        from ament_index_python.packages import get_package_share_directory
        return Path(get_package_share_directory("vla_edge_ros")) / "cuda"
    except Exception:  # not installed through ament: report the source-tree path in the error
        return here


CUDA_DIR = _find_cuda_dir()
MIN_CC = (8, 0)  # bf16 tensor cores (mma.sync), cp.async

_status: tuple[bool, str] | None = None


def cuda_status() -> tuple[bool, str]:
    """(usable, reason). Imports PyCUDA lazily; never raises; the answer is cached."""
    global _status
    if _status is None:
        _status = _probe()
    return _status


def _probe() -> tuple[bool, str]:
    try:
        import pycuda.driver as cuda  # ImportError without libcuda
    except ImportError as exc:
        return False, f"PyCUDA not importable: {exc}"
    except Exception as exc:  # a broken install must not break backend selection
        return False, f"PyCUDA import failed: {type(exc).__name__}: {exc}"
    try:
        cuda.init()
        n = cuda.Device.count()
    except cuda.Error as exc:
        return False, f"CUDA driver initialisation failed: {exc}"
    if n < 1:
        return False, "no CUDA device present"
    dev = cuda.Device(0)
    cc = dev.compute_capability()
    if cc < MIN_CC:
        return False, (f"{dev.name()} has compute capability {cc[0]}.{cc[1]}; the kernels need >= "
                       f"{MIN_CC[0]}.{MIN_CC[1]} (bf16 tensor cores)")
    return True, f"{dev.name()} (sm_{cc[0]}{cc[1]}, {dev.total_memory() / 2**30:.0f} GiB)"


def cuda_available() -> bool:
    """True when PyCUDA imports, the driver initialises and a compute-capability >= 8.0 GPU is present."""
    return cuda_status()[0]


def cuda_unavailable_reason() -> str:
    ok, why = cuda_status()
    return "" if ok else why
