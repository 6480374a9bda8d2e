"""GPU backend: the Qwen2 decoder as hand-written CUDA kernels (cuda/*.cu) compiled at run time by PyCUDA.

No cuBLAS / torch / cupy in this path. bf16 weights uploaded once from safetensors, fp32 accumulation and an
fp32 residual stream; bf16 K/V cache stored BEFORE RoPE in ``[layers, budget + decode_tokens, kv_heads *
head_dim]``, keys rotated inside the attention kernels from each slot's logical position (its index in
``KVManager.context_slots()``), so eviction never touches a stored key.

One chunk = two CUDA graphs replayed on one stream:

* prefill graph: for each layer RMSNorm(+QKV bias init) -> QKV skinny GEMM (tensor cores, split-K atomics)
  -> flash attention over the retained cache (split-K; the older keys staged before its PDL wait, this chunk's
  K/V taken from the QKV output and stored in the cache) -> combine -> o_proj GEMM (+residual)
  -> RMSNorm -> gate/up GEMM with SiLU*up epilogue -> down GEMM (+residual); final norm, LM head over the
  action rows, argmax -> ``tok_buf[0]``;
* decode graph: ``decode_tokens`` steps, each: embedding gather of ``tok_buf[i-1]`` -> per layer fused
  RMSNorm+QKV GEMV (+bias, K/V store), split-K decode attention (the cache rows older than the decode pass
  staged before its PDL wait), combine, o_proj GEMV (+residual), fused RMSNorm+gate/up GEMV (SiLU*up), down
  GEMV (+residual); LM head GEMV (final norm fused) -> argmax -> ``tok_buf[i]``. The greedy chain stays on the
  device.

Alternative decode (``tuning["decode_kernel"] = "persistent"``): one launch per decode token,
cuda/decode_persistent.cu, all layers in a grid that fits on the GPU at once with grid-wide barriers between
the six phases of a layer and weights streamed through per-warp cp.async rings. Correct (same tests) but not
faster on the H200 (docs/KERNEL_NOTES.md v5), so the layered kernels stay the default.

Everything that changes between chunks (slot list, lengths, positions, the frame's vision tokens) lives in
device buffers written by async copies before the replay; kernel arguments are frozen at capture.
``meta`` = [L keys seen by the prefill, p0 position of prefill token 0, T prefill tokens, n_ctx].

Kernels are launched with programmatic dependent launch (libcuda ``cuLaunchKernelEx``, see graphs.py) when the
driver has it (``tuning["pdl"]``) and the GPU is sm_90, else with PyCUDA's prepared calls; both run the same
cubin. Older GPUs (sm_80 .. sm_89: A100, Jetson Orin, RTX 30/40, L4) get a build without PDL and without the
dataflow decode (engine/gpu_arch.py). Tuning knobs
(``DEFAULT_TUNING``) and their measured effect: docs/KERNEL_NOTES.md.

PyCUDA is imported lazily: this module imports on a machine without a driver. ``cuda_available()`` returns a
bool (what engine/factory.py expects); ``cuda_status()`` returns ``(usable, reason)``.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.gpu_arch import fit_shared_memory, plan_arch
from vla_edge_ros.engine.interface import ChunkResult, Engine, EngineError, check_vision_tokens
from vla_edge_ros.engine.vram import VramTracker, check_budget

def _find_cuda_dir() -> Path:
    """$VLA_CUDA_DIR, else the source tree's cuda/, else the installed share/vla_edge_ros/cuda (colcon)."""
    if os.environ.get("VLA_CUDA_DIR"):
        return Path(os.environ["VLA_CUDA_DIR"])
    here = Path(__file__).resolve().parents[2] / "cuda"
    if here.is_dir():
        return here
    try:
        from ament_index_python.packages import get_package_share_directory
        return Path(get_package_share_directory("vla_edge_ros")) / "cuda"
    except Exception:  # not installed through ament: report the source-tree path in the error
        return here


CUDA_DIR = _find_cuda_dir()
KERNEL_FILES = ("embed.cu", "rmsnorm.cu", "gemm_skinny.cu", "gemv.cu", "rope_attention.cu", "lm_head_action.cu",
                "decode_persistent.cu", "decode_dataflow.cu")
BENCH_KERNEL_FILES = ("bench_hop.cu",)  # benchmark-only kernels (vla_edge_ros/bench), not loaded by the engine
T_CHUNK = 32  # prefill rows per kernel pass (the GEMM's two m16 tiles)
GEMV_WARPS = 8

_status: tuple[bool, str] | None = None


def cuda_status() -> tuple[bool, str]:
    """(usable, reason). Imports PyCUDA lazily; never raises."""
    global _status
    if _status is not None:
        return _status
    try:
        import pycuda.driver as cuda  # noqa: F401  (ImportError without libcuda)
    except ImportError as exc:
        _status = (False, f"PyCUDA not importable: {exc}")
        return _status
    except Exception as exc:  # a broken install must not break backend selection
        _status = (False, f"PyCUDA import failed: {type(exc).__name__}: {exc}")
        return _status
    try:
        cuda.init()
        n = cuda.Device.count()
    except cuda.Error as exc:
        _status = (False, f"CUDA driver initialisation failed: {exc}")
        return _status
    if n < 1:
        _status = (False, "no CUDA device present")
        return _status
    dev = cuda.Device(0)
    cc = dev.compute_capability()
    if cc < (8, 0):
        _status = (False, f"{dev.name()} has compute capability {cc[0]}.{cc[1]}; the kernels need >= 8.0 "
                          "(bf16 tensor cores)")
        return _status
    _status = (True, f"{dev.name()} (sm_{cc[0]}{cc[1]}, {dev.total_memory() / 2**30:.0f} GiB)")
    return _status


def cuda_available() -> bool:
    """True when PyCUDA imports, the driver initialises and a compute-capability >= 8.0 GPU is present."""
    return cuda_status()[0]


def cuda_unavailable_reason() -> str:
    ok, why = cuda_status()
    return "" if ok else why


def _f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    from vla_edge_ros.engine.checkpoint import f32_to_bf16_bits
    return f32_to_bf16_bits(np.asarray(a, dtype=np.float32))


def _as_bf16_bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return np.ascontiguousarray(a)
    return _f32_to_bf16_bits(a)


def _bf16_bits_to_f32(a: np.ndarray) -> np.ndarray:
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def interleave_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Rows 16b..16b+7 = gate rows 8b..8b+7, rows 16b+8..16b+15 = up rows 8b..8b+7 (the SiLU epilogue layout)."""
    inter, h = gate.shape
    if inter % 8:
        raise EngineError(f"intermediate_size={inter} must be a multiple of 8 for the fused gate/up kernels")
    out = np.empty((inter // 8, 2, 8, h), dtype=gate.dtype)
    out[:, 0] = gate.reshape(inter // 8, 8, h)
    out[:, 1] = up.reshape(inter // 8, 8, h)
    return out.reshape(2 * inter, h)


G4_NW, G4_U = 8, 6  # cuda/gemm_skinny.cu: warps per block, k32 steps per warp (gemm32v4_*)
G4_SMEM = G4_NW * 32 * (4 * G4_U + 4) * 16 + 2 * G4_NW * 16 * 32 * 4  # cuda/gemm_skinny.cu G4_SMEM
G4_USES = ("qkv", "o", "gateup", "down")  # tuning "gemm_v4": the prefill GEMMs that use gemm32v4_*


MO_WARPS, MO_U = 8, 8  # cuda/rope_attention.cu: attn_merge_oproj_* warps per block, weight words per lane


def merge_oproj_rows(hd: int) -> int:
    """o_proj rows per block of attn_merge_oproj_hd{hd} (cuda/rope_attention.cu MergeOproj<HD>::ROWS)."""
    return MO_WARPS * MO_U * (32 // (hd // 8))


def gemm4_grid(N: int, K: int, n_sm: int, max_splits: int = 0, tol: float = 0.02) -> tuple[int, int]:
    """Grid (R row-group ranges, S K splits) of gemm32v4_*: R x S <= n_sm blocks (one per SM), the K range of a
    split at most G4_NW x G4_U k32 steps, S <= max_splits when given (the SiLU epilogue needs S == 1). Minimises
    the largest block's work (16-row groups x k32 steps); within `tol` of that, the fewest splits (each split adds
    32 x N fp32 atomics)."""
    if N % 16 or K % 32 or N <= 0 or K <= 0:
        raise EngineError(f"gemm32v4: N={N} must be a multiple of 16 and K={K} of 32")
    nrg, nsteps = N // 16, K // 32
    s_min = math.ceil(nsteps / (G4_NW * G4_U))
    s_max = min(nsteps, n_sm, s_min + 32, max_splits or n_sm)
    if s_min > s_max:
        raise EngineError(f"gemm32v4: K={K} needs {s_min} splits, at most {s_max} allowed")
    cands = []
    for S in range(s_min, s_max + 1):
        R = max(1, min(nrg, n_sm // S))
        cands.append((math.ceil(nrg / R) * math.ceil(nsteps / S), S, R))
    best = min(c for c, _, _ in cands)
    S, _, R = min((S, c, R) for c, S, R in cands if c <= best * (1 + tol))
    return R, S


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def split_len(K: int, row_blocks: int, target_blocks: int, quantum: int, min_len: int) -> int:
    """Split-K length (multiple of ``quantum``, >= min_len) giving about ``target_blocks`` blocks in all."""
    splits = max(1, math.ceil(target_blocks / max(1, row_blocks)))
    ks = _round_up(math.ceil(K / splits), quantum)
    return min(_round_up(K, quantum), max(ks, min_len))


DEFAULT_TUNING = {
    "gemm_version": 1,      # 1: A staged per 256-wide K chunk; 2: whole A slice staged once, W double-buffered
                            # (v2 measured slower on the H200: docs/KERNEL_NOTES.md)
    "gemm_v4": "gateup,down",  # prefill GEMMs (of G4_USES) on gemm32v4_* (balanced grid of one block per SM, K
                               # split inside the block), the others on gemm_version 1 / 2. H200, session 5: -0.14
                               # ms/chunk for these two; qkv and o on v4 +0.10 (docs/KERNEL_NOTES.md)
    "gemm_wpb": 8,          # warps per block of the split-K skinny GEMMs (16 weight rows each)
    "gemm_silu_wpb": 8,     # warps per block of the gate/up GEMM (full K per block)
    "decode_attn": "mma",   # "mma" (tensor cores) or "simt" (first version, CUDA cores)
    "pdl": True,            # programmatic dependent launch (cuLaunchKernelEx): what a kernel does before its wait
                            # (weights, norm weights, old K/V rows) overlaps the previous kernel (PDL off: +1.65
                            # ms/chunk on the H200 at ea7c250, docs/KERNEL_NOTES.md)
    "gemm_target_blocks": 264,
    "gemm_min_ks": 256,
    "gemv_target_blocks": 264,
    "gemv_min_ks": 512,
    "attn_prefill_kps": 64,  # keys per split, multiple of 64; 64 = one staged chunk per split: the old keys
                             # staged before the PDL wait, this chunk's K/V taken from the QKV output and stored
                             # by the attention (attn_prefill_pre_*, no kv_store_prefill launch)
    "attn_decode_kps": 64,  # 64: attn_decode_pre_* (old keys staged before the PDL wait, lean on registers)
    "combine_prefill_vec": 4,  # one_pass merges, dims per thread (1, 2, 4; capped so that HD % (32 vec) == 0): the
    "combine_decode_vec": 1,   # prefill's and the decode's
    "combine": "one_pass",  # split merge: "one_pass" (attn_combine_1p) or "two_pass" (attn_combine, +0.04 ms)
    "merge_oproj": False,  # decode: the split merge and o_proj in one kernel (attn_merge_oproj_*: o_proj split over
                           # K by head, each block merges its head's partials) instead of attn_combine + gemv_resid.
                           # H200 (session 5): the pair's 8.4 us per layer -> 5.0, but gate/up +2.6 and down +0.8 us;
                           # +0.20 ms/chunk with every trigger late, -0.05 with the QKV's early (two runs): within the
                           # spread between runs, so off (docs/KERNEL_NOTES.md)
    # tried on the H200 and removed (docs/KERNEL_NOTES.md session 7): the decode MLP as one kernel (gate/up, SiLU
    # and down's columns, reductions into a residual copy: +2.0 to +6.8 ms/chunk) and an L2 bulk prefetch of the
    # MLP weights during the attention stretch (+0.8 to +1.8 ms: gate/up no faster from L2)
    "kv_l2_prefetch": True,  # the QKV GEMV asks L2 for the layer's older K/V rows before its PDL wait (off: +0.07)
    # kernel families (LATE_TRIGGER_FAMILIES, comma-separated) that let their successor launch after their own PDL
    # wait instead of at their start: a kernel launches when its predecessor's predecessor is done, so at most two
    # wait behind a running one; triggering at the start let later kernels pile up resident (holding registers) and
    # starve the running one: none late +0.80 ms/chunk on the H200 (docs/KERNEL_NOTES.md session 4). All but the
    # decode QKV GEMV (its attention then launches at its start and stages keys longer): -0.04 to -0.13 ms in four
    # runs of session 5.
    "late_trigger": "attn,combine,resid,gateup,gemm,rmsnorm,attn_pf",
    "decode_kernel": "layered",  # "layered": six kernels per layer (gemv.cu + rope_attention.cu); "persistent":
                                 # one launch per decode token (cuda/decode_persistent.cu), measured slower
                                 # on the H200 (16.3 vs 11.6 ms/chunk at ea7c250: docs/KERNEL_NOTES.md v5);
                                 # "dataflow": one launch per decode token, one block per SM, one TMA weight
                                 # ring per block running ahead across phases, counters instead of barriers
                                 # (cuda/decode_dataflow.cu; sm_90 only), measured 11.44 vs 11.09 ms/chunk
                                 # for the layered kernels (docs/KERNEL_NOTES.md session 10, run 4)
    "pd_blocks_per_sm": 0,  # persistent grid: blocks per SM (0 = as many as fit, from the occupancy API)
    "pd_grid": 0,  # test hook only: force the persistent grid size (a grid that is not resident must be flagged)
    "pd_profile": False,  # benchmark only: the persistent kernel stamps clock64 at every phase boundary
}

LATE_TRIGGER_FAMILIES = ("qkv", "attn", "combine", "resid", "gateup", "gemm", "rmsnorm", "attn_pf")  # common.cuh


def late_trigger_mask(spec: str) -> int:
    """'attn,combine' -> the VlaFamily bit mask of cuda/common.cuh."""
    mask = 0
    for name in (n.strip() for n in str(spec).split(",")):
        if not name:
            continue
        if name not in LATE_TRIGGER_FAMILIES:
            raise EngineError(f"late_trigger: unknown kernel family {name!r} "
                              f"(known: {', '.join(LATE_TRIGGER_FAMILIES)})")
        mask |= 1 << LATE_TRIGGER_FAMILIES.index(name)
    return mask


PD_THREADS = 128  # cuda/decode_persistent.cu: PD_THREADS
PD_SEG = 1536  # cuda/decode_persistent.cu: PD_SEG (columns per GEMV item)
PD_WSM_BYTES = 4 * 3 * 2 * PD_SEG * 2  # cuda/decode_persistent.cu: PD_WSM_BYTES (4 warps x 3 items x 2 rows)
PD_PHASES = ("qkv", "attention", "combine", "o_proj", "gate_up", "down")


def attn_stage_bytes(HD: int) -> int:
    """Shared memory of the one-block decode attention in cuda/attn_core.cuh (persistent and dataflow kernels): the
    larger of one staged key chunk (sK [ATT_KC][HD + 8] + sVt [HD][ATT_KC + 8], bf16) and the 4 warps' merge area
    for up to DEC_MAXG = 8 query heads (fp32 s_o [4][8][HD], s_m and s_l [4][8])."""
    return max((64 * (HD + 8) + HD * (64 + 8)) * 2, (4 * 8 * HD + 2 * 4 * 8) * 4)


class DfConfig(NamedTuple):
    """cuda/decode_dataflow.cu df_config, in its order."""
    prologue_bytes: int  # dynamic shared memory before the vector area: the TMA ring + the keys' RoPE rows
    threads: int         # per block: the consumer warps + the producer warp
    kmax: int            # hidden size limit (one 8-row tile of a QKV / gate/up row is one ring slot)
    max_layers: int      # the layer table copied to shared memory
    counters: int        # phase counters per decode step
    ptrs: int            # pointers per layer-table row


class CudaEngine(Engine):
    name = "cuda"

    def __init__(self, cfg: ModelConfig, checkpoint: str | Path | Mapping[str, np.ndarray], kv,
                 instruction: str = "", decode_tokens: int = 8, max_vram_gb: float = 8.0,
                 log: Callable[[str], None] = print, use_graphs: bool = True,
                 tuning: Mapping[str, Any] | None = None):
        ok, why = cuda_status()
        if not ok:
            raise EngineError(f"CUDA backend unavailable: {why}")
        import pycuda.driver as cuda
        self._cuda = cuda
        self.cfg = cfg
        self.kv = kv
        self.log = log
        self.use_graphs = bool(use_graphs)
        self.tuning = {**DEFAULT_TUNING, **(tuning or {})}
        self.decode_tokens = int(decode_tokens)
        self.max_vram_gb = float(max_vram_gb)
        if self.decode_tokens < cfg.action_dims:
            raise EngineError(f"decode_tokens={decode_tokens} is smaller than the {cfg.action_dims} action dimensions")
        if kv.tokens_per_frame != cfg.n_patches:
            raise EngineError(f"tokens_per_frame={kv.tokens_per_frame} must equal the patch embedder's "
                              f"{cfg.n_patches} tokens (patch_grid {list(cfg.patch_grid)})")
        if kv.tokens_per_frame > T_CHUNK:
            raise EngineError(f"tokens_per_frame={kv.tokens_per_frame}: the CUDA prefill handles at most "
                              f"{T_CHUNK} tokens per frame")
        self.prefix_ids = np.frombuffer(instruction.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        if kv.prefix_tokens != len(self.prefix_ids):
            raise EngineError(f"KV manager pins {kv.prefix_tokens} prefix tokens but the instruction encodes to "
                              f"{len(self.prefix_ids)} bytes")
        self.H = cfg.hidden_size
        self.Hq, self.n_kvh, self.HD = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.G = self.Hq // self.n_kvh
        self.I = cfg.intermediate_size
        self.nkv = self.n_kvh * self.HD
        self.nqkv = self.Hq * self.HD + 2 * self.nkv
        self.nlayers = cfg.num_hidden_layers
        self.eps = float(cfg.rms_norm_eps)
        self.n_bins = cfg.n_action_bins
        self._check_geometry()

        from vla_edge_ros.core.action_tokenizer import ActionTokenizer
        self.tokenizer = ActionTokenizer(cfg.vocab_size, cfg.action_q01, cfg.action_q99, cfg.n_action_bins)

        dev = cuda.Device(0)
        # sm_90 builds use PDL and may run the dataflow decode; sm_80 .. sm_89 (A100, Jetson Orin, RTX 30/40, L4)
        # build without them (engine/gpu_arch.py); VLA_CUDA_ARCH=compute_80 checks that build on a Hopper GPU
        self.arch = plan_arch(dev.compute_capability(), os.environ.get("VLA_CUDA_ARCH", ""))
        # read once: the GEMM, persistent and dataflow planners size their grids and shared memory from these
        self.n_sm = dev.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
        self.smem_optin = dev.get_attribute(cuda.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self._ctx = dev.retain_primary_context()
        self._ctx.push()
        try:
            self.device_name = dev.name()
            self.tracker = VramTracker(cuda.mem_alloc)
            self._graphs: dict[str, Any] = {}
            self._setup(checkpoint)
        except BaseException:
            try:
                self._release()
            finally:
                self._ctx.pop()
            raise
        self._ctx.pop()

    # ---- context -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _active(self):
        """Make the engine's (primary) context current on the calling thread for the duration."""
        self._ctx.push()
        try:
            yield
        finally:
            self._ctx.pop()

    # ---- set-up ------------------------------------------------------------------------------------------
    def _check_geometry(self) -> None:
        cfg = self.cfg
        problems = []
        if self.HD not in (64, 128):
            problems.append(f"head_dim={self.HD} (kernels built for 64 and 128)")
        if self.G > 8:
            problems.append(f"{self.G} query heads per KV head (decode kernel supports <= 8)")
        for name, v in (("hidden_size", self.H), ("intermediate_size", self.I)):
            if v % 32:
                problems.append(f"{name}={v} is not a multiple of 32")
        if self.n_bins > 1024:
            problems.append(f"n_action_bins={self.n_bins} > 1024")
        if problems:
            raise EngineError(f"model {cfg.source}: geometry not supported by the CUDA kernels: " + "; ".join(problems))

    def _load_weights(self, checkpoint) -> dict[str, np.ndarray]:
        if isinstance(checkpoint, Mapping):
            from vla_edge_ros.engine.checkpoint import expected_shapes
            want = expected_shapes(self.cfg)
            for name, shape in want.items():
                if name not in checkpoint:
                    raise EngineError(f"weights: missing tensor {name}")
                if tuple(np.shape(checkpoint[name])) != shape:
                    raise EngineError(f"weights: tensor {name}: expected shape {list(shape)}, found "
                                      f"{list(np.shape(checkpoint[name]))}")
            return {k: _as_bf16_bits(v) for k, v in checkpoint.items()}
        from vla_edge_ros.engine.checkpoint import load_checkpoint
        return load_checkpoint(checkpoint, self.cfg, dtype="bfloat16")

    def _sizes(self, capacity: int) -> dict[str, int]:
        """Bytes of model, KV cache and scratch for a KV capacity (check_budget's three parts)."""
        H, I, L, V = self.H, self.I, self.nlayers, self.cfg.vocab_size
        per_layer = 2 * (self.nqkv * H + H * H + 2 * I * H + H * I + 2 * H) + 4 * self.nqkv
        model = L * per_layer + 2 * V * H + 2 * H + 2 * H * self.cfg.patch_dim + 4 * self.cfg.n_patches * H
        if not self.cfg.tie_word_embeddings:
            model += 2 * self.n_bins * H
        slots = capacity + self.decode_tokens
        kv = 2 * L * slots * self.nkv * 2
        n_pf = math.ceil(slots / self.tuning["attn_prefill_kps"])
        n_dec = math.ceil(slots / self.tuning["attn_decode_kps"])
        scratch = (4 * T_CHUNK * (3 * H + self.nqkv) + 2 * T_CHUNK * (2 * H + I)
                   + 4 * (n_pf * self.Hq * T_CHUNK * (self.HD + 2)) + 4 * (n_dec * self.Hq * (self.HD + 2))
                   + 4 * (3 * H + self.Hq * self.HD + I + self.decode_tokens * H)
                   + 4 * (self.decode_tokens + 1) * self.n_bins + 8 * (slots + 64) * self.HD // 2
                   + 4 * (slots + 8) + 64 + 2 * T_CHUNK * self.cfg.patch_dim + 4096)
        return {"model": int(model), "kv": int(kv), "scratch": int(scratch)}

    def _alloc(self, name: str, nbytes: int, host: np.ndarray | None = None) -> int:
        """Tracked device allocation; returns the device pointer as an int (optionally filled from host)."""
        buf = self.tracker.alloc(name, nbytes)
        if host is not None:
            host = np.ascontiguousarray(host)
            if host.nbytes != nbytes:
                raise EngineError(f"upload of {name}: {host.nbytes} bytes for a {nbytes}-byte buffer")
            self._cuda.memcpy_htod(buf, host)
        return int(buf)

    def _setup(self, checkpoint) -> None:
        cuda = self._cuda
        t0 = time.perf_counter()
        self.capacity = int(self.kv.budget_tokens)
        sizes = self._sizes(self.capacity)
        total = check_budget(sizes["model"], sizes["kv"], sizes["scratch"], self.max_vram_gb)
        self.tracker.limit_bytes = int(self.max_vram_gb * 2**30)
        w = self._load_weights(checkpoint)
        t1 = time.perf_counter()
        self._compile()
        t2 = time.perf_counter()
        # ---- weights (bf16), fused layouts built on the host once
        self.layers = []
        for i in range(self.nlayers):
            p = f"model.layers.{i}."
            wqkv = np.concatenate([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                                   w[p + "self_attn.v_proj.weight"]], axis=0)
            bqkv = np.concatenate([_bf16_bits_to_f32(w[p + f"self_attn.{n}_proj.bias"]) for n in "qkv"])
            wgu = interleave_gate_up(w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"])
            self.layers.append({
                "wqkv": self._alloc(f"L{i}.wqkv", wqkv.nbytes, wqkv),
                "bqkv": self._alloc(f"L{i}.bqkv", bqkv.nbytes, bqkv.astype(np.float32)),
                "wo": self._alloc(f"L{i}.wo", 2 * self.H * self.H, w[p + "self_attn.o_proj.weight"]),
                "wgu": self._alloc(f"L{i}.wgu", wgu.nbytes, wgu),
                "wd": self._alloc(f"L{i}.wd", 2 * self.H * self.I, w[p + "mlp.down_proj.weight"]),
                "ln1": self._alloc(f"L{i}.ln1", 2 * self.H, w[p + "input_layernorm.weight"]),
                "ln2": self._alloc(f"L{i}.ln2", 2 * self.H, w[p + "post_attention_layernorm.weight"]),
            })
        emb = w["model.embed_tokens.weight"]
        self.embed = self._alloc("embed", emb.nbytes, emb)
        self.final_norm = self._alloc("final_norm", 2 * self.H, w["model.norm.weight"])
        off = self.cfg.action_token_offset
        if self.cfg.tie_word_embeddings:
            self.head_rows = self.embed + 2 * off * self.H
        else:
            rows = np.ascontiguousarray(w["lm_head.weight"][off:])
            self.head_rows = self._alloc("lm_head_action_rows", rows.nbytes, rows)
        self.prefix_embed = _bf16_bits_to_f32(emb[self.prefix_ids]) if len(self.prefix_ids) else None
        # ---- vision patch embedder (GEMM on the GPU; patchify on the host)
        from vla_edge_ros.engine.vision import PatchEmbedder
        vis = {k: _bf16_bits_to_f32(w[k]) for k in ("vision.patch_embed.weight", "vision.patch_embed.bias",
                                                     "vision.pos_embed") if k in w}
        self.vision = PatchEmbedder(self.cfg, vis if len(vis) == 3 else None)
        wpatch = _f32_to_bf16_bits(self.vision.weight_t.T)  # (hidden, 768)
        self.w_patch = self._alloc("vision.w", wpatch.nbytes, wpatch)
        bias_pos = np.zeros((T_CHUNK, self.H), np.float32)
        bias_pos[:self.cfg.n_patches] = self.vision.bias_pos
        self.vis_bias_pos = self._alloc("vision.bias_pos", bias_pos.nbytes, bias_pos)
        self.vis_out = self._alloc("vision.out", bias_pos.nbytes)
        self.vis_in = self._alloc("vision.patches", 2 * T_CHUNK * self.cfg.patch_dim,
                                  np.zeros((T_CHUNK, self.cfg.patch_dim), np.uint16))
        del w
        # ---- activations (fixed, graph-static)
        H, I, T = self.H, self.I, T_CHUNK
        self.x_pre = self._alloc("x_pre", 4 * T * H, np.zeros((T, H), np.float32))
        self.h_bf = self._alloc("h_bf", 2 * T * H, np.zeros((T, H), np.uint16))
        self.qkv = self._alloc("qkv", 4 * T * self.nqkv, np.zeros((T, self.nqkv), np.float32))
        self.attn_bf = self._alloc("attn_bf", 2 * T * self.Hq * self.HD)
        self.act_bf = self._alloc("act_bf", 2 * T * I)
        self.final_h = self._alloc("final_h", 4 * T * H)
        self.x_dec = self._alloc("x_dec", 4 * H)
        self.q_dec = self._alloc("q_dec", 4 * self.Hq * self.HD)
        self.attn_dec = self._alloc("attn_dec", 4 * self.Hq * self.HD)
        self.act_dec = self._alloc("act_dec", 4 * I)
        self.final_h_dec = self._alloc("final_h_dec", 4 * self.decode_tokens * H)
        self.logits = self._alloc("logits", 4 * (self.decode_tokens + 1) * self.n_bins)
        self.tok_buf = self._alloc("tok_buf", 4 * (self.decode_tokens + 1))
        self.meta = self._alloc("meta", 16, np.zeros(4, np.int32))
        # persistent decode: one grid-barrier counter per decode step (zeroed in the decode graph) + error flag
        self.pd_sync = self._alloc("pd_sync", 4 * (self.decode_tokens + 1), np.zeros(self.decode_tokens + 1, np.int32))
        self.pd_err = self.pd_sync + 4 * self.decode_tokens
        self.pd_layers = self._alloc("pd_layers", 8 * 9 * self.nlayers)
        self.pd_prof = self._alloc("pd_prof", 8 * (6 * self.nlayers + 2))
        # dataflow decode: its phase counters per decode step (zeroed in the decode graph), its layer table
        self.df = self._df_config()
        self.df_sync = self._alloc("df_sync", 4 * self.df.counters * self.decode_tokens)
        self.df_layers = self._alloc("df_layers", 8 * self.df.ptrs * self.nlayers)
        self.h_pd_err = cuda.pagelocked_zeros(1, np.int32)
        self.move_buf = None
        # pinned host staging for the per-chunk copies
        self.h_x = cuda.pagelocked_zeros((T, H), np.float32)
        self.h_meta = cuda.pagelocked_zeros(4, np.int32)
        self.h_tok = cuda.pagelocked_zeros(self.decode_tokens + 1, np.int32)
        self.h_logits = cuda.pagelocked_zeros((self.decode_tokens + 1, self.n_bins), np.float32)
        self.stream = cuda.Stream()
        self.ev = [cuda.Event() for _ in range(4)]
        self._alloc_kv(self.capacity)
        self._plan()
        t3 = time.perf_counter()
        self._prefill_prefix()
        self._capture()
        self.stream.synchronize()
        t4 = time.perf_counter()
        self.last_logits: np.ndarray | None = None
        self.log(f"cuda engine: {self.device_name}, {self.nlayers} layers, hidden {H}, budget {self.capacity} "
                 f"tokens; device memory {self.tracker.current_bytes / 2**30:.3f} GiB (planned {total / 2**30:.3f}); "
                 f"load {t1 - t0:.1f}s, compile {t2 - t1:.1f}s, upload {t3 - t2:.1f}s, prefix+capture {t4 - t3:.1f}s, "
                 f"graphs {'on' if self.use_graphs else 'off'}; kernels {self.arch.describe()}, "
                 f"PDL {'on' if self.pdl else 'off'}")

    def _alloc_kv(self, capacity: int) -> None:
        """KV cache, slot list, RoPE table and split partials for ``capacity`` retained tokens."""
        old = getattr(self, "kc", None)
        old_slots = getattr(self, "slots_alloc", 0)
        self.capacity = int(capacity)
        S = self.capacity + self.decode_tokens
        kv_bytes = 2 * self.nlayers * S * self.nkv
        kc = int(self.tracker.alloc("kc_new" if old is not None else "kc", kv_bytes))
        vc = int(self.tracker.alloc("vc_new" if old is not None else "vc", kv_bytes))
        self._cuda.memset_d16(kc, 0, kv_bytes // 2)
        self._cuda.memset_d16(vc, 0, kv_bytes // 2)
        if old is not None:  # keep retained rows: copy every layer's first old_slots rows
            row = 2 * self.nkv
            for layer in range(self.nlayers):
                for src, dst in ((self.kc, kc), (self.vc, vc)):
                    self._cuda.memcpy_dtod(int(dst) + layer * S * row, int(src) + layer * old_slots * row,
                                           old_slots * row)
            for name in ("kc", "vc", "key_slots", "rope", "part_o_pf", "part_ml_pf", "part_o_dec", "part_ml_dec"):
                self.tracker.free(name)
            self.tracker._live["kc"] = self.tracker._live.pop("kc_new")
            self.tracker._live["vc"] = self.tracker._live.pop("vc_new")
        self.kc, self.vc = kc, vc
        self.slots_alloc = S
        self.key_slots = self._alloc("key_slots", 4 * (S + 8), np.zeros(S + 8, np.int32))
        self.h_slots = self._cuda.pagelocked_zeros(S + 8, np.int32)
        npos = S + 64
        half = self.HD // 2
        inv = 1.0 / (float(self.cfg.rope_theta) ** (np.arange(0, self.HD, 2, dtype=np.float64) / self.HD))
        ang = np.arange(npos, dtype=np.float64)[:, None] * inv[None, :]
        cs = np.empty((npos, half, 2), np.float32)
        cs[..., 0] = np.cos(ang)
        cs[..., 1] = np.sin(ang)
        self.rope = self._alloc("rope", cs.nbytes, cs)
        self._alloc_partials()

    def _alloc_partials(self) -> None:
        """Split-K partial buffers of the two attention kernels (sized by the keys-per-split tuning)."""
        S = self.slots_alloc
        kps_pf, kps_dec = int(self.tuning["attn_prefill_kps"]), int(self.tuning["attn_decode_kps"])
        if kps_pf % 64 or kps_pf < 64 or kps_dec < 1:
            raise EngineError(f"attention split lengths: prefill {kps_pf} must be a positive multiple of 64, "
                              f"decode {kps_dec} positive")
        self.nsplit_pf = math.ceil(S / kps_pf)
        self.nsplit_dec = math.ceil(S / kps_dec)
        rows_pf = self.Hq * T_CHUNK
        self.part_o_pf = self._alloc("part_o_pf", 4 * self.nsplit_pf * rows_pf * self.HD)
        self.part_ml_pf = self._alloc("part_ml_pf", 8 * self.nsplit_pf * rows_pf)
        self.part_o_dec = self._alloc("part_o_dec", 4 * self.nsplit_dec * self.Hq * self.HD)
        self.part_ml_dec = self._alloc("part_ml_dec", 8 * self.nsplit_dec * self.Hq)

    def retune(self, **tuning: Any) -> None:
        """Change launch tuning (split lengths, GEMM block size) and re-capture the graphs (benchmarks)."""
        with self._active():
            self.stream.synchronize()
            if "use_graphs" in tuning:
                self.use_graphs = bool(tuning.pop("use_graphs"))
            self.tuning.update(tuning)
            for name in ("part_o_pf", "part_ml_pf", "part_o_dec", "part_ml_dec"):
                self.tracker.free(name)
            self._alloc_partials()
            self._plan()
            self._capture()
            self.stream.synchronize()

    def _compile(self) -> None:
        from pycuda.compiler import compile as nvcc_compile
        cuda = self._cuda
        if not CUDA_DIR.is_dir():
            raise EngineError(f"CUDA kernel sources not found in {CUDA_DIR} (set VLA_CUDA_DIR)")
        self.modules = {}
        self.k: dict[str, Any] = {}
        sigs = {
            "embed_gather": "PPiPi", "kv_move": "PPiiiPPi",
            "rmsnorm_rows_bf16": "PPPifPPi", "rmsnorm_rows_f32": "PPPif",
            "gemm32_atomic_w4": "PiPiiiPi", "gemm32_atomic_w8": "PiPiiiPi",
            "gemm32_silu_w4": "PiPiiP", "gemm32_silu_w8": "PiPiiP",
            "gemm32s_atomic_w4": "PiPiiiiPi", "gemm32s_atomic_w8": "PiPiiiiPi",
            "gemm32s_silu_w4": "PiPiiiP", "gemm32s_silu_w8": "PiPiiiP",
            "gemm32v4_atomic": "PiPiiPi", "gemm32v4_silu": "PiPiiP",
            "attn_decode_mma_hd128": "PPPPPiPiiifPP", "attn_decode_mma_hd64": "PPPPPiPiiifPP",
            "attn_decode_pre_hd128": "PPPPPiPiiifPP", "attn_decode_pre_hd64": "PPPPPiPiiifPP",
            "gemv_qkv": "PPfPPiiiPPPPPii", "gemv_resid": "PPiiiP", "gemv_gateup": "PPfPiiP",
            "gemv_logits": "PPiPfPiiPP",
            "kv_store_prefill": "PiiiPPPP",
            "attn_prefill_hd128": "PiPPPPPiiifPP", "attn_prefill_hd64": "PiPPPPPiiifPP",
            "attn_prefill_pre_hd128": "PiPPPPPiiifPP", "attn_prefill_pre_hd64": "PiPPPPPiiifPP",
            "attn_decode_hd128": "PPPPPiPiiifPP", "attn_decode_hd64": "PPPPPiPiiifPP",
            "attn_combine": "PPiiiiPiiiPP", "attn_combine_1p": "PPiiiiPiiiPP", "attn_combine_1p_v2": "PPiiiiPiiiPP",
            "attn_combine_1p_v4": "PPiiiiPiiiPP",
            "attn_merge_oproj_hd128": "PPiPiiPiP", "attn_merge_oproj_hd64": "PPiPiiPiP",
            "argmax_tokens": "PiiPi",
            "decode_layers_hd128": "PiPPPPPPPPiPiiiiffiPPP", "decode_layers_hd64": "PiPPPPPPPPiPiiiiffiPPP",
            "decode_df_hd128": "PiPPPPPPPiPiiiiffiPPP", "decode_df_hd64": "PiPPPPPPPiPiiiiffiPPP",
            "df_wo_head_major": "PPiii",
        }
        self.sigs = sigs
        self.kx: dict[str, Any] = {}  # the same kernels, loaded for cuLaunchKernelEx (PDL)
        self.xmods: dict[str, Any] = {}
        self.timeline_build = os.environ.get("VLA_CUDA_TIMELINE") == "1"  # set at construction (benchmarks)
        # benchmark experiments: compile-time constants of the kernels, e.g. VLA_CUDA_DEFINES="DF_NSLOT=4"
        self.extra_defines = ["-D" + d for d in os.environ.get("VLA_CUDA_DEFINES", "").split() if d]
        self.pdl_launcher = None
        try:
            from vla_edge_ros.engine.graphs import PdlLauncher
            self.pdl_launcher = PdlLauncher()
        except EngineError as exc:
            self.log(f"cuda engine: programmatic dependent launch unavailable ({exc}); plain launches")
        for fname in KERNEL_FILES:
            src = (CUDA_DIR / fname).read_text(encoding="utf-8")
            try:
                cubin = nvcc_compile(src, no_extern_c=True, include_dirs=[str(CUDA_DIR)],
                                     arch=self.arch.nvcc_arch, target=self.arch.target,
                                     options=["-O3", "-std=c++17"]
                                     + (["-DVLA_TIMELINE"] if self.timeline_build else [])
                                     + self.extra_defines)
            except Exception as exc:
                raise EngineError(f"compiling {CUDA_DIR / fname} failed: {exc}") from exc
            mod = cuda.module_from_buffer(cubin)
            self.modules[fname] = mod
            xmod = self.pdl_launcher.load(cubin) if self.pdl_launcher is not None else None
            self.xmods[fname] = xmod
            for name, sig in sigs.items():
                try:
                    f = mod.get_function(name)
                except cuda.LogicError:
                    continue
                f.prepare(sig)
                self.k[name] = f
                if xmod is not None:
                    self.kx[name] = self.pdl_launcher.function(xmod, name, sig)
        missing = sorted(set(sigs) - set(self.k))
        if missing:
            raise EngineError(f"kernels missing from {CUDA_DIR}: {', '.join(missing)}")

    def _plan(self) -> None:
        """Grid shapes, split-K lengths and dynamic shared memory for this geometry and tuning."""
        t = self.tuning
        H, I = self.H, self.I
        cuda = self._cuda
        wpb, swpb, ver = int(t["gemm_wpb"]), int(t["gemm_silu_wpb"]), int(t["gemm_version"])
        if wpb not in (4, 8) or swpb not in (4, 8) or ver not in (1, 2):
            raise EngineError(f"gemm tuning: wpb {wpb} / silu wpb {swpb} must be 4 or 8, version {ver} 1 or 2")
        if t["decode_attn"] not in ("mma", "simt"):
            raise EngineError(f"decode_attn must be 'mma' or 'simt', got {t['decode_attn']!r}")
        self.gemm_wpb, self.gemm_silu_wpb, self.gemm_version = wpb, swpb, ver
        tb, mk = int(t["gemm_target_blocks"]), int(t["gemm_min_ks"])
        smem_need: dict[str, int] = {}

        def sa_of(ks: int) -> int:
            q = ks // 8
            return q + (4 - q % 8) % 8

        def gemm(N: int, K: int) -> tuple[int, int, int, int, int]:
            rb = math.ceil(N / (16 * wpb))
            ks = split_len(K, rb, tb, 32, mk)
            sa = sa_of(ks)
            if ver == 2:
                name = f"gemm32s_atomic_w{wpb}"
                smem_need[name] = max(smem_need.get(name, 0), 32 * sa * 16)
            return rb, math.ceil(K / ks), ks, sa, 32 * sa * 16

        self.p_qkv = gemm(self.nqkv, H)
        self.p_o = gemm(H, self.Hq * self.HD)
        self.p_d = gemm(H, I)
        sa = sa_of(H)
        self.p_gu = (math.ceil(2 * I / (16 * swpb)), 1, H, sa, 32 * sa * 16)
        if ver == 2:
            smem_need[f"gemm32s_silu_w{swpb}"] = 32 * sa * 16
        uses = {u.strip() for u in str(t["gemm_v4"]).split(",") if u.strip()}
        if uses - set(G4_USES):
            raise EngineError(f"gemm_v4: unknown GEMM(s) {sorted(uses - set(G4_USES))} (known: {', '.join(G4_USES)})")
        n_sm = self.n_sm
        shapes = {"qkv": (self.nqkv, H, 1), "o": (H, self.Hq * self.HD, 1), "gateup": (2 * I, H, 1), "down": (H, I, 0)}
        self.g4: dict[str, tuple[int, int]] = {}
        for u in uses:
            N, K, ms = shapes[u]
            if u == "gateup" and K > 32 * G4_NW * G4_U:
                continue  # the SiLU epilogue needs the whole K in one block: gemm32_silu
            self.g4[u] = gemm4_grid(N, K, n_sm, ms)
        max_optin = self.smem_optin
        kept, note = fit_shared_memory(set(self.g4), G4_SMEM, max_optin)  # sm_86 / sm_89: 99 KB per block
        if note:
            self.log(f"cuda engine: {note}")
        self.g4 = {u: g for u, g in self.g4.items() if u in kept}
        if self.g4:
            smem_need["gemm32v4_atomic"] = smem_need["gemm32v4_silu"] = G4_SMEM
        gtb, gmk = int(t["gemv_target_blocks"]), int(t["gemv_min_ks"])

        def gemv(N: int, K: int) -> tuple[int, int, int]:
            rb = math.ceil(N / (2 * GEMV_WARPS))
            ks = split_len(K, rb, gtb, 256, gmk)
            return rb, math.ceil(K / ks), ks

        self.v_o = gemv(H, self.Hq * self.HD)
        self.v_d = gemv(H, I)
        gsm = 4 * max(H, self.v_o[2], self.v_d[2])
        for name in ("gemv_qkv", "gemv_resid", "gemv_gateup", "gemv_logits"):
            smem_need[name] = gsm
        for name, need in smem_need.items():
            if need > max_optin:
                raise EngineError(f"{name} needs {need} bytes of shared memory, the device allows {max_optin}: "
                                  "lower gemm_min_ks / gemv_min_ks or use gemm_version 1")
            if need > 48 * 1024:
                self.k[name].set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, need)
                if name in self.kx:
                    self.kx[name].set_max_dynamic_shared(need)
        self.pdl = (bool(t["pdl"]) and self.arch.pdl and self.pdl_launcher is not None
                    and len(self.kx) == len(self.k))
        self._write_late_trigger(late_trigger_mask(t["late_trigger"]))
        self._combine_vec("combine_prefill_vec")  # a bad "combine" fails here, not at capture
        self._combine_vec("combine_decode_vec")
        # attn_merge_oproj merges a whole head per block (HD = 32 x dims per thread) with the one-pass loads
        self.merge_oproj = bool(t["merge_oproj"]) and t["combine"] == "one_pass" and self.HD in (64, 128)
        self._plan_persistent()
        attn, threads = self._attn_prefill()
        regs = self.k[attn].num_regs
        if threads > 1024 or threads * regs > 65536:
            raise EngineError(f"prefill attention needs {threads} threads x {regs} registers per block: "
                              f"{self.G} query heads per KV head is too many for head_dim {self.HD}")

    def _write_late_trigger(self, mask: int) -> None:
        """cuda/common.cuh vla_late_trigger in every loaded module (PyCUDA's and the PDL launcher's)."""
        cuda = self._cuda
        val = np.array([mask], np.uint32)
        for mod in self.modules.values():
            ptr, _ = mod.get_global("vla_late_trigger")
            cuda.memcpy_htod(ptr, val)
        for mod in self.xmods.values():
            if mod is not None:
                ptr, _ = self.pdl_launcher.global_ptr(mod, "vla_late_trigger")
                cuda.memcpy_htod(ptr, val)

    def _plan_persistent(self) -> None:
        """Grid of the persistent decode kernel: every block resident at once (its grid barriers spin), sized
        from the occupancy API; dynamic shared memory = the warps' weight rings + the larger of the attention
        staging buffer and one GEMV input vector."""
        t = self.tuning
        if t["decode_kernel"] not in ("persistent", "layered", "dataflow"):
            raise EngineError("decode_kernel must be 'layered', 'persistent' or 'dataflow', got "
                              f"{t['decode_kernel']!r}")
        self.persistent = t["decode_kernel"] in ("persistent", "dataflow")
        self.dataflow = False
        if t["decode_kernel"] == "dataflow":
            self._plan_dataflow()
            return
        if not self.persistent:
            return
        name = "decode_layers_hd%d" % self.HD
        why = None
        if self.pdl_launcher is None or name not in self.kx:
            why = "needs the libcuda launcher (occupancy query)"
        elif self.H % 8 or self.I % 8 or (self.Hq * self.HD) % 8:
            why = f"hidden {self.H} / intermediate {self.I} must be multiples of 8"
        elif self.H > PD_SEG:
            why = f"hidden {self.H} > {PD_SEG} (a QKV or gate/up row must fit one GEMV segment)"
        if why:
            self.log(f"cuda engine: persistent decode unavailable ({why}); layered decode kernels")
            self.persistent = False
            return
        cuda = self._cuda
        HD, H, I = self.HD, self.H, self.I
        attn_bytes = attn_stage_bytes(HD)
        n_sm = self.n_sm
        smem = PD_WSM_BYTES + max(attn_bytes, 4 * H, 4 * self.Hq * HD, 4 * I)  # (as measured; a vector needs
        # only min(., PD_SEG) floats since each block loads one column segment, the attention buffer dominates)
        optin = self.smem_optin
        if smem + self.k[name].get_attribute(cuda.function_attribute.SHARED_SIZE_BYTES) > optin:  # sm_86 / sm_89
            raise EngineError(f"persistent decode needs {smem} B of dynamic shared memory per block + its static "
                              f"shared memory, this device allows {optin}: use decode_kernel 'layered'")
        fx = self.kx[name]
        if smem > 48 * 1024:
            self.k[name].set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
            fx.set_max_dynamic_shared(smem)
        occ = fx.max_active_blocks(PD_THREADS, smem)
        bps = int(t["pd_blocks_per_sm"]) or occ
        if occ < 1 or bps > occ:
            raise EngineError(f"persistent decode: {bps} blocks per SM requested, {occ} fit")
        grid = int(t["pd_grid"]) or n_sm * bps
        if grid < math.ceil(max(I, self.Hq * HD) / PD_SEG):
            raise EngineError(f"persistent decode: a grid of {grid} blocks is smaller than the column segments")
        self.pd_grid, self.pd_smem = grid, smem
        self.log(f"cuda engine: persistent decode {grid} blocks ({bps}/SM x {n_sm} SMs, occupancy {occ}), "
                 f"{smem} B shared")

    def _plan_dataflow(self) -> None:
        """The dataflow decode kernel (cuda/decode_dataflow.cu): one block per SM (4 consumer warps + a producer
        warp), all resident (its counter waits spin); dynamic shared memory = the TMA weight ring + the RoPE rows of
        the block's keys + one vector area (x or act) + the attention staging buffer. Its W_o is a head-major copy
        (one head's rows are one contiguous TMA tile), made on the GPU the first time the kernel is selected."""
        cuda = self._cuda
        HD, H, I = self.HD, self.H, self.I
        name = "decode_df_hd%d" % HD
        n_sm = self.n_sm
        attn_bytes = attn_stage_bytes(HD)
        ring_bytes, threads = self.df.prologue_bytes, self.df.threads  # (ring + RoPE rows)
        smem = ring_bytes + (4 * max(I, H) + 127) // 128 * 128 + attn_bytes  # + vector area, attention staging
        optin = self.smem_optin
        why = None
        if not self.arch.dataflow:
            why = (f"needs sm_90 (TMA bulk copies, mbarrier transaction counts); {self.arch.describe()}: use "
                   "decode_kernel 'layered'")
        elif self.pdl_launcher is None or name not in self.kx:
            why = "needs the libcuda launcher (occupancy query)"
        elif H % 8 or I % 8 or self.nqkv % 8 or H > self.df.kmax or HD not in (64, 128):
            why = (f"hidden {H} must be a multiple of 8 and <= {self.df.kmax}, intermediate {I} and the QKV rows "
                   f"{self.nqkv} multiples of 8, head_dim 64 or 128")
        elif n_sm < self.Hq:
            why = f"{n_sm} SMs < {self.Hq} query heads"
        elif self.nlayers > self.df.max_layers:
            why = f"{self.nlayers} layers > {self.df.max_layers}"
        elif smem + self.k[name].get_attribute(cuda.function_attribute.SHARED_SIZE_BYTES) > optin:
            why = f"{smem} B of dynamic shared memory + the kernel's static shared memory > {optin} per block"
        if why:
            raise EngineError(f"dataflow decode unavailable: {why}")
        fx = self.kx[name]
        self.k[name].set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        fx.set_max_dynamic_shared(smem)
        occ = fx.max_active_blocks(threads, smem)
        if occ < 1:
            raise EngineError(f"dataflow decode: a {threads}-thread block with {smem} B shared does not fit an SM")
        grid = int(self.tuning["pd_grid"]) or n_sm
        if grid < self.Hq:
            raise EngineError(f"dataflow decode: a grid of {grid} blocks is smaller than the {self.Hq} query heads")
        if "L0.wo_hm" not in self.tracker.names():
            n = H * self.Hq * HD
            for i, Lw in enumerate(self.layers):
                Lw["wo_hm"] = self._alloc(f"L{i}.wo_hm", 2 * n)
                self.k["df_wo_head_major"].prepared_call((min(1024, math.ceil(n / 256)), 1), (256, 1, 1),
                                                         np.intp(Lw["wo"]), np.intp(Lw["wo_hm"]), np.int32(H),
                                                         np.int32(self.Hq), np.int32(HD))
            cuda.Context.synchronize()
        self.dataflow = True
        self.pd_grid, self.pd_smem, self.df_threads = grid, smem, threads
        self.log(f"cuda engine: dataflow decode {grid} blocks (1/SM, {n_sm} SMs), {smem} B shared")

    def dataflow_tile_trace(self) -> np.ndarray | None:
        """Benchmark builds with VLA_CUDA_DEFINES="DF_TRACE": the last dataflow decode step's tile stamps of its last
        layer, us relative to the first stamp: [first / last block][issued, wait ended, dot done][tile]; None
        otherwise."""
        if "DF_TRACE" not in " ".join(self.extra_defines):
            return None
        xmod = self.xmods.get("decode_dataflow.cu")
        if self.pdl and xmod is not None:  # the kernel ran from the launcher's copy of the module
            ptr, _ = self.pdl_launcher.global_ptr(xmod, "df_trace")
        else:
            ptr, _ = self.modules["decode_dataflow.cu"].get_global("df_trace")
        tr = np.zeros((2, 3, 64), np.uint64)
        self._cuda.memcpy_dtoh(tr, ptr)
        t = tr.astype(np.float64)
        base = t[t > 0].min() if (t > 0).any() else 0.0
        return np.where(t > 0, (t - base) / 1e3, np.nan)

    def _df_config(self) -> DfConfig:
        """The compiled dataflow kernel's constants (cuda/decode_dataflow.cu df_config)."""
        ptr, nbytes = self.modules["decode_dataflow.cu"].get_global("df_config")
        cfg = np.zeros(nbytes // 4, np.int32)
        self._cuda.memcpy_dtoh(cfg, ptr)
        if len(cfg) != len(DfConfig._fields):
            raise EngineError(f"cuda/decode_dataflow.cu df_config has {len(cfg)} entries, this host reads "
                              f"{len(DfConfig._fields)}: the kernel source and the engine do not match")
        return DfConfig(*(int(v) for v in cfg))

    def _write_layer_table(self) -> None:
        """Per-layer pointers of the persistent / dataflow decode kernel: ln1, wqkv, bqkv, wo, ln2, wgu, wd, kc, vc
        (the dataflow kernel's wo is the head-major copy)."""
        rows = []
        for i, Lw in enumerate(self.layers):
            kc, vc = self._layer_ptrs(i)
            wo = Lw["wo_hm"] if self.dataflow else Lw["wo"]
            rows.append([Lw["ln1"], Lw["wqkv"], Lw["bqkv"], wo, Lw["ln2"], Lw["wgu"], Lw["wd"], kc, vc])
        if self.dataflow and len(rows[0]) != self.df.ptrs:
            raise EngineError(f"layer-table rows of {len(rows[0])} pointers, cuda/decode_dataflow.cu reads "
                              f"{self.df.ptrs}: the kernel source and the engine do not match")
        self._cuda.memcpy_htod(self.df_layers if self.dataflow else self.pd_layers, np.asarray(rows, dtype=np.uint64))

    # ---- enqueue (the same code runs eagerly and under graph capture) ------------------------------------
    def _launch(self, name: str, grid, block, *args, smem: int = 0, serial: bool = False) -> None:
        """serial: no programmatic edge, the kernel starts after everything before it completed."""
        if self._only is not None and self._tag_of(name) not in self._only:
            return
        if self._skip is not None and self._tag_of(name) in self._skip:
            return
        if self._tl_names is not None:
            self._tl_names.append(name)
        if self.pdl:
            self.kx[name].launch(grid, block, self.stream.handle, args, smem=smem, pdl=not serial)
        else:
            args = [np.intp(a) if type(a) is int else a for a in args]  # device pointers
            self.k[name].prepared_async_call(grid, block, self.stream, *args, shared_size=smem)
        self._launches += 1

    def _attn_prefill(self) -> tuple[str, int]:
        """The prefill attention kernel and its threads per block (cuda/rope_attention.cu ATTN_PREFILL_KERNEL)."""
        pre = int(self.tuning["attn_prefill_kps"]) == 64  # cuda/rope_attention.cu ATT_KC
        return ("attn_prefill_pre_hd%d" if pre else "attn_prefill_hd%d") % self.HD, 64 * self.G

    def _combine_vec(self, key: str) -> tuple[str, int]:
        """A split merge kernel and its dims per thread (attn_combine_1p_v2 / _v4 for one_pass); key: the tuning
        entry, combine_prefill_vec or combine_decode_vec."""
        name = self._combine_name()
        vec = int(self.tuning[key])
        if vec not in (1, 2, 4):
            raise EngineError(f"{key} must be 1, 2 or 4, got {vec}")
        if name != "attn_combine_1p":
            return name, 1
        while self.HD % (32 * vec):
            vec //= 2
        return (name if vec == 1 else f"{name}_v{vec}"), vec

    def _combine_name(self) -> str:
        c = self.tuning["combine"]
        if c not in ("two_pass", "one_pass"):
            raise EngineError(f"combine must be 'two_pass' or 'one_pass', got {c!r}")
        return "attn_combine_1p" if c == "one_pass" else "attn_combine"

    @staticmethod
    def _tag_of(name: str) -> str:
        for tag in ("attn_merge_oproj", "gemm32_atomic", "gemm32_silu", "gemm32s_atomic", "gemm32s_silu",
                    "gemm32v4_atomic", "gemm32v4_silu", "gemv_qkv", "gemv_resid", "gemv_gateup", "gemv_logits",
                    "decode_layers", "decode_df", "attn_prefill", "attn_decode", "attn_combine", "rmsnorm", "kv_store", "embed", "argmax"):
            if name.startswith(tag):
                return tag
        return name

    _only: set[str] | None = None
    _tl_names: list[str] | None = None  # launch names recorded while capturing (timeline)
    timeline_build = False  # benchmark builds: kernels stamp a timeline (cuda/common.cuh VLA_TIMELINE)
    _skip: set[str] | None = None
    _launches = 0
    timeline_pf_phases = None  # (timeline) the last prefill attention's per-block phase ends, us
    host_profile_ms: dict[str, float] = {}  # the last chunk's host-time split (_device_chunk)
    pdl = False
    persistent = False
    dataflow = False

    def _layer_ptrs(self, i: int) -> tuple[int, int]:
        off = i * self.slots_alloc * self.nkv * 2
        return int(self.kc) + off, int(self.vc) + off

    def _gemm(self, plan, blk, A, lda: int, W, N: int, K: int, C, ldc: int, use: str = "") -> None:
        rb, ns, ks, sa, smem = plan
        if use in self.g4:
            self._launch("gemm32v4_atomic", self.g4[use], (32 * G4_NW, 1, 1), A, np.int32(lda), W, np.int32(N),
                         np.int32(K), C, np.int32(ldc), smem=G4_SMEM)
        elif self.gemm_version == 2:
            self._launch(f"gemm32s_atomic_w{self.gemm_wpb}", (rb, ns), blk, A, np.int32(lda), W, np.int32(N),
                         np.int32(K), np.int32(ks), np.int32(sa), C, np.int32(ldc), smem=smem)
        else:
            self._launch(f"gemm32_atomic_w{self.gemm_wpb}", (rb, ns), blk, A, np.int32(lda), W, np.int32(N),
                         np.int32(K), np.int32(ks), C, np.int32(ldc))

    def _enqueue_prefill(self) -> int:
        """One prefill pass over x_pre rows (meta: L, p0, T) -> tok_buf[0], logits[0], final_h."""
        P = np.intp
        H, I, T = self.H, self.I, T_CHUNK
        eps = np.float32(self.eps)
        nq = self.Hq * self.HD
        qscale = np.float32(math.log2(math.e) / math.sqrt(self.HD))
        blk = (32 * self.gemm_wpb, 1, 1)
        sblk = (32 * self.gemm_silu_wpb, 1, 1)
        kps = int(self.tuning["attn_prefill_kps"])
        pre = kps == 64  # cuda/rope_attention.cu ATT_KC: the attention stores this chunk's K/V itself
        attn, athreads = self._attn_prefill()
        cname, cvec = self._combine_vec("combine_prefill_vec")
        start = self._launches
        for i, Lw in enumerate(self.layers):
            kc, vc = self._layer_ptrs(i)
            # serial at layer 0: the prefill attention stages the cache rows of older keys before its PDL wait, so
            # everything before the prefill (the last chunk, K/V moves) must be complete (eager launches; a graph
            # boundary does that too)
            self._launch("rmsnorm_rows_bf16", (T, 1), (256, 1, 1), self.x_pre, Lw["ln1"], self.h_bf, np.int32(H), eps,
                         Lw["bqkv"], self.qkv, np.int32(self.nqkv), serial=i == 0)
            self._gemm(self.p_qkv, blk, self.h_bf, H, Lw["wqkv"], self.nqkv, H, self.qkv, self.nqkv, "qkv")
            if not pre:
                self._launch("kv_store_prefill", (T, 1), (256, 1, 1), self.qkv, np.int32(self.nqkv), np.int32(nq),
                             np.int32(self.nkv), P(kc), P(vc), self.key_slots, self.meta)
            self._launch(attn, (self.nsplit_pf, self.n_kvh), (athreads, 1, 1), self.qkv, np.int32(self.nqkv),
                         P(kc), P(vc), self.key_slots, self.meta, self.rope, np.int32(self.G), np.int32(self.n_kvh),
                         np.int32(kps), qscale, self.part_o_pf, self.part_ml_pf)
            self._launch(cname, (self.Hq * T * self.HD // (32 * cvec), 1), (256, 1, 1), self.part_o_pf,
                         self.part_ml_pf, np.int32(self.Hq * T), np.int32(self.HD), np.int32(T), np.int32(self.Hq),
                         self.meta, np.int32(0), np.int32(0), np.int32(kps), P(0), self.attn_bf)
            self._gemm(self.p_o, blk, self.attn_bf, nq, Lw["wo"], H, nq, self.x_pre, H, "o")
            self._launch("rmsnorm_rows_bf16", (T, 1), (256, 1, 1), self.x_pre, Lw["ln2"], self.h_bf, np.int32(H), eps,
                         P(0), P(0), np.int32(0))
            rb, _, _, sa, smem = self.p_gu
            if "gateup" in self.g4:
                self._launch("gemm32v4_silu", self.g4["gateup"], (32 * G4_NW, 1, 1), self.h_bf, np.int32(H),
                             Lw["wgu"], np.int32(2 * I), np.int32(H), self.act_bf, smem=G4_SMEM)
            elif self.gemm_version == 2:
                self._launch(f"gemm32s_silu_w{self.gemm_silu_wpb}", (rb, 1), sblk, self.h_bf, np.int32(H), Lw["wgu"],
                             np.int32(2 * I), np.int32(H), np.int32(sa), self.act_bf, smem=smem)
            else:
                self._launch(f"gemm32_silu_w{self.gemm_silu_wpb}", (rb, 1), sblk, self.h_bf, np.int32(H), Lw["wgu"],
                             np.int32(2 * I), np.int32(H), self.act_bf)
            self._gemm(self.p_d, blk, self.act_bf, I, Lw["wd"], H, I, self.x_pre, H, "down")
        self._launch("rmsnorm_rows_f32", (T, 1), (256, 1, 1), self.x_pre, self.final_norm, self.final_h,
                     np.int32(H), eps)
        self._launch("gemv_logits", (math.ceil(self.n_bins / GEMV_WARPS), 1), (256, 1, 1), self.final_h, self.meta,
                     np.int32(2), P(0), eps, P(self.head_rows), np.int32(self.n_bins), np.int32(H), self.logits, P(0),
                     smem=4 * H)
        self._launch("argmax_tokens", (1, 1), (256, 1, 1), self.logits, np.int32(self.n_bins),
                     np.int32(self.cfg.action_token_offset), self.tok_buf, np.int32(0))
        return self._launches - start

    def _enqueue_decode(self, steps: int | None = None) -> int:
        P = np.intp
        H, I = self.H, self.I
        eps = np.float32(self.eps)
        nq = self.Hq * self.HD
        qscale = np.float32(math.log2(math.e) / math.sqrt(self.HD))
        kps = int(self.tuning["attn_decode_kps"])
        if self.tuning["decode_attn"] == "mma":
            attn = ("attn_decode_pre_hd%d" if kps == 64 else "attn_decode_mma_hd%d") % self.HD
        else:
            attn = "attn_decode_hd%d" % self.HD
        combine, cvec = self._combine_vec("combine_decode_vec")
        mo_rows = merge_oproj_rows(self.HD)
        kv_pf = np.int32(bool(self.tuning["kv_l2_prefetch"]))
        start = self._launches
        n_steps = steps or self.decode_tokens
        if self.dataflow and (self._only is None or "decode_df" in self._only):
            self._cuda.memset_d32_async(self.df_sync, 0, self.df.counters * n_steps, self.stream)  # the phase counters
        elif self.persistent and (self._only is None or "decode_layers" in self._only):
            self._cuda.memset_d32_async(self.pd_sync, 0, n_steps, self.stream)  # the grid-barrier counters
        for s in range(1, n_steps + 1):
            st = np.int32(s)
            # serial at step 1: the decode attention stages the cache rows of keys < n_ctx before its PDL wait, so
            # everything the prefill wrote must be complete when the decode starts (a graph boundary does that too;
            # this covers eager launches)
            self._launch("embed_gather", (math.ceil(H / 256), 1), (256, 1, 1), self.embed, self.tok_buf,
                         np.int32(s - 1), self.x_dec, np.int32(H), serial=s == 1)
            if self.dataflow:
                self._launch("decode_df_hd%d" % self.HD, (self.pd_grid, 1), (self.df_threads, 1, 1), self.df_layers,
                             np.int32(self.nlayers), self.x_dec, self.q_dec, self.part_o_dec, self.part_ml_dec,
                             self.act_dec, self.key_slots, self.meta, st, self.rope, np.int32(H),
                             np.int32(I), np.int32(self.Hq), np.int32(self.n_kvh), eps, qscale, np.int32(kps),
                             self.df_sync + 4 * self.df.counters * (s - 1), self.pd_err,
                             self.pd_prof if self.tuning["pd_profile"] else 0, smem=self.pd_smem)
            elif self.persistent:
                self._launch("decode_layers_hd%d" % self.HD, (self.pd_grid, 1), (PD_THREADS, 1, 1), self.pd_layers,
                             np.int32(self.nlayers), self.x_dec, self.q_dec, self.part_o_dec, self.part_ml_dec,
                             self.attn_dec, self.act_dec, self.key_slots, self.meta, st, self.rope, np.int32(H),
                             np.int32(I), np.int32(self.Hq), np.int32(self.n_kvh), eps, qscale, np.int32(kps),
                             self.pd_sync + 4 * (s - 1), self.pd_err,
                             self.pd_prof if self.tuning["pd_profile"] else 0, smem=self.pd_smem)
            for i, Lw in enumerate(self.layers if not self.persistent else ()):
                kc, vc = self._layer_ptrs(i)
                self._launch("gemv_qkv", (math.ceil(self.nqkv / (2 * GEMV_WARPS)), 1), (256, 1, 1), self.x_dec, Lw["ln1"],
                             eps, Lw["wqkv"], Lw["bqkv"], np.int32(H), np.int32(nq), np.int32(self.nkv), self.q_dec,
                             P(kc), P(vc), self.key_slots, self.meta, st, kv_pf, smem=4 * H)
                self._launch(attn, (self.nsplit_dec, self.n_kvh), (128, 1, 1), self.q_dec, P(kc), P(vc),
                             self.key_slots, self.meta, st, self.rope, np.int32(self.G), np.int32(self.n_kvh),
                             np.int32(kps), qscale, self.part_o_dec, self.part_ml_dec)
                if self.merge_oproj:
                    self._launch("attn_merge_oproj_hd%d" % self.HD, (math.ceil(H / mo_rows), self.Hq), (256, 1, 1),
                                 self.part_o_dec, self.part_ml_dec, np.int32(self.Hq), self.meta, st, np.int32(kps),
                                 Lw["wo"], np.int32(H), self.x_dec)
                else:
                    self._launch(combine, (self.Hq * self.HD // (32 * cvec), 1), (256, 1, 1), self.part_o_dec,
                                 self.part_ml_dec, np.int32(self.Hq), np.int32(self.HD), np.int32(1),
                                 np.int32(self.Hq), self.meta, np.int32(3), st, np.int32(kps), self.attn_dec, P(0))
                    rb, ns, ks = self.v_o
                    self._launch("gemv_resid", (rb, ns), (256, 1, 1), self.attn_dec, Lw["wo"], np.int32(H),
                                 np.int32(nq), np.int32(ks), self.x_dec, smem=4 * ks)
                self._launch("gemv_gateup", (math.ceil(I / GEMV_WARPS), 1), (256, 1, 1), self.x_dec, Lw["ln2"], eps,
                             Lw["wgu"], np.int32(I), np.int32(H), self.act_dec, smem=4 * H)
                rb, ns, ks = self.v_d
                self._launch("gemv_resid", (rb, ns), (256, 1, 1), self.act_dec, Lw["wd"], np.int32(H), np.int32(I),
                             np.int32(ks), self.x_dec, smem=4 * ks)
            self._launch("gemv_logits", (math.ceil(self.n_bins / GEMV_WARPS), 1), (256, 1, 1), self.x_dec, self.meta,
                         np.int32(-1), self.final_norm, eps, P(self.head_rows), np.int32(self.n_bins), np.int32(H),
                         P(int(self.logits) + 4 * s * self.n_bins), P(int(self.final_h_dec) + 4 * (s - 1) * H),
                         smem=4 * H)
            self._launch("argmax_tokens", (1, 1), (256, 1, 1), P(int(self.logits) + 4 * s * self.n_bins),
                         np.int32(self.n_bins), np.int32(self.cfg.action_token_offset), self.tok_buf, st)
        return self._launches - start

    def _capture(self) -> None:
        from vla_edge_ros.engine.graphs import CudaGraph
        for g in self._graphs.values():
            g.destroy()
        self._graphs = {}
        if self.persistent:
            self._write_layer_table()  # the KV cache may have moved
        if not self.use_graphs:
            return
        self.stream.synchronize()
        self._tl_names = []
        try:
            self._graphs["prefill"] = CudaGraph("prefill").capture(self.stream, self._enqueue_prefill)
            self._graphs["decode"] = CudaGraph("decode").capture(self.stream, self._enqueue_decode)
            self.launch_names = self._tl_names
        finally:
            self._tl_names = None

    def _run_prefill(self) -> None:
        if self.use_graphs:
            self._graphs["prefill"].launch(self.stream)
        else:
            self._enqueue_prefill()

    def _run_decode(self) -> None:
        if self.use_graphs:
            self._graphs["decode"].launch(self.stream)
        else:
            self._enqueue_decode()

    # ---- host-side inputs --------------------------------------------------------------------------------
    def _set_inputs(self, rows: np.ndarray, slots: np.ndarray, L: int, p0: int, T: int, n_ctx: int) -> None:
        cuda = self._cuda
        self.h_x[:T] = rows
        self.h_x[T:] = 0.0  # (the prefix's last partial chunk; a frame fills all 32 rows)
        n = len(slots)
        self.h_slots[:n] = slots
        self.h_meta[:] = (L, p0, T, n_ctx)
        cuda.memcpy_htod_async(self.x_pre, self.h_x, self.stream)
        cuda.memcpy_htod_async(self.key_slots, self.h_slots[:max(n, 1)], self.stream)
        cuda.memcpy_htod_async(self.meta, self.h_meta, self.stream)

    def _prefill_prefix(self) -> None:
        """The pinned instruction prefix, in chunks of up to 32 tokens (eager launches, once)."""
        n = len(self.prefix_ids)
        if n == 0:
            return
        slots = np.asarray(self.kv.prefix_slots, dtype=np.int32)
        for p0 in range(0, n, T_CHUNK):
            T = min(T_CHUNK, n - p0)
            self._set_inputs(self.prefix_embed[p0:p0 + T], slots[:p0 + T], p0 + T, p0, T, 0)
            self._enqueue_prefill()
        self.stream.synchronize()

    # ---- engine API --------------------------------------------------------------------------------------
    @property
    def tokens_per_frame(self) -> int:
        return self.kv.tokens_per_frame

    def encode_frame(self, image: np.ndarray) -> np.ndarray:
        """Patchify on the host, patch projection (+bias+pos) as a tensor-core GEMM on the GPU."""
        patches = self.vision.patches(image)
        n = patches.shape[0]
        buf = np.zeros((T_CHUNK, self.cfg.patch_dim), np.uint16)
        buf[:n] = _f32_to_bf16_bits(patches)
        out = np.empty((T_CHUNK, self.H), np.float32)
        cuda = self._cuda
        with self._active():
            cuda.memcpy_htod_async(self.vis_in, buf, self.stream)
            cuda.memcpy_dtod_async(self.vis_out, self.vis_bias_pos, 4 * T_CHUNK * self.H, self.stream)
            K = self.cfg.patch_dim
            rows = 16 * self.gemm_wpb
            ks = split_len(K, math.ceil(self.H / rows), 132, 32, 256)
            self.k[f"gemm32_atomic_w{self.gemm_wpb}"].prepared_async_call(
                (math.ceil(self.H / rows), math.ceil(K / ks)), (32 * self.gemm_wpb, 1, 1), self.stream,
                np.intp(self.vis_in), np.int32(K), np.intp(self.w_patch), np.int32(self.H), np.int32(K), np.int32(ks),
                np.intp(self.vis_out), np.int32(self.H))
            cuda.memcpy_dtoh_async(out, self.vis_out, self.stream)
            self.stream.synchronize()
        return out[:n]

    def _ensure_capacity(self) -> None:
        if self.kv.budget_tokens <= self.capacity:
            return
        self.log(f"cuda engine: KV budget grew to {self.kv.budget_tokens} tokens: reallocating the cache and "
                 "re-capturing the graphs")
        sizes = self._sizes(self.kv.budget_tokens)
        check_budget(sizes["model"], sizes["kv"], sizes["scratch"], self.max_vram_gb)
        self.stream.synchronize()
        self._alloc_kv(self.kv.budget_tokens)
        self._capture()

    def _apply_moves(self) -> None:
        take = getattr(self.kv, "take_moves", None)
        moves = take() if take else []
        if not moves:
            return
        src = np.concatenate([np.asarray(m[1], np.int32) for m in moves])
        dst = np.concatenate([np.asarray(m[2], np.int32) for m in moves])
        n = len(src)
        if self.move_buf is not None:
            self.tracker.free("moves")
        self.move_buf = self._alloc("moves", 8 * n, np.concatenate([src, dst]))
        total = self.nlayers * n * self.nkv
        self.k["kv_move"].prepared_async_call((min(4096, math.ceil(total / 256)), 1), (256, 1, 1), self.stream,
                                              np.intp(self.kc), np.intp(self.vc), np.int32(self.nlayers),
                                              np.int32(self.slots_alloc), np.int32(self.nkv), np.intp(self.move_buf),
                                              np.intp(self.move_buf + 4 * n),
                                              np.int32(n))

    def run_chunk(self, vision_tokens: np.ndarray, frame_id: int, salient: bool = False) -> ChunkResult:
        t0 = time.perf_counter()
        x = check_vision_tokens(vision_tokens, self.kv.tokens_per_frame, self.H)
        from vla_edge_ros.engine.vision import pooled
        cuda = self._cuda
        try:
            adm, gen, prefill_ms, decode_ms = self._device_chunk(cuda, x, frame_id, salient, pooled)
        except cuda.Error as e:
            # A device error (out of memory, launch failure) can leave the cache half-written and the frame
            # admitted: the inference loop resets the engine before the next chunk instead of a node restart.
            self.needs_reset = True
            raise EngineError(f"CUDA error during chunk {frame_id}: {e}") from e
        self.last_logits = self.h_logits.copy()
        off = self.cfg.action_token_offset
        bins = gen[1:1 + self.cfg.action_dims] - off
        if np.any(bins < 0) or np.any(bins >= self.n_bins):
            raise EngineError(f"decode produced token ids outside the action rows: {gen.tolist()}")
        action = self.tokenizer.bins_to_action(bins)
        t1 = time.perf_counter()
        return ChunkResult(frame_id=int(frame_id), token_ids=gen, action_bins=bins, action=action,
                           prefill_ms=float(prefill_ms), decode_ms=float(decode_ms), total_ms=(t1 - t0) * 1e3,
                           evicted_frames=list(adm.evicted), kv_occupancy_tokens=int(self.kv.occupancy_tokens),
                           salient=bool(salient))

    def _device_chunk(self, cuda, x, frame_id, salient, pooled):
        tpf = self.kv.tokens_per_frame
        clock = time.perf_counter
        t = [clock()]
        with self._active():
            self._apply_moves()
            adm = self.kv.admit(frame_id, pooled(x), salient)
            self._ensure_capacity()
            ctx = np.asarray(self.kv.context_slots(), dtype=np.int32)
            n_ctx = len(ctx)
            dec = self.decode_tokens
            slots = np.concatenate([ctx, self.capacity + np.arange(dec, dtype=np.int32)])
            t.append(clock())
            self._set_inputs(x, slots, n_ctx, n_ctx - tpf, tpf, n_ctx)
            t.append(clock())
            self.ev[0].record(self.stream)
            self._run_prefill()
            self.ev[1].record(self.stream)
            self._run_decode()
            self.ev[2].record(self.stream)
            t.append(clock())
            cuda.memcpy_dtoh_async(self.h_tok, self.tok_buf, self.stream)
            cuda.memcpy_dtoh_async(self.h_logits, self.logits, self.stream)
            if self.persistent:
                cuda.memcpy_dtoh_async(self.h_pd_err, self.pd_err, self.stream)
            self.ev[3].record(self.stream)
            self.ev[3].synchronize()
            t.append(clock())
            # host-side split of the chunk's wall time (benchmarks): KV admission + slot list, input copies, graph
            # launches, waiting for the GPU
            self.host_profile_ms = {k: 1e3 * (b - a) for k, a, b in
                                    zip(("admit", "inputs", "launch", "wait"), t[:-1], t[1:])}
            if self.persistent and self.h_pd_err[0]:
                code, kind = int(self.h_pd_err[0]), self.tuning["decode_kernel"]
                cuda.memset_d32(self.pd_err, 0, 1)
                self.h_pd_err[0] = 0
                self.needs_reset = True
                why = {2: "a weight tile never landed", 3: "the launch does not match the kernel (threads, layers)"}
                raise EngineError(f"chunk {frame_id}: the {kind} decode kernel flagged the chunk (code {code}: "
                                  f"{why.get(code, 'a grid barrier / phase counter timed out: grid not resident')}); "
                                  "the chunk's tokens are invalid")
            prefill_ms = self.ev[1].time_since(self.ev[0])
            decode_ms = self.ev[2].time_since(self.ev[1])
        return adm, self.h_tok.astype(np.int64), prefill_ms, decode_ms

    # ---- read-back for tests and benchmarks --------------------------------------------------------------
    def read_final_hidden(self) -> tuple[np.ndarray, np.ndarray]:
        """(prefill rows (32, H), decode steps (decode_tokens, H)) of the final-normed hidden state."""
        with self._active():
            self.stream.synchronize()
            a = np.empty((T_CHUNK, self.H), np.float32)
            b = np.empty((self.decode_tokens, self.H), np.float32)
            self._cuda.memcpy_dtoh(a, self.final_h)
            self._cuda.memcpy_dtoh(b, self.final_h_dec)
        return a, b

    def time_kernels(self, reps: int = 20) -> dict[str, float]:
        """GPU ms per chunk of each kernel family: one graph per family holding only its launches of a whole
        chunk (prefill + decode), replayed ``reps`` times. Scribbles over activations and the decode scratch
        of the KV cache: call reset() afterwards if the engine is to be used again (benchmark only)."""
        from vla_edge_ros.engine.graphs import CudaGraph
        tags = ["rmsnorm", "gemm32_atomic", "gemm32_silu", "gemm32s_atomic", "gemm32s_silu", "gemm32v4_atomic",
                "gemm32v4_silu", "kv_store", "attn_prefill", "attn_combine", "attn_merge_oproj", "embed", "gemv_qkv",
                "attn_decode", "gemv_resid", "gemv_gateup", "decode_layers", "gemv_logits", "argmax"]
        out: dict[str, float] = {}
        with self._active():
            for tag in tags:
                self._only = {tag}
                try:
                    g = CudaGraph(tag).capture(self.stream, lambda: self._enqueue_prefill() + self._enqueue_decode())
                finally:
                    self._only = None
                if g.nodes_hint == 0:  # family unused by this configuration
                    g.destroy()
                    continue
                out[tag] = self._time_graph(g, reps)
        return out

    def _time_graph(self, g, reps: int) -> float:
        """GPU ms per replay of graph g (one warm-up replay, then reps between two events); destroys g."""
        try:
            g.launch(self.stream)
            self.ev[0].record(self.stream)
            for _ in range(reps):
                g.launch(self.stream)
            self.ev[1].record(self.stream)
            self.ev[1].synchronize()
            return self.ev[1].time_since(self.ev[0]) / reps
        finally:
            g.destroy()

    def time_ablations(self, reps: int = 20) -> dict[str, float]:
        """In-chain cost of each kernel family: GPU ms per chunk of one graph holding a whole chunk (prefill +
        decode) minus the same graph without that family's launches (``"full"``: the whole graph). Unlike
        time_kernels this keeps every overlap of the chain (PDL pre-wait work, tails). The results of the
        ablated graphs are garbage (tokens stay in range: argmax always picks an action row): benchmark only,
        call reset() afterwards."""
        from vla_edge_ros.engine.graphs import CudaGraph

        def timed(skip):
            self._skip = skip
            try:
                g = CudaGraph("ablate").capture(self.stream, lambda: self._enqueue_prefill() + self._enqueue_decode())
            finally:
                self._skip = None
            return self._time_graph(g, reps)

        tags = ["gemm32_atomic", "gemm32_silu", "gemm32v4_atomic", "gemm32v4_silu", "rmsnorm", "kv_store",
                "attn_prefill", "attn_combine", "attn_merge_oproj", "embed", "gemv_qkv", "attn_decode", "gemv_resid",
                "gemv_gateup", "gemv_logits", "argmax"]
        with self._active():
            full = timed(None)
            out = {"full": full}
            for tag in tags:
                out[tag] = full - timed({tag})
        return out

    def timeline(self, run_chunk: Callable[[], Any]) -> list[tuple[str, float, float, float]]:
        """One chunk's kernels in launch order (benchmark builds: $VLA_CUDA_TIMELINE=1 when the engine was made,
        graphs and PDL on): (name, first block started, first block past its PDL wait, last block past it), in
        us from the first kernel's start. Kernels are matched to launches by grid id order. Also sets
        ``timeline_pf_phases``: the last prefill attention launch's per-block phase ends (cuda/common.cuh
        vla_pf_stamp), (blocks, 5) in us on the same clock, NaN where a block did not reach a phase."""
        if not (self.timeline_build and self.pdl and self.use_graphs):
            raise EngineError("timeline needs an engine built with VLA_CUDA_TIMELINE=1, PDL and graphs")
        cuda = self._cuda
        rows_of = {}
        with self._active():
            self.stream.synchronize()
            for fname, mod in self.xmods.items():
                try:
                    ptr, size = self.pdl_launcher.global_ptr(mod, "vla_tl")
                except EngineError:  # a module none of whose kernels stamps
                    continue
                init = np.zeros((size // 32, 4), np.uint64)
                init[:, 1:3] = np.iinfo(np.uint64).max
                cuda.memcpy_htod(ptr, init)
                rows_of[fname] = (ptr, init)
            phases = []
            for mod in self.xmods.values():
                try:
                    ptr, size = self.pdl_launcher.global_ptr(mod, "vla_pf_phase")
                except EngineError:
                    continue
                cuda.memcpy_htod(ptr, np.zeros(size // 8, np.uint64))
                phases.append((ptr, size))
        run_chunk()
        with self._active():
            self.stream.synchronize()
            got = []
            for ptr, init in rows_of.values():
                a = np.empty_like(init)
                cuda.memcpy_dtoh(a, ptr)
                got.append(a[a[:, 0] != 0])
        rows = np.concatenate(got)
        rows = rows[np.argsort(rows[:, 0])][-len(self.launch_names):]
        if len(rows) != len(self.launch_names):
            raise EngineError(f"timeline: {len(rows)} stamped grids for {len(self.launch_names)} launches")
        t0 = int(rows[:, 1].min())
        us = lambda v: (int(v) - t0) / 1e3
        self.timeline_pf_phases = None
        with self._active():
            for ptr, size in phases:  # one module has the prefill attention's stamps
                a = np.empty(size // 8, np.uint64)
                cuda.memcpy_dtoh(a, ptr)
                a = a.reshape(-1, 5)
                a = a[:int(np.max(np.nonzero(a.any(axis=1))[0], initial=-1)) + 1]
                if len(a):
                    self.timeline_pf_phases = np.where(a == 0, np.nan, (a.astype(np.float64) - t0) / 1e3)
        return [(n, us(r[1]), us(r[2]), us(r[3])) for n, r in zip(self.launch_names, rows)]

    def _phase_stamps(self, kernel: str, n: int, run_chunk: Callable[[], Any], chunks: int) -> list[np.ndarray]:
        """Differences of the ``n`` timer stamps (pd_prof) that the ``kernel`` decode kernel writes in profile mode,
        one array per chunk of ``chunks`` chunks run by ``run_chunk()`` (the last decode step's stamps). Switches to
        that kernel for the measurement and back; [] when the kernel is unavailable on this device."""
        prev = self.tuning["decode_kernel"]
        self.retune(decode_kernel=kernel, pd_profile=True)
        out = []
        try:
            if not self.persistent:
                return out
            for _ in range(chunks):
                run_chunk()
                st = np.empty(n, np.uint64)
                with self._active():
                    self._cuda.memcpy_dtoh(st, self.pd_prof)
                out.append(np.diff(st.astype(np.int64)).astype(np.float64))
        finally:
            self.retune(decode_kernel=prev, pd_profile=False)
        return out

    def decode_phase_profile(self, run_chunk: Callable[[], Any], chunks: int = 20) -> dict[str, float]:
        """Share of each phase of the persistent decode kernel (critical path: block 0's clock64 at every barrier
        exit, barrier waits included), summed over the layers of the last decode step of ``chunks`` chunks run by
        ``run_chunk()``. Benchmark only."""
        diffs = self._phase_stamps("persistent", 6 * self.nlayers + 1, run_chunk, chunks)
        if not diffs:
            return {}
        # start->B_attn(0): qkv(0), then 6 per layer
        acc = sum(d.reshape(self.nlayers, 6).sum(axis=0) for d in diffs)
        return {name: float(v / acc.sum()) for name, v in zip(PD_PHASES, acc)}

    def dataflow_phase_profile(self, run_chunk: Callable[[], Any], chunks: int = 10) -> dict[str, float]:
        """Microseconds per layer of each phase of the dataflow decode kernel as block 0 sees it (%globaltimer
        after each counter wait: "qkv" runs from x ready to q/K/V ready in every block, i.e. block 0's QKV tiles and
        the slowest block's QKV; "attn" includes the copy requests of the next layer's old keys, "down" their
        rotation / transpose in shared memory), averaged over the layers of the last decode step of ``chunks``
        chunks run by ``run_chunk()``. "start": kernel start to x ready. Benchmark only."""
        names = ("qkv", "attn", "o_proj", "gate_up", "down")
        diffs = [d / 1e3 for d in self._phase_stamps("dataflow", 5 * self.nlayers + 2, run_chunk, chunks)]
        if not diffs:
            return {}
        out = {"start": float(np.mean([d[0] for d in diffs]))}
        acc = np.mean([d[1:].reshape(self.nlayers, 5).mean(axis=0) for d in diffs], axis=0)
        out.update({n: float(v) for n, v in zip(names, acc)})
        return out

    def reset(self) -> None:
        """Drop every retained frame; the pinned prefix (its K/V and slots) stays."""
        self.needs_reset = False
        if hasattr(self.kv, "reset"):
            self.kv.reset()
        else:
            kv = self.kv
            self.kv = type(kv)(kv.budget_tokens, kv.tokens_per_frame, kv.prefix_tokens, policy=kv.policy,
                               window_frames=kv.window_frames, semantic_evict=kv.semantic_evict)

    def memory(self) -> dict[str, int]:
        s = self.tracker.stats()
        return {"current_bytes": s["current_bytes"], "peak_bytes": s["peak_bytes"]}

    def _release(self) -> None:
        for g in getattr(self, "_graphs", {}).values():
            try:
                g.destroy()
            except Exception:
                pass
        self._graphs = {}
        tr = getattr(self, "tracker", None)
        if tr is not None:
            tr.free_all()
        if getattr(self, "pdl_launcher", None) is not None:
            self.pdl_launcher.unload()
            self.pdl_launcher = None

    def close(self) -> None:
        if getattr(self, "_ctx", None) is None:
            return
        with self._active():
            try:
                self.stream.synchronize()
            except Exception:
                pass
            self._release()
        self._ctx.detach()
        self._ctx = None

    def __del__(self):  # best effort; close() is the contract
        try:
            if getattr(self, "_ctx", None) is not None and getattr(self, "tracker", None) is not None:
                self.close()
        except Exception:
            pass
