"""The fleet's batched pass as kernel launches (engine/cuda/fleet.py's engine ``e`` holds the buffers): what
forward.py is to the single engine.

A pass's rows are its n members' rows stacked in ``e.x``: the frame prefill tokens_per_frame rows per member (member
m at rows m * tpf ..), a decode step one row per member (row m). Per layer: the linear maps over all rows at once
(weights read once: ``linear``), the attention / its split merge / the decode step's K/V store per member in one
launch each (grid z / y = member; a record per member and pass at ``meta``: [L keys, p0, T rows, n_ctx, 0, first
row, 0, 0]; a slot list per member at ``slots``, in its region of the shared cache). Then every member's last row
is gathered for the LM head and the argmax writes tok[tok_index + m]. ``k`` is the launcher (or a recording one),
``zero(ptr, count)`` a memset of count float32 zeros on the engine's stream (a graph node when captured).
"""
from __future__ import annotations

import math
from typing import Any, Callable

from vla_edge_ros.engine.cuda.forward import _qscale
from vla_edge_ros.engine.cuda.plan import (BLOCK, SMEM_DEFAULT, Launch, padded_intermediate, split_len,
                                          tiled_gemm, tiled_gemm_unfit)
from vla_edge_ros.engine.interface import EngineError

REC = 8  # ints per member record (pass_meta.META_INTS; index 5 = the member's first row in the pass)
GR_MAX_KS = 1536  # gemv_rows_atomic's K slice: 16 rows x 1536 fp32 = 96 KiB of shared memory, two blocks per SM
# the few-row decode GEMM by tuning.fleet_gemv (cuda/fleet.cu): fp32 dot products on the CUDA cores, or mma with
# the weights as the m16 side
FLEET_GEMV = {"rows": "gemv_rows_atomic", "mma": "gemv_rows_mma"}
GRM_KS_QUANTUM = 64  # gemv_rows_mma's K split: whole groups of 8 16-byte words per staged row (its bank swizzle)


def fleet_gemv_kernel(tuning: Any) -> str:
    """The kernel tuning.fleet_gemv names; EngineError naming the knob for any other value."""
    v = tuning.fleet_gemv
    if v not in FLEET_GEMV:
        raise EngineError(f"tuning fleet_gemv must be one of {', '.join(map(repr, FLEET_GEMV))}, got {v!r}")
    return FLEET_GEMV[v]


def linear(e: Any, N: int, K: int, rows: int) -> Launch:
    """C[rows] += A W^T: a few-row GEMM for a few rows (a decode pass of <= GR_MAXM robots: gemv_rows_atomic or
    gemv_rows_mma, tuning.fleet_gemv), else the 32-row tiles of gemm32t_atomic (cuda/fleet.cu says why). The
    launch's ks is its K split length."""
    c, t = e.limits.constants, e.tuning
    if rows <= c.GR_MAXM:
        if fleet_gemv_kernel(t) == "gemv_rows_mma":
            return _gemv_rows_mma(e, N, K, rows)
        rb = math.ceil(N / (2 * c.GR_WARPS))
        ks = min(split_len(K, rb, t.gemv_target_blocks, 256, 256), GR_MAX_KS)
        return Launch("gemv_rows_atomic", (rb, math.ceil(K / ks)), (32 * c.GR_WARPS, 1, 1), 4 * rows * ks, ks)
    # one tile: gemm32t over it is the single engine's gemm32_atomic; a shape or device the tiled GEMM cannot take
    # keeps gemm32t too
    if t.fleet_gemm == "tiled" and rows > 32 and not tiled_gemm_unfit(c, [(N, K, False)], rows, e.limits.smem_optin):
        return tiled_gemm(c, t, N, K, rows)
    rb = math.ceil(N / (16 * c.GEMM_WARPS))
    ks = split_len(K, rb, t.gemm_target_blocks, 32, t.gemm_min_ks)
    return Launch("gemm32t_atomic", (rb, math.ceil(K / ks)), (32 * c.GEMM_WARPS, 1, 1), 0, ks)


def _gemv_rows_mma(e: Any, N: int, K: int, rows: int) -> Launch:
    """gemv_rows_mma's launch: GEMM_WARPS warps of 16 weight rows per block, K split into at most
    tuning.gemv_target_blocks blocks (264: two per SM on the H200, all resident at once; 528 and 1056, i.e. more
    K splits of gate/up and down, measured no faster), each warp's split at least one GEMM_KC chunk (its 8 KiB of
    weights in flight from the start), at most GR_MAX_KS (the staged rows fit the default 48 KiB of shared memory:
    no limit to raise)."""
    c, t = e.limits.constants, e.tuning
    if N % 16 or K % 32:
        raise EngineError(f"gemv_rows_mma: N={N} must be a multiple of 16 and K={K} of 32")
    rb = math.ceil(N / (16 * c.GEMM_WARPS))
    splits = max(1, t.gemv_target_blocks // rb)
    q = GRM_KS_QUANTUM
    ks = min(max(-(-K // (splits * q)) * q, 256), GR_MAX_KS)  # 256: GEMM_KC columns
    smem = 2 * (8 if rows <= 8 else 16) * ks
    assert ks % q == 0 and smem <= SMEM_DEFAULT, (ks, smem)
    return Launch("gemv_rows_mma", (rb, math.ceil(K / ks)), (32 * c.GEMM_WARPS, 1, 1), smem, ks)


def rec_ptr(e: Any, step: int) -> int:
    """The records of pass ``step`` (0: the frame prefill, s: decode step s), one per member slot."""
    return e.meta + 4 * step * e.max_robots * REC


def logits_ptr(e: Any, step: int) -> int:
    return e.logits + 4 * step * e.max_robots * e.cfg.n_action_bins


def prefill(e: Any, k: Callable, zero: Callable[[int, int], None], n: int) -> None:
    """The frame prefill of n members: n x tokens_per_frame rows."""
    batched_pass(e, k, zero, n, n * e.tpf, rec_ptr(e, 0), e.key_slots, logits_ptr(e, 0), 0)


def decode(e: Any, k: Callable, zero: Callable[[int, int], None], n: int) -> None:
    """The S greedy steps of n members: each step embeds the tokens the last argmax wrote (on the device) and is a
    pass of n rows. Every step's first launch is serial: the attention stages older keys before its PDL wait and
    the step before wrote one of them."""
    H, M = e.cfg.hidden_size, e.max_robots
    embed = Launch("embed_gather", (math.ceil(H / BLOCK), n), (BLOCK, 1, 1))
    for s in range(1, e.decode_steps + 1):
        k(embed, e.weights.embed, e.tok, (s - 1) * M, e.x, H, serial=True)
        batched_pass(e, k, zero, n, n, rec_ptr(e, s), e.key_slots, logits_ptr(e, s), s * M, step=s)


def batched_pass(e: Any, k: Callable, zero: Callable[[int, int], None], n: int, rows: int, meta: int, slots: int,
                 logits: int, tok_index: int, step: int = 0) -> None:
    """One pass over ``rows`` rows of e.x for n members (records at ``meta``, slot lists at ``slots``) -> logits of
    each member's last row at ``logits``, tok[tok_index + m]. step > 0: decode step ``step`` (one row per member):
    its K/V stored by kv_store_rows, then the decode attention (attn_decode_batch); else the prefill attention."""
    cfg, w, p = e.cfg, e.weights, e.plan
    H, I, HD, eps = cfg.hidden_size, padded_intermediate(cfg), cfg.head_dim, cfg.rms_norm_eps
    Hq, n_kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    G, nq, nkv = Hq // n_kvh, Hq * HD, n_kvh * HD
    nqkv = nq + 2 * nkv
    tiles = math.ceil(rows / 32)
    few = rows <= e.limits.constants.GR_MAXM  # the few-row GEMMs read exactly the rows; gemm32t whole tiles
    R = rows if few else 32 * tiles
    norm = p.norm_rows._replace(grid=(R, 1))
    if step:
        store = Launch("kv_store_rows", (math.ceil(2 * nkv / BLOCK), n), (BLOCK, 1, 1))
        attn = Launch(f"attn_decode_batch_hd{HD}", (e.nsplit, n_kvh, n), p.attn_decode.block)
        merge, rows_per_head = Launch("attn_combine_batch", (Hq * HD // 32, n), p.merge_prefill.block), 1
    else:
        attn = Launch(f"attn_prefill_batch_hd{HD}", (e.nsplit, n_kvh, n), p.attn_prefill.block)
        vec = {"attn_combine": 1, "attn_combine_v2": 2, "attn_combine_v4": 4}[p.merge_prefill.kernel]
        merge = Launch("attn_combine_batch" + ("" if vec == 1 else f"_v{vec}"), (Hq * 32 * HD // (32 * vec), n),
                       p.merge_prefill.block)
        rows_per_head = 32
    silu = Launch("silu_rows", (math.ceil(I / BLOCK), R), (BLOCK, 1, 1))
    g_qkv, g_o, g_gu, g_d = (linear(e, N, K, rows) for N, K in ((nqkv, H), (H, nq), (2 * I, H), (H, I)))
    # the tiled GEMMs' gate/up writes silu(gate) * up itself: no fp32 gate/up rows to zero and pass over
    c = e.limits.constants
    gu_silu = tiled_gemm(c, e.tuning, 2 * I, H, rows, silu=True) if g_gu.kernel.startswith("gemm_tiled") and not \
        tiled_gemm_unfit(c, [(2 * I, H, True)], rows, e.limits.smem_optin) else None
    arg = rows if few else tiles  # gemv_rows_*: rows; gemm32t: 32-row tiles
    layer_bytes = 2 * e.slots_total * e.nkv
    for i, L in enumerate(w.layers):
        kc, vc = e.kc + i * layer_bytes, e.vc + i * layer_bytes
        # serial at layer 0: the attention stages older keys before its PDL wait (the last pass wrote some)
        k(norm, e.x, L.ln1, e.h_bf, H, eps, L.bqkv, e.qkv, nqkv, serial=i == 0)
        k(g_qkv, e.h_bf, H, L.wqkv, nqkv, H, g_qkv.ks, e.qkv, nqkv, arg)
        if step:
            k(store, e.qkv, nqkv, nq, nkv, kc, vc, slots, e.region, meta, REC)
            k(attn, e.qkv, nqkv, kc, vc, slots, meta, step, e.rope, G, n_kvh, _qscale(cfg), e.part_o, e.part_ml,
              e.region, REC, e.part_rows)
        else:
            k(attn, e.qkv, nqkv, kc, vc, slots, meta, e.rope, G, n_kvh, _qscale(cfg), e.part_o, e.part_ml,
              e.region, REC, e.part_rows)
        k(merge, e.part_o, e.part_ml, HD, Hq, rows_per_head, meta, REC, e.kps, e.part_rows, e.attn_bf)
        k(g_o, e.attn_bf, nq, L.wo, H, nq, g_o.ks, e.x, H, arg)
        if gu_silu:
            k(norm, e.x, L.ln2, e.h_bf, H, eps, 0, 0, 0)
            k(gu_silu, e.h_bf, H, L.wgu, 2 * I, H, e.act_bf, tiles)
        else:
            # the gate/up GEMM adds into gu: zeroed by a memset (a graph node), not by the norm kernel's bias copy,
            # whose one block per row wrote 2I floats each: 3.6 of a 36.6 ms decode graph at 8 robots (H200)
            zero(e.gu, R * 2 * I)
            k(norm, e.x, L.ln2, e.h_bf, H, eps, 0, 0, 0)
            k(g_gu, e.h_bf, H, L.wgu, 2 * I, H, g_gu.ks, e.gu, 2 * I, arg)
            k(silu, e.gu, I, e.act_bf)
        k(g_d, e.act_bf, I, L.wd, H, I, g_d.ks, e.x, H, arg)
    k(Launch("rows_gather", (math.ceil(H / BLOCK), n), (BLOCK, 1, 1)), e.x, H, meta, REC, e.xg)
    k(p.logits._replace(grid=(p.logits.grid[0], n)), e.xg, e.one, 0, w.final_norm, eps, w.head_rows,
      cfg.n_action_bins, H, logits, 0)
    k(p.argmax._replace(grid=(n, 1)), logits, cfg.n_action_bins, cfg.action_token_offset, e.tok, tok_index, e.forced)
