"""What the CUDA engine launches, decided without a GPU: ``plan(cfg, tuning, limits) -> LaunchPlan``.

Why a pure module: every grid, split length and shared-memory size of a chunk follows from the model geometry, the
tuning and a few device numbers (SM count, shared-memory opt-in, registers of the compiled prefill attention). Kept
apart from PyCUDA they are unit-tested on CPU (test/test_cuda_plan.py), and a geometry the kernels cannot run is
refused here, by name, before anything is allocated. What runs and what is refused, geometry by geometry:
docs/GPU.md "Supported geometries and limits" (test/test_cuda_plan.py checks every Qwen2.5 size).

The kernels' own launch constants (warps per block, keys per split, the gemm32v4 tile) are read from the compiled
modules (kernels.py) into ``LaunchConstants``; the defaults below are the sources' values, checked against them by
test/test_cuda_compile.py. Measured effect of every tuning knob: docs/KERNEL_NOTES.md.

Also pure, in pass_meta.py (which imports T_CHUNK from here): the layout of the host-written ints a chunk's graphs
read (``chunk_meta``: a record per pass, then the forced prefix) and the row tiles of a parallel chunk
(``pass_tiles``, which vram.memory_plan sizes the passes' rows by).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable, Mapping, NamedTuple

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.cuda.arch import fit_shared_memory
from vla_edge_ros.engine.geometry import is_parallel
from vla_edge_ros.engine.interface import EngineError

T_CHUNK = 32  # prefill rows per pass: the GEMMs' two m16 tiles (cuda/gemm_skinny.cu); a frame is <= 32 tokens
HEAD_DIMS = (64, 128)  # the attention kernels' instantiations (cuda/rope_attention.cu)
INTER_QUANTUM = 32  # the MLP's K / N granularity (k32 steps, 8-row gate/up interleave): intermediate padded to it
BLOCK = 256   # threads of the row-wise kernels (RMSNorm, embedding gather, argmax, K/V move)
SMEM_DEFAULT = 48 * 1024  # dynamic shared memory a kernel gets without raising its limit
G4_USES = ("qkv", "o", "gateup", "down")  # prefill GEMMs that may run on gemm32v4_*
# kernel families whose PDL trigger can be late, in the order of the VlaFamily enum of cuda/common.cuh
LATE_TRIGGER_FAMILIES = ("qkv", "attn", "combine", "resid", "gateup", "gemm", "rmsnorm", "attn_pf")


@dataclass(frozen=True)
class LaunchConstants:
    """Compile-time constants of the kernels that the host sizes launches with (each file's vla_launch array)."""
    GEMM_WARPS: int = 8      # gemm32_*: warps per block, 16 weight rows each
    G4_NW: int = 8           # gemm32v4_*: warps per block
    G4_U: int = 6            # gemm32v4_*: k32 steps per warp (a split's K range <= 32 G4_NW G4_U)
    G4_SMEM: int = 147456    # gemm32v4_*: dynamic shared memory per block
    GEMV_WARPS: int = 8      # decode GEMVs: warps per block
    GEMV_RPW_I8: int = 4     # ... rows per warp of the int8 / fp8 / int4 GEMVs (bf16: 2; cuda/wtype.cuh)
    GEMV_RPW_F8: int = 4
    GEMV_RPW_I4: int = 4
    ATT_KC: int = 64         # keys per staged chunk = keys per split of both attention kernels
    DEC_WARPS: int = 4       # decode attention: warps per block
    DEC_MAXG: int = 8        # query heads one decode-attention block takes (more: head groups, attn_decode_*_hg)
    CMB_GROUPS: int = 8      # split merge: split groups (warps) per block
    PF_MAXG_128: int = 6     # query heads one prefill-attention block takes at head_dim 128 (its launch bound / 64)
    PF_MAXG_64: int = 8      # ... at head_dim 64
    PFG_MAXG_128: int = 4    # query heads of one head group of attn_prefill_hd128_hg (its launch bound / 64)
    PFG_MAXG_64: int = 8     # ... of attn_prefill_hd64_hg
    GR_WARPS: int = 8        # gemv_rows_atomic (the fleet's decode passes, cuda/fleet.cu): warps per block
    GR_MAXM: int = 16        # ... and the most rows (robots) it takes
    GT_BN: int = 128         # gemm_tiled* (tuning fleet_gemm / parallel_gemm = tiled): columns of C per block
    GT_SMEM128: int = 110592  # ... dynamic shared memory of the 128-row and the 64-row block tile (sm_90's)
    GT_SMEM64: int = 82944
    GT_BK: int = 64           # ... K step (a split's length is a multiple of it; 32 on sm_86 / sm_89)


FLEET_GEMVS = ("mma", "rows")  # engine/cuda/fleet_forward.FLEET_GEMV's kernels
MANY_ROW_GEMMS = ("tiles32", "tiled")  # many-row GEMMs (fleet_gemm, parallel_gemm): 32-row tiles | gemm_tiled*


@dataclass(frozen=True)
class Tuning:
    """Launch choices that do not change results. Defaults: the fastest measured (on the H200; since session 33 on
    the H100, the only card lent)."""
    pdl: bool = True  # programmatic dependent launch (off: +1.65 ms per chunk on the H200); sm_90 only
    gemm_v4: tuple[str, ...] = ("gateup", "down")  # prefill GEMMs on gemm32v4 (qkv and o on it: +0.10 ms)
    # families that let their successor launch after their own PDL wait, not at their start: at most two kernels
    # wait behind a running one (none late: +0.80 ms; all: +0.04 to +0.13 ms)
    late_trigger: tuple[str, ...] = ("attn", "combine", "resid", "gateup", "gemm", "rmsnorm", "attn_pf")
    gemm_target_blocks: int = 264  # split-K prefill GEMMs: blocks per launch to aim for
    gemm_min_ks: int = 256         # ... and the shortest K split
    gemv_target_blocks: int = 264  # split-K decode GEMVs (o_proj, down)
    gemv_min_ks: int = 512
    fleet_gemv: str = "mma"  # the fleet's decode GEMMs (<= 16 robots): mma (gemv_rows_mma) | rows (gemv_rows_atomic)
    # the fleet's GEMMs of more rows (prefill): tiles32 (gemm32t_atomic: weights in registers, 32-row tiles in turn)
    # | tiled (gemm_tiled*_atomic: both operands staged, 128- or 64-row block tiles; H100, session 34: 8-robot batch
    # 31.4 -> 27.9 ms, prefill 11.8 -> 8.5)
    fleet_gemm: str = "tiled"
    # the single engine's parallel pass of more than 32 slots (issue 22, H = 8: 2 tiles): tiles32 (the 32-row
    # kernels once per tile) | tiled (gemm_tiled*: one launch over every tile, weights read once; bf16 only; H100,
    # session 34: H = 8 chunk 6.18 -> 5.42 ms)
    parallel_gemm: str = "tiled"
    # a parallel chunk as ONE pass (issue 22): the frame's 32 rows and the slot tiles together (each GEMM over all of
    # them; the frame's attention first), instead of the prefill pass then the parallel pass (H100, session 34: 6.01
    # ms on tiles32, 5.66 tiled, against 5.42 for two passes: its 96 rows fit no block tile well)
    fused_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("gemm_v4", "late_trigger"):
            v = getattr(self, name)
            if isinstance(v, str):
                v = tuple(n.strip() for n in v.split(",") if n.strip())
            object.__setattr__(self, name, tuple(v))
        for name, known in (("gemm_v4", G4_USES), ("late_trigger", LATE_TRIGGER_FAMILIES)):
            bad = [n for n in getattr(self, name) if n not in known]
            if bad:
                raise EngineError(f"tuning {name}: unknown {', '.join(map(repr, bad))} (known: {', '.join(known)})")
        for f in ("pdl", "fused_parallel"):
            if not isinstance(getattr(self, f), bool):
                raise EngineError(f"tuning {f} must be true or false, got {getattr(self, f)!r}")
        if self.fleet_gemv not in FLEET_GEMVS:
            raise EngineError(f"tuning fleet_gemv must be one of {', '.join(FLEET_GEMVS)}, got {self.fleet_gemv!r}")
        for f in ("fleet_gemm", "parallel_gemm"):
            if getattr(self, f) not in MANY_ROW_GEMMS:
                raise EngineError(f"tuning {f} must be one of {', '.join(MANY_ROW_GEMMS)}, got {getattr(self, f)!r}")
        for f in ("gemm_target_blocks", "gemm_min_ks", "gemv_target_blocks", "gemv_min_ks"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EngineError(f"tuning {f} must be a positive integer, got {v!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> "Tuning":
        return cls().with_changes(**dict(values or {}))

    def with_changes(self, **changes: Any) -> "Tuning":
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise EngineError(f"unknown tuning key(s) {', '.join(bad)} (known: {', '.join(sorted(known))})")
        return replace(self, **changes)


@dataclass(frozen=True)
class DeviceLimits:
    """What the plan needs to know about the device and the compiled kernels."""
    sm_count: int
    smem_optin: int  # dynamic + static shared memory one block may opt in to
    pdl: bool        # the build and the driver can launch with programmatic dependent launch
    max_threads: int = 1024
    regs_per_block: int = 65536
    prefill_attn_regs: int = 0  # registers per thread of the compiled prefill attention (0: not known)
    constants: LaunchConstants = field(default_factory=LaunchConstants)


class Launch(NamedTuple):
    """One kernel use: name, grid, block and dynamic shared memory; ks: the K split length of a split-K GEMM (an
    argument of gemm32_atomic, 0 for the kernels that take none)."""
    kernel: str
    grid: tuple[int, ...]
    block: tuple[int, int, int]
    smem: int = 0
    ks: int = 0


@dataclass(frozen=True)
class LaunchPlan:
    """Every launch of a chunk for one geometry, tuning and device. Attention grids: ``(splits(slots), n_kvh)``, or
    ``(splits(slots), n_kvh, head groups)`` where a KV head's query heads do not fit one block."""
    # prefill
    norm_rows: Launch           # RMSNorm of the 32 rows -> bf16 (+ the QKV bias copied into the GEMM output)
    gemm_qkv: Launch
    attn_prefill: Launch        # grid x filled per KV capacity; grid z: head groups (the *_hg kernels)
    merge_prefill: Launch
    gemm_o: Launch
    gemm_gateup: Launch
    gemm_down: Launch
    final_norm: Launch
    # decode
    embed: Launch
    gemv_qkv: Launch
    attn_decode: Launch         # grid x filled per KV capacity
    merge_decode: Launch
    gemv_o: Launch
    gemv_gateup: Launch
    gemv_down: Launch
    logits: Launch
    argmax: Launch
    vision: Launch              # patch projection (encode_frame)
    raise_smem: Mapping[str, int]  # kernels whose dynamic shared memory limit must be raised, and to what
    pdl: bool
    late_trigger_mask: int
    keys_per_split: int
    notes: tuple[str, ...] = ()  # decisions worth a log line (a GEMM moved off gemm32v4, ...)
    # the parallel pass's qkv, o, gate/up (SiLU) and down over all its tiles at once (tuning parallel_gemm =
    # "tiled", bf16, more than one tile; fused: the frame's tile too); empty: each tile on the 32-row launches above
    parallel_gemms: tuple[Launch, ...] = ()
    fused_parallel: bool = False  # a parallel chunk is one pass, the frame's tile first (tuning fused_parallel)

    def splits(self, slots: int) -> int:
        """Attention splits (blocks per KV head) over ``slots`` cache rows."""
        return math.ceil(slots / self.keys_per_split)


def split_len(K: int, row_blocks: int, target_blocks: int, quantum: int, min_len: int) -> int:
    """Split-K length (multiple of ``quantum``, >= min_len) giving about ``target_blocks`` blocks in all."""
    splits = max(1, math.ceil(target_blocks / max(1, row_blocks)))
    ks = _round_up(math.ceil(K / splits), quantum)
    return min(_round_up(K, quantum), max(ks, _round_up(min_len, quantum)))


def _tiled_shape_problem(c: LaunchConstants, N: int, K: int, silu: bool) -> str:
    """gemm_tiled*'s shape rule ("" when met): K in whole K steps; N even, or for the SiLU form in whole groups of 16
    gate + 16 up rows."""
    if N % (32 if silu else 2) or K % c.GT_BK:
        return f"the tiled GEMM takes N a multiple of {32 if silu else 2} and K of {c.GT_BK}, not {N} x {K}"
    return ""


def tiled_gemm_unfit(c: LaunchConstants, shapes: Iterable[tuple[int, int, bool]], rows: int,
                     smem_optin: int) -> str:
    """Why gemm_tiled* cannot take these (N, K, silu) GEMMs of ``rows`` rows on this build and device ("" when it
    can): K in whole K steps, the SiLU form's N in whole groups of 16 gate + 16 up rows, its block tile's shared
    memory. The callers then keep the 32-row kernels (a model is never refused for it)."""
    for N, K, silu in shapes:
        why = _tiled_shape_problem(c, N, K, silu)
        if why:
            return why
    need = c.GT_SMEM64 if 32 * math.ceil(rows / 32) <= 64 else c.GT_SMEM128
    if need > smem_optin:
        return f"the tiled GEMM needs {need} B of shared memory per block, this device allows {smem_optin}"
    return ""


def tiled_gemm(c: LaunchConstants, t: Tuning, N: int, K: int, rows: int, silu: bool = False) -> Launch:
    """gemm_tiled*'s launch (cuda/gemm_tiled.cu) for the pass's 32-row tiles: block tiles of 64 rows up to 64, else
    128 (a weight read from DRAM once per 128 rows: 96 rows as two 64-row tiles, each reading every weight, made the
    fused H = 8 pass slower than the 32-row kernels per tile, session 33). grid = (row blocks, column blocks, K
    splits). _atomic: K split only as far as tuning.gemm_target_blocks asks (each split adds its partial sums into C
    by atomics), each split at least tuning.gemm_min_ks columns; _silu (the gate/up GEMM writing silu(gate) * up):
    one split."""
    why = _tiled_shape_problem(c, N, K, silu)
    if why:
        raise EngineError(f"gemm_tiled: {why}")
    R = 32 * math.ceil(rows / 32)
    bm = 64 if R <= 64 else 128
    gy, gx = math.ceil(R / bm), math.ceil(N / c.GT_BN)
    smem = c.GT_SMEM128 if bm == 128 else c.GT_SMEM64
    if silu:
        return Launch(f"gemm_tiled{bm}_silu", (gy, gx, 1), (256, 1, 1), smem)
    ks = split_len(K, gx * gy, t.gemm_target_blocks, c.GT_BK, t.gemm_min_ks)
    return Launch(f"gemm_tiled{bm}_atomic", (gy, gx, math.ceil(K / ks)), (256, 1, 1), smem, ks)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def gemm4_grid(N: int, K: int, n_sm: int, max_splits: int = 0, tol: float = 0.02,
               c: LaunchConstants = LaunchConstants()) -> tuple[int, int]:
    """Grid (R row-group ranges, S K splits) of gemm32v4_*: R x S <= n_sm blocks (one per SM), the K range of a
    split at most G4_NW x G4_U k32 steps, S <= max_splits when given (the SiLU epilogue needs S == 1). Minimises
    the largest block's work (16-row groups x k32 steps); within `tol` of that, the fewest splits (each split adds
    32 x N fp32 atomics)."""
    if N % 16 or K % 32 or N <= 0 or K <= 0:
        raise EngineError(f"gemm32v4: N={N} must be a multiple of 16 and K={K} of 32")
    nrg, nsteps = N // 16, K // 32
    s_min = math.ceil(nsteps / (c.G4_NW * c.G4_U))
    s_max = min(nsteps, n_sm, s_min + 32, max_splits or n_sm)
    if s_min > s_max:
        raise EngineError(f"gemm32v4: K={K} needs {s_min} splits, at most {s_max} allowed")
    cands = []
    for S in range(s_min, s_max + 1):
        R = max(1, min(nrg, n_sm // S))
        cands.append((math.ceil(nrg / R) * math.ceil(nsteps / S), S, R))
    best = min(cost for cost, _, _ in cands)
    S, _, R = min((S, cost, R) for cost, S, R in cands if cost <= best * (1 + tol))
    return R, S


def late_trigger_mask(families) -> int:
    """('attn', 'combine') or 'attn,combine' -> the VlaFamily bit mask of cuda/common.cuh."""
    names = families.split(",") if isinstance(families, str) else families
    mask = 0
    for name in (n.strip() for n in names):
        if not name:
            continue
        if name not in LATE_TRIGGER_FAMILIES:
            raise EngineError(f"late_trigger: unknown kernel family {name!r} "
                              f"(known: {', '.join(LATE_TRIGGER_FAMILIES)})")
        mask |= 1 << LATE_TRIGGER_FAMILIES.index(name)
    return mask


def padded_intermediate(cfg: ModelConfig) -> int:
    """The intermediate size the MLP kernels run at: a multiple of INTER_QUANTUM. The weights are zero-padded at
    upload (gate / up rows and down columns), which adds exact zeros: silu(0) * 0 = 0 meets a zero column."""
    return _round_up(cfg.intermediate_size, INTER_QUANTUM)


def check_geometry(cfg: ModelConfig, limits: DeviceLimits) -> None:
    """Refuse, with every reason at once, a model the kernels cannot run on this device (docs/GPU.md lists what
    runs). Any number of query heads per KV head runs (head groups past one block's), any intermediate size
    (padded), any layer count, vocabulary and tied or untied head."""
    HD = cfg.head_dim
    problems = []
    if HD not in HEAD_DIMS:
        problems.append(f"head_dim={HD} (hidden_size / num_attention_heads; the attention kernels are built for "
                        f"{' and '.join(map(str, HEAD_DIMS))})")
    if cfg.hidden_size % 32:  # implied by the head dims (a multiple of 64), kept for the GEMMs' k32 steps
        problems.append(f"hidden_size={cfg.hidden_size} is not a multiple of 32")
    if cfg.n_action_bins > 1024:
        problems.append(f"n_action_bins={cfg.n_action_bins} > 1024")
    vec = 4 * cfg.hidden_size  # the decode GEMVs keep their fp32 input vector in shared memory
    if vec > limits.smem_optin:
        problems.append(f"hidden_size={cfg.hidden_size}: the decode GEMVs need {vec} bytes of shared memory for "
                        f"the input vector, the device allows {limits.smem_optin} per block")
    if problems:
        raise EngineError(f"model {cfg.source}: geometry not supported by the CUDA kernels: " + "; ".join(problems))


def attention_launches(cfg: ModelConfig, limits: DeviceLimits) -> tuple[Launch, Launch, list[str]]:
    """(prefill, decode) attention launches, grid x left 0 (filled per KV capacity), and the notes to log.

    The prefill block holds G heads (2G warps of 168 / 126 registers at head_dim 128 / 64): at most PF_MAXG_128 = 6 /
    PF_MAXG_64 = 8 (the kernels' launch bounds, and the register file); the decode block at most DEC_MAXG = 8 (one
    m16 tile). Past that, the head-group kernels (*_hg) split a KV head's G heads into grid.z groups of
    ceil(G / groups) <= PFG_MAXG_* / DEC_MAXG, each group staging the same keys: Qwen2.5-3B (16 / 2 heads) and 72B
    (64 / 8) have G = 8, 7B (28 / 4) G = 7 at head_dim 128."""
    c, HD = limits.constants, cfg.head_dim
    n_kvh = cfg.num_key_value_heads
    G = cfg.num_attention_heads // n_kvh

    def heads_per_block(bound: int) -> int:  # the launch bound's heads, within the device's threads and registers
        n = min(bound, limits.max_threads // 64)
        if limits.prefill_attn_regs:
            n = min(n, limits.regs_per_block // (64 * limits.prefill_attn_regs))
        return n

    notes = []
    maxg = heads_per_block(c.PF_MAXG_128 if HD == 128 else c.PF_MAXG_64)
    if G <= maxg:
        prefill = Launch(f"attn_prefill_hd{HD}", (0, n_kvh), (64 * G, 1, 1))
    else:
        per_max = heads_per_block(c.PFG_MAXG_128 if HD == 128 else c.PFG_MAXG_64)
        if per_max < 1:
            raise EngineError(f"model {cfg.source}: the prefill attention (head_dim {HD}, {limits.prefill_attn_regs}"
                              f" registers per thread) does not fit one block of {limits.max_threads} threads / "
                              f"{limits.regs_per_block} registers on this device")
        groups = math.ceil(G / per_max)
        per = math.ceil(G / groups)
        prefill = Launch(f"attn_prefill_hd{HD}_hg", (0, n_kvh, groups), (64 * per, 1, 1))
        notes.append(f"prefill attention: {G} query heads per KV head > {maxg} per block at head_dim {HD}: "
                     f"{groups} head groups of {per} (attn_prefill_hd{HD}_hg)")
    block = (32 * c.DEC_WARPS, 1, 1)
    if G <= c.DEC_MAXG:
        decode = Launch(f"attn_decode_hd{HD}", (0, n_kvh), block)
    else:
        groups = math.ceil(G / c.DEC_MAXG)
        decode = Launch(f"attn_decode_hd{HD}_hg", (0, n_kvh, groups), block)
        notes.append(f"decode attention: {G} query heads per KV head > {c.DEC_MAXG} per block: {groups} head "
                     f"groups (attn_decode_hd{HD}_hg)")
    return prefill, decode, notes


def plan(cfg: ModelConfig, tuning: Tuning, limits: DeviceLimits) -> LaunchPlan:
    """The launches of one chunk (see LaunchPlan) for this model, tuning and device; EngineError when it cannot."""
    check_geometry(cfg, limits)
    c, t = limits.constants, tuning
    H, I, HD = cfg.hidden_size, padded_intermediate(cfg), cfg.head_dim
    Hq, n_kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    nq, nqkv = Hq * HD, (Hq + 2 * n_kvh) * HD
    n_bins, T, n_sm = cfg.n_action_bins, T_CHUNK, limits.sm_count
    smem: dict[str, int] = {}
    notes: list[str] = []

    # ---- prefill GEMMs: gemm32v4 (one block per SM) where the tuning asks and its shared memory fits the device,
    # else the split-K gemm32 (the fallback on 99 KB parts, and for a gate/up whose K does not fit one block)
    gemm_rows, gemm_block = 16 * c.GEMM_WARPS, (32 * c.GEMM_WARPS, 1, 1)

    def split_k_gemm(N: int, K: int) -> Launch:
        rb = math.ceil(N / gemm_rows)
        ks = split_len(K, rb, t.gemm_target_blocks, 32, t.gemm_min_ks)
        return Launch("gemm32_atomic", (rb, math.ceil(K / ks)), gemm_block, ks=ks)

    shapes = {"qkv": (nqkv, H, 0), "o": (H, nq, 0), "gateup": (2 * I, H, 1), "down": (H, I, 0)}
    v4 = {u: shapes[u] for u in t.gemm_v4 if not (u == "gateup" and H > 32 * c.G4_NW * c.G4_U)}
    kept, note = fit_shared_memory(set(v4), c.G4_SMEM, limits.smem_optin)
    if note:
        notes.append(note)
    g4_block = (32 * c.G4_NW, 1, 1)

    def prefill_gemm(use: str) -> Launch:
        N, K, silu = shapes[use]
        if use in kept:
            kernel = "gemm32v4_silu" if silu else "gemm32v4_atomic"
            try:
                grid = gemm4_grid(N, K, n_sm, silu, c=c)
            except EngineError as exc:  # K needs more splits than the device has SMs: the split-K gemm32
                notes.append(f"{use} GEMM on gemm32 instead of {kernel} ({exc})")
            else:
                smem[kernel] = c.G4_SMEM
                return Launch(kernel, grid, g4_block, c.G4_SMEM)
        if silu:  # the SiLU epilogue needs the whole K in one block
            return Launch("gemm32_silu", (math.ceil(N / gemm_rows), 1), gemm_block)
        return split_k_gemm(N, K)

    # ---- decode GEMVs: two rows per warp (gate/up: one intermediate = a gate and an up row), split-K for o / down
    gw = c.GEMV_WARPS
    gemv_block = (32 * gw, 1, 1)

    max_ks = limits.smem_optin // 4 // 256 * 256  # a split's fp32 input slice must fit the block's shared memory

    def split_k_gemv(N: int, K: int) -> Launch:
        rb = math.ceil(N / (2 * gw))
        ks = min(split_len(K, rb, t.gemv_target_blocks, 256, t.gemv_min_ks), max_ks)
        return Launch("gemv_resid", (rb, math.ceil(K / ks)), gemv_block, 4 * ks, ks)

    gemv_o, gemv_down = split_k_gemv(H, nq), split_k_gemv(H, I)
    for name, need in (("gemv_qkv", 4 * H), ("gemv_gateup", 4 * H), ("gemv_logits", 4 * H),
                       ("gemv_resid", max(gemv_o.smem, gemv_down.smem))):
        smem[name] = max(smem.get(name, 0), need)
    # ---- the parallel pass of more than one tile, each GEMM once over every tile (tuning parallel_gemm = "tiled")
    parallel_gemms: tuple[Launch, ...] = ()
    from vla_edge_ros.engine.cuda.pass_meta import parallel_tiles, pass_tiles  # (they import T_CHUNK from here)
    fused = t.fused_parallel and is_parallel(cfg)
    tiles = pass_tiles(cfg) if fused else parallel_tiles(cfg)  # the pass's tiles: the frame's too when fused
    if t.parallel_gemm == "tiled" and tiles > 1:
        # (the module's constants fit its own part; the CPU plans with sm_90's)
        unfit = tiled_gemm_unfit(c, [(N, K, use == "gateup") for use, (N, K, _) in shapes.items()], T * tiles,
                                 limits.smem_optin)
        if unfit:
            notes.append(f"parallel pass on the 32-row kernels per tile: {unfit}")
        else:
            parallel_gemms = tuple(tiled_gemm(c, t, N, K, T * tiles, silu=use == "gateup")
                                   for use, (N, K, _) in shapes.items())
        for launch in parallel_gemms:
            smem[launch.kernel] = launch.smem
    for name, need in smem.items():
        if need > limits.smem_optin:
            raise EngineError(f"{name} needs {need} bytes of shared memory, the device allows {limits.smem_optin}")

    # ---- attention: splits of ATT_KC keys; the prefill's merge with as many dims per thread as HD allows (4: -0.05
    # ms per chunk), the decode's with one (2 no gain, 4 +0.14 ms: 12 blocks)
    vec = 4
    while HD % (32 * vec):
        vec //= 2
    merge_block = (32 * c.CMB_GROUPS, 1, 1)
    attn_prefill, attn_decode, attn_notes = attention_launches(cfg, limits)
    notes.extend(attn_notes)
    row = (T, 1)
    return LaunchPlan(
        norm_rows=Launch("rmsnorm_rows_bf16", row, (BLOCK, 1, 1)),
        gemm_qkv=prefill_gemm("qkv"),
        attn_prefill=attn_prefill,
        merge_prefill=Launch("attn_combine" if vec == 1 else f"attn_combine_v{vec}",
                             (Hq * T * HD // (32 * vec), 1), merge_block),
        gemm_o=prefill_gemm("o"),
        gemm_gateup=prefill_gemm("gateup"),
        gemm_down=prefill_gemm("down"),
        final_norm=Launch("rmsnorm_rows_f32", row, (BLOCK, 1, 1)),
        embed=Launch("embed_gather", (math.ceil(H / BLOCK), 1), (BLOCK, 1, 1)),
        gemv_qkv=Launch("gemv_qkv", (math.ceil(nqkv / (2 * gw)), 1), gemv_block, 4 * H),
        attn_decode=attn_decode,
        merge_decode=Launch("attn_combine", (Hq * HD // 32, 1), merge_block),
        gemv_o=gemv_o,
        gemv_gateup=Launch("gemv_gateup", (math.ceil(I / gw), 1), gemv_block, 4 * H),
        gemv_down=gemv_down,
        logits=Launch("gemv_logits", (math.ceil(n_bins / gw), 1), gemv_block, 4 * H),
        argmax=Launch("argmax_tokens", (1, 1), (BLOCK, 1, 1)),
        vision=Launch("gemm32_atomic", *_vision_grid(cfg, gemm_rows, gemm_block)),
        raise_smem={k: v for k, v in smem.items() if v > SMEM_DEFAULT},
        pdl=bool(t.pdl and limits.pdl),
        late_trigger_mask=late_trigger_mask(t.late_trigger),
        keys_per_split=c.ATT_KC,
        notes=tuple(notes),
        parallel_gemms=parallel_gemms,
        fused_parallel=fused)


WEIGHT_LAUNCHES = ("gemm_qkv", "gemm_o", "gemm_gateup", "gemm_down", "gemv_qkv", "gemv_o", "gemv_gateup", "gemv_down")
KERNEL_SUFFIX = {"bf16": "", "int8": "_i8", "fp8": "_f8", "int4": "_i4"}  # the kernels' weight types (cuda/wtype.cuh)
GEMV_LAUNCHES = tuple(n for n in WEIGHT_LAUNCHES if n.startswith("gemv"))
BF16_GEMV_RPW = 2  # rows per warp of the bf16 GEMVs (gate/up: one output = a gate and an up row)


def gemv_rows_per_warp(weight_dtype: str, c: LaunchConstants = LaunchConstants()) -> int:
    return {"bf16": BF16_GEMV_RPW, "int8": c.GEMV_RPW_I8, "fp8": c.GEMV_RPW_F8, "int4": c.GEMV_RPW_I4}[weight_dtype]


def for_weight_dtype(p: LaunchPlan, weight_dtype: str, cfg: ModelConfig,
                     c: LaunchConstants = LaunchConstants()) -> LaunchPlan:
    """The plan with the decoder's linear layers on the kernels of ``weight_dtype``. The GEMMs keep their grids; a
    GEMV warp takes more rows (a lane load is 16 bytes: 8 bf16, 16 int8 / fp8, 32 int4 weights, and a warp keeps
    bf16's bytes in flight), so its row grid shrinks by the factor f; block and shared memory stay (the input
    vector). The split-K GEMVs (o_proj, down) take f times bf16's K splits instead (split length a multiple of 256,
    at least 256, so an int4 split starts on a group of 128): the same number of blocks as bf16's, where keeping
    bf16's splits left half of them (H200, 1.5B, int8 7-pass chunk: 9.58 -> 8.56 ms, session 18). The vision
    projection and the LM head stay bf16."""
    if weight_dtype not in KERNEL_SUFFIX:
        raise EngineError(f"weight_dtype={weight_dtype!r}: the CUDA kernels take {', '.join(KERNEL_SUFFIX)}")
    suffix = KERNEL_SUFFIX[weight_dtype]
    if not suffix:
        return p
    f = gemv_rows_per_warp(weight_dtype, c) // BF16_GEMV_RPW
    moved = {}
    split_k = {"gemv_o": cfg.num_attention_heads * cfg.head_dim, "gemv_down": padded_intermediate(cfg)}  # their K
    for name in WEIGHT_LAUNCHES:
        launch = getattr(p, name)
        grid, ks, smem = launch.grid, launch.ks, launch.smem
        if name in GEMV_LAUNCHES:
            grid = (math.ceil(grid[0] / f),) + tuple(grid[1:])
        if name in split_k and ks:  # f times the splits; the input slice in shared memory shrinks with them
            K = split_k[name]
            ks = max(256, _round_up(math.ceil(K / (math.ceil(K / ks) * f)), 256))
            grid, smem = (grid[0], math.ceil(K / ks)) + tuple(grid[2:]), 4 * ks
        moved[name] = launch._replace(kernel=launch.kernel + suffix, grid=grid, ks=ks, smem=smem)
    smem = dict(p.raise_smem)
    smem.update({name + suffix: n for name, n in p.raise_smem.items()
                 if any(m.kernel == name + suffix for m in moved.values())})
    notes = p.notes + (("parallel pass on the 32-row kernels per tile: the tiled GEMMs take bf16 weights only",)
                       if p.parallel_gemms else ())
    return replace(p, raise_smem=smem, parallel_gemms=(), notes=notes, **moved)


def _vision_grid(cfg: ModelConfig, rows: int, block) -> tuple:
    """The patch projection (T x patch_dim -> T x hidden) as a split-K GEMM: (grid, block, smem, ks)."""
    K, rb = cfg.patch_dim, math.ceil(cfg.hidden_size / rows)
    ks = split_len(K, rb, 132, 32, 256)
    return (rb, math.ceil(K / ks)), block, 0, ks
