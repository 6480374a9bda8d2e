"""The host-written ints a chunk's graphs read (``chunk_meta``: a record per pass, then the forced prefix), the row
tiles of a parallel chunk (``parallel_tiles``; ``pass_tiles`` with the frame's) and the refusal of one wider than
PARALLEL_MAX_TILES tiles (``parallel_slots_problem``).

Why a module of its own: kernel arguments are frozen at CUDA-graph capture, so whatever changes per chunk (keys seen,
the position of row 0, rows, n_ctx, whether the rows see each other both ways, the forced action tokens) is read from
ONE device buffer (buffers.Activations.meta), written by one async copy before the replays. Its layout is shared by
the host (buffers.py, engine.py) and the kernels (cuda/rope_attention.cu's meta), and, like plan.py's launches, it is
pure: unit-tested on CPU (test/test_cuda_plan.py). The parallel pass's tiles live here because they size that buffer
(a record per tile); vram.memory_plan reads both.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.cuda.plan import T_CHUNK
from vla_edge_ros.engine.geometry import chunk_action_tokens, is_parallel
from vla_edge_ros.engine.interface import EngineError


PARALLEL_MAX_TILES = 8  # row tiles of one parallel pass: 8 x 32 = 256 action slots (H <= 36 at 7 action dims)


def parallel_tiles(cfg: ModelConfig) -> int:
    """T_CHUNK-row tiles of the parallel pass's A slot rows (1 for an autoregressive chunk: the frame's one tile).
    Every GEMM, attention and merge of that pass runs once per tile (forward.parallel): more slots cost more passes
    over the weights, but no kernel changes."""
    return max(1, math.ceil(chunk_action_tokens(cfg) / T_CHUNK)) if is_parallel(cfg) else 1


def pass_tiles(cfg: ModelConfig) -> int:
    """T_CHUNK-row tiles of the prefill-shaped passes' buffers (buffers.Activations, vram.memory_plan): the frame's,
    then a parallel chunk's slot tiles after it. The fused pass (tuning fused_parallel) runs the frame and the slots
    as one pass over all of them; apart, the parallel pass reuses the first parallel_tiles ones."""
    return 1 + parallel_tiles(cfg) if is_parallel(cfg) else 1


def parallel_slots_problem(cfg: ModelConfig) -> str | None:
    """Why the CUDA parallel pass cannot decode ``cfg``'s action slots (None: it can, or cfg decodes
    autoregressively). The A = action_horizon x action_dims slots are the rows of one prefill-shaped pass in tiles
    of T_CHUNK = 32 rows, at most PARALLEL_MAX_TILES of them (the activations are sized for them at start-up)."""
    a = chunk_action_tokens(cfg)
    if not is_parallel(cfg) or a <= PARALLEL_MAX_TILES * T_CHUNK:
        return None
    most = PARALLEL_MAX_TILES * T_CHUNK
    return (f"vla.chunk_decode='parallel' with {a} action slots (vla.action_horizon {cfg.action_horizon} x "
            f"{cfg.action_dims} action dims): the CUDA parallel pass decodes at most {most} slots "
            f"({PARALLEL_MAX_TILES} row tiles of {T_CHUNK}); use an action_horizon of at most "
            f"{most // max(1, int(cfg.action_dims))}, chunk_decode \"autoregressive\", or backend numpy")


# ---- the host-written ints of a chunk (buffers.Activations.meta): a record per pass, then the forced prefix -------
# Kernel arguments are frozen at capture, so whatever changes per chunk is read from here. ONE buffer, written by one
# async copy before the replays: the parallel pass's record sits beside the frame prefill's (its graph is captured
# with a pointer to it) instead of a second copy between the two replays (one more API call per chunk).
META_INTS = 8  # a pass's record: [L keys seen, p0 position of row 0, T rows, n_ctx, bidirectional, 0, 0, 0]
PARALLEL_RECORD = META_INTS  # int offset of the parallel pass's record (its tile 0; tile t at (1 + t) META_INTS)
FORCED_AT = 2 * META_INTS  # int offset of forced[n_gen] with one parallel tile (forced_at: with more)


def forced_at(tiles: int = 1) -> int:
    """Int offset of forced[n_gen]: after the frame's record and one record per parallel row tile."""
    return (1 + int(tiles)) * META_INTS


def meta_ints(n_gen: int, tiles: int = 1) -> int:
    """Ints of the meta buffer of a chunk whose gen has ``n_gen`` entries (scratch slots + 1)."""
    return forced_at(tiles) + int(n_gen)


def meta_record(L: int, p0: int, T: int, n_ctx: int, bidirectional: bool = False) -> list[int]:
    """One pass's record (cuda/rope_attention.cu's meta): keys seen, position of row 0, rows, the context
    length the decode steps start from, and whether the rows see each other both ways (the parallel pass)."""
    return [int(L), int(p0), int(T), int(n_ctx), int(bool(bidirectional)), 0, 0, 0]


def parallel_record(n_ctx: int, slots: int) -> list[int]:
    """The parallel pass's record: its ``slots`` rows at positions n_ctx .. n_ctx + slots - 1 (scratch slots after
    the context in the slot list), seeing the whole context and every slot (bidirectional)."""
    return meta_record(n_ctx + slots, n_ctx, slots, n_ctx, bidirectional=True)


def parallel_records(n_ctx: int, slots: int) -> list[list[int]]:
    """One record per T_CHUNK-row tile of the parallel pass: tile t's rows are slots 32t .. (positions n_ctx + 32t
    ..), every tile sees all n_ctx + slots keys. Tile t > 0 is attended by its own launch whose p0 says which keys
    are already in the cache (tile 0's launch stored every slot's K/V; forward.parallel)."""
    return [meta_record(n_ctx + slots, n_ctx + t, min(T_CHUNK, slots - t), n_ctx, bidirectional=True)
            for t in range(0, max(int(slots), 1), T_CHUNK)]


def chunk_meta(n_gen: int, record: Sequence[int], parallel: Sequence[Sequence[int]] | Sequence[int] | None = None,
               forced: np.ndarray | None = None, tiles: int = 1) -> np.ndarray:
    """The whole meta buffer (int32, ``meta_ints(n_gen, tiles)``): the frame prefill's (or the prefix's) record, the
    parallel pass's records (one per row tile, ``parallel_records``; a single record is tile 0's; zeros when there
    is none), forced = engine/geometry.forced_gen's (n_gen,) ids (-1 = free; None: nothing forced)."""
    out = np.zeros(meta_ints(n_gen, tiles), np.int32)
    out[:META_INTS] = record
    if parallel is not None:
        recs = [parallel] if np.ndim(parallel) == 1 else list(parallel)
        if len(recs) > tiles:
            raise EngineError(f"{len(recs)} parallel records, the meta buffer holds {tiles}")
        for t, rec in enumerate(recs):
            out[PARALLEL_RECORD + t * META_INTS:PARALLEL_RECORD + (t + 1) * META_INTS] = rec
    at = forced_at(tiles)
    out[at:] = -1
    if forced is not None:
        if len(forced) != n_gen:
            raise EngineError(f"forced has {len(forced)} entries, gen {n_gen}")
        out[at:] = forced
    return out
