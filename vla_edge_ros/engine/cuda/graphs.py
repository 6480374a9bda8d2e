"""CUDA graphs for PyCUDA streams (PyCUDA has no graph API).

Capture runs on PyCUDA's ``Stream.handle`` through the driver API: ``cuda.bindings.driver`` when installed
(``cuda-bindings``), else libcuda through ctypes. Kernel launches made with ``prepared_async_call`` on the
stream between :meth:`CudaGraph.begin` and :meth:`CudaGraph.end` are recorded, not run; :meth:`launch` replays
them with one call. Inputs that change between replays (positions, slot indices, lengths) must live in device
buffers that the host updates with async copies before the launch: kernel arguments are frozen at capture.
"""
from __future__ import annotations

import ctypes
from typing import Any

from vla_edge_ros.engine.interface import EngineError

_CAPTURE_MODE_THREAD_LOCAL = 1


class _Driver:
    """The five driver calls we need, from cuda-bindings or ctypes."""

    def __init__(self) -> None:
        self.kind = ""
        try:
            from cuda.bindings import driver as cu  # type: ignore
            self.cu = cu
            self.kind = "cuda-bindings"
        except ImportError:
            self.cu = None
            try:
                self.lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise EngineError(f"CUDA graphs need cuda-bindings or libcuda.so.1: {exc}") from exc
            self.kind = "ctypes"

    def _check(self, what: str, err: Any) -> None:
        code = int(err) if not isinstance(err, int) else err
        if code != 0:
            raise EngineError(f"{what} failed with CUDA error {code} ({err})")

    def begin(self, stream: int) -> None:
        if self.cu is not None:
            cu = self.cu
            (err,) = cu.cuStreamBeginCapture(cu.CUstream(stream), cu.CUstreamCaptureMode(_CAPTURE_MODE_THREAD_LOCAL))
            self._check("cuStreamBeginCapture", err)
        else:
            self._check("cuStreamBeginCapture_v2", self.lib.cuStreamBeginCapture_v2(
                ctypes.c_void_p(stream), ctypes.c_int(_CAPTURE_MODE_THREAD_LOCAL)))

    def end(self, stream: int) -> Any:
        if self.cu is not None:
            cu = self.cu
            err, graph = cu.cuStreamEndCapture(cu.CUstream(stream))
            self._check("cuStreamEndCapture", err)
            # cuda-bindings 12 names it cuGraphInstantiateWithFlags; 13 folds it into cuGraphInstantiate(graph, flags)
            inst = getattr(cu, "cuGraphInstantiateWithFlags", None) or cu.cuGraphInstantiate
            err, exe = inst(graph, 0)
            self._check("cuGraphInstantiate", err)
            return graph, exe
        graph = ctypes.c_void_p()
        self._check("cuStreamEndCapture", self.lib.cuStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph)))
        exe = ctypes.c_void_p()
        self._check("cuGraphInstantiateWithFlags", self.lib.cuGraphInstantiateWithFlags(
            ctypes.byref(exe), graph, ctypes.c_ulonglong(0)))
        return graph, exe

    def launch(self, exe: Any, stream: int) -> None:
        if self.cu is not None:
            (err,) = self.cu.cuGraphLaunch(exe, self.cu.CUstream(stream))
            self._check("cuGraphLaunch", err)
        else:
            self._check("cuGraphLaunch", self.lib.cuGraphLaunch(exe, ctypes.c_void_p(stream)))

    def destroy(self, graph: Any, exe: Any) -> None:
        if self.cu is not None:
            self.cu.cuGraphExecDestroy(exe)
            self.cu.cuGraphDestroy(graph)
        else:
            self.lib.cuGraphExecDestroy(exe)
            self.lib.cuGraphDestroy(graph)


_DRIVER: _Driver | None = None


def driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


class CudaGraph:
    """One captured, instantiated graph replayable on a PyCUDA stream."""

    def __init__(self, name: str):
        self.name = name
        self._graph = None
        self._exe = None
        self.nodes_hint = 0  # launches recorded (counted by the caller)

    def begin(self, stream) -> None:
        driver().begin(int(stream.handle))

    def end(self, stream) -> None:
        try:
            self._graph, self._exe = driver().end(int(stream.handle))
        except Exception:
            self._graph = self._exe = None
            raise

    def capture(self, stream, enqueue) -> "CudaGraph":
        """Record ``enqueue()`` (launches on ``stream``) into this graph."""
        self.begin(stream)
        try:
            self.nodes_hint = int(enqueue() or 0)
        except BaseException:
            try:
                driver().end(int(stream.handle))
            except Exception:
                pass
            raise
        self.end(stream)
        return self

    @property
    def ready(self) -> bool:
        return self._exe is not None

    def launch(self, stream) -> None:
        if self._exe is None:
            raise EngineError(f"graph {self.name!r} was not captured")
        driver().launch(self._exe, int(stream.handle))

    def destroy(self) -> None:
        if self._exe is not None:
            driver().destroy(self._graph, self._exe)
        self._graph = self._exe = None


# ---------------------------------------------------------------------------------------------------------
# Programmatic dependent launch (PDL): kernels launched through cuLaunchKernelEx with the
# programmatic-stream-serialization attribute may start while the previous kernel in the stream finishes; the
# kernels call griddepcontrol.wait (cuda/common.cuh: pdl_wait) before touching data of their predecessor, so
# only their weight prefetch overlaps. Captured into a graph the dependency becomes a programmatic edge.
# PyCUDA cannot pass launch attributes, so these launches go straight to libcuda through ctypes, on the
# context PyCUDA made current, with functions loaded from the same cubin PyCUDA compiled.

_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_FUNC_ATTR_MAX_DYNAMIC_SHARED = 8


class _LaunchAttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("val", ctypes.c_int)]


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


_ARG_TYPES = {"P": ctypes.c_uint64, "i": ctypes.c_int32, "f": ctypes.c_float}


class PdlFunction:
    """A kernel of a cubin loaded through libcuda, launched with cuLaunchKernelEx (+ PDL attribute)."""

    def __init__(self, launcher: "PdlLauncher", handle: ctypes.c_void_p, name: str, sig: str):
        self.launcher, self.handle, self.name, self.sig = launcher, handle, name, sig

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        self.launcher.check(f"cuFuncSetAttribute({self.name})", self.launcher.lib.cuFuncSetAttribute(
            self.handle, ctypes.c_int(_FUNC_ATTR_MAX_DYNAMIC_SHARED), ctypes.c_int(int(nbytes))))

    def max_active_blocks(self, block_threads: int, dynamic_smem: int) -> int:
        """Blocks of this kernel that fit on one SM at once (cuOccupancyMaxActiveBlocksPerMultiprocessor)."""
        n = ctypes.c_int(0)
        self.launcher.check(f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})",
                            self.launcher.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                                ctypes.byref(n), self.handle, ctypes.c_int(int(block_threads)),
                                ctypes.c_size_t(int(dynamic_smem))))
        return int(n.value)

    def launch(self, grid, block, stream_handle: int, args, smem: int = 0, pdl: bool = True) -> None:
        if len(args) != len(self.sig):
            raise EngineError(f"{self.name}: {len(args)} arguments for signature {self.sig!r}")
        vals = [_ARG_TYPES[c](int(a) if c == "P" else (float(a) if c == "f" else int(a)))
                for c, a in zip(self.sig, args)]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        cfg = _LaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(grid[0]), int(grid[1]) if len(grid) > 1 else 1,
                                                    int(grid[2]) if len(grid) > 2 else 1)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = int(block[0]), int(block[1]), int(block[2])
        cfg.sharedMemBytes = int(smem)
        cfg.hStream = ctypes.c_void_p(int(stream_handle))
        attr = _LaunchAttr()
        attr.id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.val = 1
        cfg.attrs = ctypes.pointer(attr)
        cfg.numAttrs = 1 if pdl else 0
        self.launcher.check(f"cuLaunchKernelEx({self.name})",
                            self.launcher.lib.cuLaunchKernelEx(ctypes.byref(cfg), self.handle, params, None))


class PdlLauncher:
    """Loads cubins into the current context through libcuda and hands out PdlFunctions."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise EngineError(f"programmatic dependent launch needs libcuda.so.1: {exc}") from exc
        if not hasattr(self.lib, "cuLaunchKernelEx"):
            raise EngineError("this driver has no cuLaunchKernelEx (CUDA >= 12.0 needed for PDL)")
        self.lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.modules: list[ctypes.c_void_p] = []

    def check(self, what: str, rc: int) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(ctypes.c_int(rc), ctypes.byref(name))
            raise EngineError(f"{what} failed: CUDA error {rc} ({(name.value or b'?').decode()})")

    def load(self, cubin: bytes) -> ctypes.c_void_p:
        mod = ctypes.c_void_p()
        self.check("cuModuleLoadData", self.lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(cubin)))
        self.modules.append(mod)
        return mod

    def function(self, module: ctypes.c_void_p, name: str, sig: str) -> PdlFunction | None:
        f = ctypes.c_void_p()
        rc = self.lib.cuModuleGetFunction(ctypes.byref(f), module, name.encode())
        if rc != 0:
            return None
        return PdlFunction(self, f, name, sig)

    def global_ptr(self, module: ctypes.c_void_p, name: str) -> tuple[int, int]:
        """(device address, bytes) of a __device__ variable of a loaded module."""
        ptr, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        self.check(f"cuModuleGetGlobal({name})", self.lib.cuModuleGetGlobal_v2(
            ctypes.byref(ptr), ctypes.byref(size), module, name.encode()))
        return int(ptr.value), int(size.value)

    def unload(self) -> None:
        for m in self.modules:
            self.lib.cuModuleUnload(m)
        self.modules = []
