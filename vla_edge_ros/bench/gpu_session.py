"""The GPU benchmarks' shared start: a usable device, else a one-line reason and exit status 2; then device 0's
primary context current for the run (the context the engine retains too, so both share buffers and modules)."""
from __future__ import annotations

import sys
from typing import Any, Callable


def run_on_gpu(tool: str, body: Callable[[Any], int]) -> int:
    """body(pycuda.driver) with the primary context pushed; its exit status, or 2 without a usable GPU."""
    from vla_edge_ros.engine.cuda.probe import cuda_status
    ok, why = cuda_status()
    if not ok:
        print(f"{tool}: no usable GPU: {why}", file=sys.stderr)
        return 2
    import pycuda.driver as cuda
    ctx = cuda.Device(0).retain_primary_context()
    ctx.push()
    try:
        return body(cuda)
    finally:
        ctx.pop()
