"""The kernel table, and the compiled kernels with one launcher for both launch paths.

One table (``KERNELS``: name, source file, argument signature, family) is the only list of kernels: the engine
compiles and loads from it, the tests compile every file it names, and profiling groups launches by its families.
The host's launch constants are read from each compiled module's ``vla_launch`` array (``LAUNCH_CONSTANTS`` names
its entries), so a constant changed in a .cu file cannot silently disagree with the grids the host computes.

Launch paths: with programmatic dependent launch (sm_90, ``Launcher(pdl=True)``) through libcuda's
``cuLaunchKernelEx`` (graphs.PdlLauncher, a second copy of the same cubin), else PyCUDA prepared calls.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from vla_edge_ros.engine.cuda.plan import KERNEL_SUFFIX, LaunchConstants
from vla_edge_ros.engine.cuda.probe import CUDA_DIR
from vla_edge_ros.engine.interface import EngineError


class Kernel(NamedTuple):
    name: str
    file: str
    sig: str     # argument types, in order: P device pointer, i int32, f float32
    family: str  # what the profiling tools group it under (bench/gpu_profile.py)


KERNELS: tuple[Kernel, ...] = (
    Kernel("embed_gather", "embed.cu", "PPiPi", "embed"),
    Kernel("kv_move", "embed.cu", "PPiiiPPi", "kv_move"),
    Kernel("rmsnorm_rows_bf16", "rmsnorm.cu", "PPPifPPi", "rmsnorm"),
    Kernel("rmsnorm_rows_f32", "rmsnorm.cu", "PPPif", "rmsnorm"),
    Kernel("gemm32_atomic", "gemm_skinny.cu", "PiPiiiPi", "gemm32_atomic"),
    Kernel("gemm32_silu", "gemm_skinny.cu", "PiPiiP", "gemm32_silu"),
    Kernel("gemm32v4_atomic", "gemm_skinny.cu", "PiPiiPi", "gemm32v4_atomic"),
    Kernel("gemm32v4_silu", "gemm_skinny.cu", "PiPiiP", "gemm32v4_silu"),
    Kernel("gemv_qkv", "gemv.cu", "PPfPPiiiPPPPPi", "gemv_qkv"),
    Kernel("gemv_resid", "gemv.cu", "PPiiiP", "gemv_resid"),
    Kernel("gemv_gateup", "gemv.cu", "PPfPiiP", "gemv_gateup"),
    Kernel("gemv_logits", "gemv.cu", "PPiPfPiiPP", "gemv_logits"),
    Kernel("attn_prefill_hd128", "rope_attention.cu", "PiPPPPPiifPP", "attn_prefill"),
    Kernel("attn_prefill_hd64", "rope_attention.cu", "PiPPPPPiifPP", "attn_prefill"),
    Kernel("attn_decode_hd128", "rope_attention.cu", "PPPPPiPiifPP", "attn_decode"),
    Kernel("attn_decode_hd64", "rope_attention.cu", "PPPPPiPiifPP", "attn_decode"),
    # head groups (grid.z): the named fallback for more query heads per KV head than one block holds
    Kernel("attn_prefill_hd128_hg", "rope_attention.cu", "PiPPPPPiifPP", "attn_prefill"),
    Kernel("attn_prefill_hd64_hg", "rope_attention.cu", "PiPPPPPiifPP", "attn_prefill"),
    Kernel("attn_decode_hd128_hg", "rope_attention.cu", "PPPPPiPiifPP", "attn_decode"),
    Kernel("attn_decode_hd64_hg", "rope_attention.cu", "PPPPPiPiifPP", "attn_decode"),
    Kernel("attn_combine", "rope_attention.cu", "PPiiiiPiiiPP", "attn_combine"),
    Kernel("attn_combine_v2", "rope_attention.cu", "PPiiiiPiiiPP", "attn_combine"),
    Kernel("attn_combine_v4", "rope_attention.cu", "PPiiiiPiiiPP", "attn_combine"),
    Kernel("argmax_tokens", "lm_head_action.cu", "PiiPiP", "argmax"),
    # the fleet's batched pass (engine/cuda/fleet.py): every member robot in one launch
    Kernel("attn_prefill_batch_hd128", "rope_attention.cu", "PiPPPPPiifPPiii", "attn_prefill"),
    Kernel("attn_prefill_batch_hd64", "rope_attention.cu", "PiPPPPPiifPPiii", "attn_prefill"),
    Kernel("attn_decode_batch_hd128", "rope_attention.cu", "PiPPPPiPiifPPiii", "attn_decode"),
    Kernel("attn_decode_batch_hd64", "rope_attention.cu", "PiPPPPiPiifPPiii", "attn_decode"),
    Kernel("attn_combine_batch", "rope_attention.cu", "PPiiiPiiiP", "attn_combine"),
    Kernel("attn_combine_batch_v2", "rope_attention.cu", "PPiiiPiiiP", "attn_combine"),
    Kernel("attn_combine_batch_v4", "rope_attention.cu", "PPiiiPiiiP", "attn_combine"),
    Kernel("kv_store_rows", "fleet.cu", "PiiiPPPiPi", "kv_store"),
    Kernel("gemm32t_atomic", "fleet.cu", "PiPiiiPii", "gemm32_atomic"),
    Kernel("gemv_rows_atomic", "fleet.cu", "PiPiiiPii", "gemv_rows"),
    Kernel("gemv_rows_mma", "fleet.cu", "PiPiiiPii", "gemv_rows"),  # the same on the tensor cores
    # GEMMs of many rows, both operands staged: the fleet's prefill, the parallel pass past one tile (tuning
    # fleet_gemm / parallel_gemm = "tiled")
    Kernel("gemm_tiled128_atomic", "gemm_tiled.cu", "PiPiiiPii", "gemm_tiled"),
    Kernel("gemm_tiled64_atomic", "gemm_tiled.cu", "PiPiiiPii", "gemm_tiled"),
    Kernel("gemm_tiled128_silu", "gemm_tiled.cu", "PiPiiPi", "gemm_tiled_silu"),
    Kernel("gemm_tiled64_silu", "gemm_tiled.cu", "PiPiiPi", "gemm_tiled_silu"),
    Kernel("silu_rows", "fleet.cu", "PiP", "silu"),
    Kernel("rows_gather", "fleet.cu", "PiPiP", "gather"),
)

# The quantised twins of the decoder's linear-layer kernels (issue 23; cuda/wtype.cuh), in files of their own: the same
# arguments with the weights as codes, then the scales and the int4 zero points (two pointers more; zeros null for
# int8 / fp8).
QUANTISED_KERNELS = ("gemm32_atomic", "gemm32_silu", "gemm32v4_atomic", "gemm32v4_silu", "gemv_qkv", "gemv_resid",
                     "gemv_gateup")
QUANTISED_SUFFIXES = tuple(s for s in KERNEL_SUFFIX.values() if s)  # plan.KERNEL_SUFFIX: one table of types
QUANTISED_FILES = {"gemm_skinny.cu": "gemm_quant.cu", "gemv.cu": "gemv_quant.cu"}  # the bf16 files stay as measured
KERNELS += tuple(Kernel(k.name + suffix, QUANTISED_FILES[k.file], k.sig + "PP", k.family)
                 for suffix in QUANTISED_SUFFIXES for k in KERNELS if k.name in QUANTISED_KERNELS)
BENCH_KERNELS: tuple[Kernel, ...] = (  # vla_edge_ros/bench/pdl_hop_bench.py only; not loaded by the engine
    Kernel("hop_copy", "bench_hop.cu", "PPi", "hop"),
    Kernel("hop_vector", "bench_hop.cu", "PPi", "hop"),
)
BY_NAME = {k.name: k for k in KERNELS + BENCH_KERNELS}
KERNEL_FILES = tuple(dict.fromkeys(k.file for k in KERNELS))
BENCH_KERNEL_FILES = tuple(dict.fromkeys(k.file for k in BENCH_KERNELS))
FAMILIES = tuple(dict.fromkeys(k.family for k in KERNELS))
# each file's `__constant__ int vla_launch[]`, entry by entry (LaunchConstants field names = the .cu macro names)
LAUNCH_CONSTANTS = {
    "gemm_skinny.cu": ("GEMM_WARPS", "G4_NW", "G4_U", "G4_SMEM"),
    "gemv.cu": ("GEMV_WARPS",),
    "fleet.cu": ("GEMM_WARPS", "GR_WARPS", "GR_MAXM"),
    "gemm_tiled.cu": ("GT_BN", "GT_SMEM128", "GT_SMEM64", "GT_BK"),
    "gemv_quant.cu": ("GEMV_RPW_I8", "GEMV_RPW_F8", "GEMV_RPW_I4"),
    "rope_attention.cu": ("ATT_KC", "DEC_WARPS", "DEC_MAXG", "CMB_GROUPS", "PF_MAXG_128", "PF_MAXG_64", "PFG_MAXG_128",
                          "PFG_MAXG_64"),
}
_CAST = {"P": lambda a: np.intp(int(a)), "i": np.int32, "f": np.float32}


class CompiledKernels:
    """Every file of KERNELS compiled for one architecture, loaded through PyCUDA and (when available) through the
    PDL launcher. Construct with the engine's context current."""

    def __init__(self, cuda, nvcc_arch: str | None, target: str, defines: Sequence[str] = (),
                 log: Callable[[str], None] = print):
        from pycuda.compiler import compile as nvcc_compile
        if not CUDA_DIR.is_dir():
            raise EngineError(f"CUDA kernel sources not found in {CUDA_DIR} (set VLA_CUDA_DIR)")
        self.cuda = cuda
        self.defines = tuple(defines)
        self.modules: dict[str, Any] = {}   # file -> PyCUDA module
        self.xmodules: dict[str, Any] = {}  # file -> the PDL launcher's copy
        self.fn: dict[str, Any] = {}        # name -> prepared PyCUDA function
        self.xfn: dict[str, Any] = {}       # name -> graphs.PdlFunction
        self.pdl_launcher = None
        try:
            from vla_edge_ros.engine.cuda.graphs import PdlLauncher
            self.pdl_launcher = PdlLauncher()
        except EngineError as exc:
            log(f"cuda engine: programmatic dependent launch unavailable ({exc}); plain launches")
        options = ["-O3", "-std=c++17"] + ["-D" + d for d in self.defines]
        for fname in KERNEL_FILES:
            src = (CUDA_DIR / fname).read_text(encoding="utf-8")
            try:
                cubin = nvcc_compile(src, no_extern_c=True, include_dirs=[str(CUDA_DIR)], arch=nvcc_arch,
                                     target=target, options=options)
            except Exception as exc:
                raise EngineError(f"compiling {CUDA_DIR / fname} failed: {exc}") from exc
            self.modules[fname] = cuda.module_from_buffer(cubin)
            if self.pdl_launcher is not None:
                self.xmodules[fname] = self.pdl_launcher.load(cubin)
        for k in KERNELS:
            try:
                f = self.modules[k.file].get_function(k.name)
            except cuda.LogicError as exc:
                raise EngineError(f"kernel {k.name} missing from {CUDA_DIR / k.file}") from exc
            f.prepare(k.sig)
            self.fn[k.name] = f
            if self.pdl_launcher is not None:
                xf = self.pdl_launcher.function(self.xmodules[k.file], k.name, k.sig)
                if xf is None:
                    raise EngineError(f"kernel {k.name} missing from the PDL launcher's copy of {k.file}")
                self.xfn[k.name] = xf

    @property
    def pdl_ready(self) -> bool:
        return self.pdl_launcher is not None

    def constants(self) -> LaunchConstants:
        """The kernels' launch constants, read from each module's vla_launch array."""
        values: dict[str, int] = {}
        for fname, names in LAUNCH_CONSTANTS.items():
            ptr, nbytes = self.modules[fname].get_global("vla_launch")
            got = np.zeros(nbytes // 4, np.int32)
            self.cuda.memcpy_dtoh(got, ptr)
            if len(got) != len(names):
                raise EngineError(f"cuda/{fname} vla_launch has {len(got)} entries, the host reads {len(names)} "
                                  f"({', '.join(names)}): the kernel source and the engine do not match")
            values.update(zip(names, (int(v) for v in got)))
        return LaunchConstants(**values)

    def num_regs(self, name: str) -> int:
        return int(self.fn[name].num_regs)

    def raise_dynamic_smem(self, name: str, nbytes: int) -> None:
        self.fn[name].set_attribute(self.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))
        if name in self.xfn:
            self.xfn[name].set_max_dynamic_shared(int(nbytes))

    def global_ptr(self, fname: str, symbol: str, pdl: bool) -> tuple[int, int] | None:
        """(address, bytes) of a __device__ / __constant__ variable in the copy of ``fname`` whose kernels run
        (the launcher's when ``pdl``); None when the module has no such symbol."""
        try:
            if pdl:
                return self.pdl_launcher.global_ptr(self.xmodules[fname], symbol)
            ptr, size = self.modules[fname].get_global(symbol)
            return int(ptr), int(size)
        except (EngineError, self.cuda.LogicError):
            return None

    def write_u32(self, symbol: str, value: int) -> None:
        """Set a 32-bit __constant__ in every module (both copies) that defines it (e.g. vla_late_trigger)."""
        val = np.array([value], np.uint32)
        for fname in KERNEL_FILES:
            for pdl in (False, True) if self.pdl_ready else (False,):
                where = self.global_ptr(fname, symbol, pdl)
                if where is not None:
                    self.cuda.memcpy_htod(where[0], val)

    def unload(self) -> None:
        if self.pdl_launcher is not None:
            self.pdl_launcher.unload()
            self.pdl_launcher = None


class Launcher:
    """``launcher(launch, *args, serial=False)`` enqueues one kernel on the stream (eagerly or into a graph being
    captured). args follow the kernel's signature; they are cast here (P: pointer, i: int32, f: float32).
    serial: no programmatic edge: the kernel starts after everything before it completed."""

    def __init__(self, kernels: CompiledKernels, stream, pdl: bool):
        self.kernels, self.stream, self.pdl = kernels, stream, bool(pdl)
        self.launches = 0

    def __call__(self, launch, *args, serial: bool = False) -> None:
        name = launch.kernel
        if self.pdl:
            self.kernels.xfn[name].launch(launch.grid, launch.block, self.stream.handle, args, smem=launch.smem,
                                          pdl=not serial)
        else:
            sig = BY_NAME[name].sig
            if len(args) != len(sig):
                raise EngineError(f"{name}: {len(args)} arguments for signature {sig!r}")
            cast = [_CAST[c](a) for c, a in zip(sig, args)]
            self.kernels.fn[name].prepared_async_call(launch.grid, launch.block, self.stream, *cast,
                                                      shared_size=launch.smem)
        self.launches += 1
