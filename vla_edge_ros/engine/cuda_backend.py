"""Compatibility shim: the CUDA engine lives in the package vla_edge_ros.engine.cuda (engine/factory.py and the
tests that stub the GPU away import this module name)."""
from vla_edge_ros.engine.cuda import cuda_available, cuda_status, cuda_unavailable_reason

__all__ = ["CudaEngine", "cuda_available", "cuda_status", "cuda_unavailable_reason"]


def __getattr__(name: str):
    if name == "CudaEngine":
        from vla_edge_ros.engine.cuda.engine import CudaEngine
        return CudaEngine
    raise AttributeError(name)
