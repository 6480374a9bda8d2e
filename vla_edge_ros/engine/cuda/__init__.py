"""The GPU engine: the Qwen2 decoder as hand-written CUDA kernels (cuda/*.cu) compiled at run time by PyCUDA.

No cuBLAS / torch / cupy on this path: bf16 weights uploaded once, fp32 accumulation and an fp32 residual stream, a
bf16 K/V cache stored before RoPE. Module map (docs/GPU.md has the design and the figures):

    probe.py    can it run here (PyCUDA, driver, compute capability), where the .cu sources are
    arch.py     what the kernels are built with on each GPU generation (PDL on sm_90 only)
    plan.py     pure: Tuning, plan(cfg, tuning, device limits) -> LaunchPlan (grids, splits, shared memory)
    kernels.py  the kernel table, the compiled modules, one launcher for PDL and plain launches
    buffers.py  weights, activations, KV cache on the device (vram.py: the tracker and budget check)
    forward.py  the layered prefill / decode sequence as launches
    graphs.py   CUDA graphs and the libcuda PDL launcher PyCUDA lacks
    engine.py   CudaEngine: set-up, graph capture, run_chunk

PyCUDA is imported lazily: the package imports on a machine without a driver.
"""
from vla_edge_ros.engine.cuda.probe import CUDA_DIR, cuda_available, cuda_status, cuda_unavailable_reason


def __getattr__(name: str):
    if name == "CudaEngine":  # imported on first use: keeps `import vla_edge_ros.engine.cuda` light
        from vla_edge_ros.engine.cuda.engine import CudaEngine
        return CudaEngine
    raise AttributeError(name)


__all__ = ["CUDA_DIR", "CudaEngine", "cuda_available", "cuda_status", "cuda_unavailable_reason"]
