"""The layered Qwen2 forward as kernel launches: one prefill pass and the greedy decode steps of a chunk.

The same functions run eagerly (the instruction prefix, graphs off) and under graph capture; ``k`` is the launcher
(kernels.Launcher, or the profiling tools' recording one), ``p`` the LaunchPlan, ``w`` / ``a`` / ``kv`` the
buffers. Per layer of the prefill: RMSNorm -> QKV GEMM -> attention -> split merge -> o_proj GEMM (+residual) ->
RMSNorm -> gate/up GEMM (SiLU * up) -> down GEMM (+residual); with quantised weights the same launches go to the
*_i8 / *_f8 / *_i4 kernels (plan.for_weight_dtype), which take the scales and zero points last. Per layer of a
decode step: RMSNorm + QKV GEMV (+ K/V store) -> attention -> split merge -> o_proj GEMV (+residual) -> RMSNorm +
gate/up GEMV -> down GEMV (+residual).
``meta`` on the device (pass_meta.chunk_meta) = a record per pass [L keys seen, p0 position of row 0, T rows, n_ctx,
bidirectional, ...] (the frame prefill's at a.meta, the parallel pass's at a.meta_parallel), then forced[gen]
(a.forced: every argmax writes the forced id where it is >= 0, so a forced prefix feeds the next decode step).
The parallel pass (vla.chunk_decode "parallel", ``parallel``) is the prefill's layers over the A slot rows with its
own record (bidirectional; in 32-row tiles when A > 32, ``_layers``), then ONE head launch over all A rows
(gemv_logits with grid.y = A, argmax_tokens with grid.x = A) instead of the prefill's head of the last row. With
tuning fused_parallel the frame's prefill and the parallel pass are ONE pass (``fused``): the frame's tile, then
the slot tiles, every GEMM over all of them.
"""
from __future__ import annotations

import math

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.cuda.buffers import Activations, KVCache, Weights
from vla_edge_ros.engine.cuda.plan import T_CHUNK, Launch, LaunchPlan, padded_intermediate


def _qscale(cfg: ModelConfig) -> float:
    return math.log2(math.e) / math.sqrt(cfg.head_dim)  # softmax in the log2 domain


def _s(w: Weights, scales: int, zeros: int) -> tuple:
    """The arguments the quantised kernels take last (scales, zero points: cuda/wtype.cuh); nothing for bf16."""
    return (scales, zeros) if w.quantized else ()


def _gemm(k, launch: Launch, A: int, lda: int, W: int, N: int, K: int, C: int, ldc: int,
          serial: bool = False, scales: tuple = ()) -> None:
    """C[32][ldc] += A W^T: gemm32v4_atomic, or the split-K gemm32_atomic (which takes its split length)."""
    split = (launch.ks,) if launch.ks else ()
    k(launch, A, lda, W, N, K, *split, C, ldc, *scales, serial=serial)


def prefill(k, p: LaunchPlan, cfg: ModelConfig, w: Weights, a: Activations, kv: KVCache) -> None:
    """One pass over the rows of a.x_pre -> final_h, logits[0], tok_buf[0]."""
    _layers(k, p, cfg, w, a, kv, [a.meta])
    _frame_head(k, p, cfg, w, a)


def _frame_head(k, p: LaunchPlan, cfg: ModelConfig, w: Weights, a: Activations) -> None:
    """logits[0], tok_buf[0] from the frame's last valid row (a.meta[2] - 1), already normed: no norm weights."""
    k(p.logits, a.final_h, a.meta, 2, 0, cfg.rms_norm_eps, w.head_rows, cfg.n_action_bins, cfg.hidden_size, a.logits,
      0)
    k(p.argmax, a.logits, cfg.n_action_bins, cfg.action_token_offset, a.tok_buf, 0, a.forced)


def parallel(k, p: LaunchPlan, cfg: ModelConfig, w: Weights, a: Activations, kv: KVCache, slots: int) -> None:
    """The parallel pass over the ``slots`` rows of a.x_pre (the caller has put the slot inputs there) -> final_h,
    logits[1 .. slots], tok_buf[1 .. slots]: gen[1 + r] is slot r's choice, the layout of numpy_decode.decode_parallel.
    More than T_CHUNK slots: the layers run tile by tile (``_layers``). The rows are independent after the attention,
    so the head of all of them is one launch of each kernel (grid.y / grid.x = slots) rather than ``slots`` launches
    of the decode's."""
    _layers(k, p, cfg, w, a, kv, [a.meta_tile(t) for t in range(math.ceil(slots / T_CHUNK))])
    _slots_head(k, p, cfg, w, a, slots, a.final_h)


def fused(k, p: LaunchPlan, cfg: ModelConfig, w: Weights, a: Activations, kv: KVCache, slots: int) -> None:
    """A parallel chunk as ONE pass (tuning fused_parallel): the frame's rows (a.x_pre's first tile, its causal record
    a.meta) and the ``slots`` slot rows after them (the caller has put their inputs at x_pre's second tile), so each
    GEMM runs over all of them; the frame's tile is attended first (its launch stores the frame's K/V, which the
    slot tiles then stage from the cache, as a second tile does in ``parallel``). Then both heads: the frame's
    (logits[0], tok_buf[0], as ``prefill``) and the slots' (logits[1 ..], as ``parallel``), from their rows of
    final_h. Same results as ``prefill`` then ``parallel``: the rows are the same, and so is every row's keys."""
    _layers(k, p, cfg, w, a, kv, [a.meta] + [a.meta_tile(t) for t in range(math.ceil(slots / T_CHUNK))])
    _frame_head(k, p, cfg, w, a)
    _slots_head(k, p, cfg, w, a, slots, a.final_h + 4 * T_CHUNK * cfg.hidden_size)


def _slots_head(k, p: LaunchPlan, cfg: ModelConfig, w: Weights, a: Activations, slots: int, first: int) -> None:
    """logits[1 .. slots], tok_buf[1 .. slots] of the slot rows from final_h row ``first`` on: one launch each."""
    n_bins = cfg.n_action_bins
    rows = a.logits + 4 * n_bins  # logits[1]
    k(p.logits._replace(grid=(p.logits.grid[0], slots)), first, a.meta_parallel, -1, 0, cfg.rms_norm_eps,
      w.head_rows, n_bins, cfg.hidden_size, rows, 0)
    k(p.argmax._replace(grid=(slots, 1)), rows, n_bins, cfg.action_token_offset, a.tok_buf, 1, a.forced)


def _layers(k, p: LaunchPlan, cfg: ModelConfig, w: Weights, a: Activations, kv: KVCache, recs: list[int]) -> None:
    """The layers and the final norm of a prefill-shaped pass over a.x_pre -> final_h, in 32-row tiles, one per
    record in ``recs`` (device pointers: the frame's causal a.meta, the parallel pass's bidirectional
    a.meta_tile(t), pass_meta.parallel_records, or the fused pass's both).

    More than one tile: the row-wise kernels take every row at once; each GEMM runs once per 32-row tile (the measured
    32-row kernels, weights read once per tile), and the attention and its merge once per tile with that tile's record
    and query rows. Tile 0's attention stores the K/V of every row its record names (the parallel pass's: every
    slot's; it reads each key of the pass fresh from the QKV rows); a later tile finds the keys of the rows before its
    own in the cache, staged before its PDL wait, so it is launched serially (after the previous tile's attention and
    merge are complete); the keys from its own row on it reads fresh, like tile 0. The split partials are one tile's,
    reused: each tile's merge runs before the next tile's attention. With p.parallel_gemms (tuning parallel_gemm =
    "tiled", bf16) each GEMM is instead one launch over every tile (cuda/gemm_tiled.cu: the weights read once; the
    gate/up one writes silu(gate) * up)."""
    H, I, T, eps, tiles = cfg.hidden_size, padded_intermediate(cfg), T_CHUNK, cfg.rms_norm_eps, len(recs)
    G, n_kvh, HD = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.num_key_value_heads, cfg.head_dim
    nq = cfg.num_attention_heads * HD
    nqkv = nq + 2 * n_kvh * HD
    attn = p.attn_prefill._replace(grid=(kv.nsplit,) + p.attn_prefill.grid[1:])  # (splits, n_kvh[, head groups])
    norm = p.norm_rows._replace(grid=(T * tiles,) + p.norm_rows.grid[1:])  # every row of the pass
    final_norm = p.final_norm._replace(grid=(T * tiles,) + p.final_norm.grid[1:])
    whole = tiles > 1 and bool(p.parallel_gemms)  # one tiled launch per GEMM over every tile
    t_qkv, t_o, t_gu, t_d = p.parallel_gemms if whole else (None,) * 4

    def rows(ptr: int, width: int, nbytes: int, t: int) -> int:  # tile t's first row of a [rows][width] buffer
        return ptr + t * T * width * nbytes

    def linear(tiled: Launch, per_tile: Launch, A: int, lda: int, W: int, N: int, K: int, C: int, ldc: int,
               scales: tuple) -> None:  # C[rows] += A W^T (bf16 A, fp32 C): once over every tile, or tile by tile
        if whole:
            k(tiled, A, lda, W, N, K, tiled.ks, C, ldc, tiles)
            return
        for t in range(tiles):
            _gemm(k, per_tile, rows(A, lda, 2, t), lda, W, N, K, rows(C, ldc, 4, t), ldc, scales=scales)

    for i, L in enumerate(w.layers):
        kc, vc = kv.layer(i)
        # serial at layer 0: the attention stages cache rows of older keys before its PDL wait, so whatever ran
        # before the prefill (the last chunk, K/V moves) must be complete (a graph boundary does that too)
        k(norm, a.x_pre, L.ln1, a.h_bf, H, eps, L.bqkv, a.qkv, nqkv, serial=i == 0)
        linear(t_qkv, p.gemm_qkv, a.h_bf, H, L.wqkv, nqkv, H, a.qkv, nqkv, _s(w, L.sqkv, L.zqkv))
        for t in range(tiles):
            k(attn, rows(a.qkv, nqkv, 4, t), nqkv, kc, vc, kv.key_slots, recs[t], kv.rope, G, n_kvh, _qscale(cfg),
              kv.part_o_pf, kv.part_ml_pf, serial=t > 0)  # tile 0 also stores the pass's K/V in the cache
            k(p.merge_prefill, kv.part_o_pf, kv.part_ml_pf, cfg.num_attention_heads * T, HD, T,
              cfg.num_attention_heads, recs[t], 0, 0, p.keys_per_split, 0, rows(a.attn_bf, nq, 2, t))
        linear(t_o, p.gemm_o, a.attn_bf, nq, L.wo, H, nq, a.x_pre, H, _s(w, L.so, L.zo))
        k(norm, a.x_pre, L.ln2, a.h_bf, H, eps, 0, 0, 0)
        if whole:
            k(t_gu, a.h_bf, H, L.wgu, 2 * I, H, a.act_bf, tiles)
        else:
            for t in range(tiles):
                k(p.gemm_gateup, rows(a.h_bf, H, 2, t), H, L.wgu, 2 * I, H, rows(a.act_bf, I, 2, t),
                  *_s(w, L.sgu, L.zgu))
        linear(t_d, p.gemm_down, a.act_bf, I, L.wd, H, I, a.x_pre, H, _s(w, L.sd, L.zd))
    k(final_norm, a.x_pre, w.final_norm, a.final_h, H, eps)


def decode(k, p: LaunchPlan, cfg: ModelConfig, w: Weights, a: Activations, kv: KVCache, steps: int) -> None:
    """``steps`` greedy steps: step s embeds tok_buf[s - 1] and writes logits[s], final_h_dec[s - 1], tok_buf[s]."""
    H, I, eps = cfg.hidden_size, padded_intermediate(cfg), cfg.rms_norm_eps
    G, n_kvh, HD = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.num_key_value_heads, cfg.head_dim
    Hq, nq, nkv, n_bins = cfg.num_attention_heads, cfg.num_attention_heads * HD, n_kvh * HD, cfg.n_action_bins
    attn = p.attn_decode._replace(grid=(kv.nsplit,) + p.attn_decode.grid[1:])
    for s in range(1, steps + 1):
        # serial at step 1: the attention stages cache rows of keys < n_ctx before its PDL wait, so everything
        # the prefill wrote must be complete (a graph boundary does that too; this covers eager launches)
        k(p.embed, w.embed, a.tok_buf, s - 1, a.x_dec, H, serial=s == 1)
        for i, L in enumerate(w.layers):
            kc, vc = kv.layer(i)
            k(p.gemv_qkv, a.x_dec, L.ln1, eps, L.wqkv, L.bqkv, H, nq, nkv, a.q_dec, kc, vc, kv.key_slots, a.meta,
              s, *_s(w, L.sqkv, L.zqkv))  # also stores the token's K/V at its slot
            k(attn, a.q_dec, kc, vc, kv.key_slots, a.meta, s, kv.rope, G, n_kvh, _qscale(cfg), kv.part_o_dec,
              kv.part_ml_dec)
            k(p.merge_decode, kv.part_o_dec, kv.part_ml_dec, Hq, HD, 1, Hq, a.meta, 3, s, p.keys_per_split,
              a.attn_dec, 0)
            k(p.gemv_o, a.attn_dec, L.wo, H, nq, p.gemv_o.ks, a.x_dec, *_s(w, L.so, L.zo))
            k(p.gemv_gateup, a.x_dec, L.ln2, eps, L.wgu, I, H, a.act_dec, *_s(w, L.sgu, L.zgu))
            k(p.gemv_down, a.act_dec, L.wd, H, I, p.gemv_down.ks, a.x_dec, *_s(w, L.sd, L.zd))
        logits = a.logits + 4 * s * n_bins
        k(p.logits, a.x_dec, a.meta, -1, w.final_norm, eps, w.head_rows, n_bins, H, logits,
          a.final_h_dec + 4 * (s - 1) * H)
        k(p.argmax, logits, n_bins, cfg.action_token_offset, a.tok_buf, s, a.forced)


def chunk(k, p: LaunchPlan, cfg: ModelConfig, w: Weights, a: Activations, kv: KVCache, steps: int) -> None:
    """A whole autoregressive chunk (the profiling tools capture it as one graph; a parallel chunk needs the slot
    inputs copied in between: CudaEngine.enqueue_chunk)."""
    prefill(k, p, cfg, w, a, kv)
    decode(k, p, cfg, w, a, kv, steps)
