"""engine/cuda/forward.py without a GPU: the launch sequence of a chunk and of the parallel pass (whole and in
tiles, bf16 and quantised) through a recording launcher (cuda_plan_fixtures.py), each launch checked against the
kernel table's signature."""
from __future__ import annotations

import pytest

from cuda_plan_fixtures import GEOMETRIES, H200, record_chunk, cfg_of, limits
from vla_edge_ros.engine.config import tiny_default_dict
from vla_edge_ros.engine.cuda.pass_meta import META_INTS
from vla_edge_ros.engine.cuda.plan import Tuning, padded_intermediate, plan


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_forward_launches_match_the_table_and_the_layered_sequence(geometry):
    cfg = cfg_of(geometry)
    p = plan(cfg, Tuning(), limits(H200, cfg))
    rec = [(name, serial) for name, _, serial in record_chunk(cfg, p, 4104)]
    L, HD = cfg.num_hidden_layers, cfg.head_dim
    prefill = [n for n, _ in rec[:8 * L + 3]]
    assert prefill[:8] == ["rmsnorm_rows_bf16", "gemm32_atomic", f"attn_prefill_hd{HD}", p.merge_prefill.kernel,
                           "gemm32_atomic", "rmsnorm_rows_bf16", "gemm32v4_silu", "gemm32v4_atomic"]
    assert prefill[-3:] == ["rmsnorm_rows_f32", "gemv_logits", "argmax_tokens"]
    step = [n for n, _ in rec[8 * L + 3:8 * L + 3 + 6 * L + 3]]
    assert step[:7] == ["embed_gather", "gemv_qkv", f"attn_decode_hd{HD}", "attn_combine", "gemv_resid",
                        "gemv_gateup", "gemv_resid"] and step[-2:] == ["gemv_logits", "argmax_tokens"]
    assert len(rec) == 8 * L + 3 + 8 * (6 * L + 3)
    # only the first launch of the prefill and of the decode start without a programmatic edge
    assert [i for i, (_, s) in enumerate(rec) if s] == [0, 8 * L + 3]


@pytest.mark.parametrize("geometry", ["1.5b", "tiny"])
def test_the_parallel_pass_is_the_prefill_layers_on_its_own_record_with_one_head_over_its_slots(geometry):
    """prefill + parallel(28 slots): the parallel pass's layers are the prefill's launches (same kernels, grids)
    reading the parallel record (a.meta_parallel: attention and merge), its first launch serial; then ONE logits
    launch with grid.y = 28 from row 0 into logits[1 ..] and ONE argmax with grid.x = 28 into tok_buf[1 ..], both
    with the forced ids; every argmax of the chunk gets a.forced."""
    cfg = cfg_of(geometry)
    p = plan(cfg, Tuning(), limits(H200, cfg))
    rec = record_chunk(cfg, p, 4104, parallel_slots=28, with_args=True)
    L, n_bins = cfg.num_hidden_layers, cfg.n_action_bins
    n = 8 * L + 3
    assert len(rec) == 2 * n
    pre, par = rec[:n], rec[n:]
    a = rec[0][4]
    assert [r[:3] for r in par[:-2]] == [r[:3] for r in pre[:-2]]  # same layers, first launch serial
    attn = [r for r in par if r[0].startswith("attn_prefill")]
    merges = [r for r in par if r[0] == p.merge_prefill.kernel]
    assert len(attn) == len(merges) == L
    assert all(r[3][5] == a.meta_parallel for r in attn) and all(r[3][6] == a.meta_parallel for r in merges)
    assert all(r[3][5] == a.meta for r in pre if r[0].startswith("attn_prefill"))
    (lg, lg_grid, _, lg_args, _), (am, am_grid, _, am_args, _) = par[-2:]
    assert (lg, am) == ("gemv_logits", "argmax_tokens")
    assert lg_grid == (p.logits.grid[0], 28) and am_grid == (28, 1)
    assert lg_args[0] == a.final_h and lg_args[2] == -1 and lg_args[3] == 0 and lg_args[8] == a.logits + 4 * n_bins
    assert am_args[0] == a.logits + 4 * n_bins and am_args[3:] == (a.tok_buf, 1, a.forced)
    assert pre[-1][3][3:] == (a.tok_buf, 0, a.forced) and pre[-2][3][2] == 2  # the frame's head: its last row
    assert [i for i, r in enumerate(rec) if r[2]] == [0, n]


@pytest.mark.parametrize("geometry, quantized", [("1.5b", False), ("tiny", False), ("1.5b", True)])
def test_a_parallel_pass_of_two_tiles_runs_each_gemm_attention_and_merge_per_tile(geometry, quantized):
    """56 slots (H = 8): the norms take all 64 rows at once; every GEMM runs twice, on tile t's rows (A and C offset
    by 32 t rows); the attention and its merge run per tile on that tile's record, tile 0's attention then merge
    before tile 1's attention, which is serial (it stages the keys tile 0 stored); the head covers the 56 slots."""
    cfg = cfg_of(geometry)
    p = plan(cfg, Tuning(), limits(H200, cfg))
    if quantized:
        from vla_edge_ros.engine.cuda.plan import for_weight_dtype
        p = for_weight_dtype(p, "int8", cfg)
    rec = record_chunk(cfg, p, 4104, quantized=quantized, parallel_slots=56, with_args=True)
    L, H, HD = cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim
    nq = cfg.num_attention_heads * HD
    nqkv = nq + 2 * cfg.num_key_value_heads * HD
    par = rec[8 * L + 3:]  # after the frame's prefill
    a = rec[0][4]
    per_layer = 1 + 2 + 4 + 2 + 1 + 2 + 2  # norm, 2 qkv, (attn, merge) x 2, 2 o, norm, 2 gate/up, 2 down
    assert len(par) == per_layer * L + 3
    layer = par[:per_layer]
    names = [r[0] for r in layer]
    attn_name = f"attn_prefill_hd{HD}"
    assert names[0] == names[9] == "rmsnorm_rows_bf16" and all(r[1][0] == 64 for r in (layer[0], layer[9]))
    assert names[3:7] == [attn_name, p.merge_prefill.kernel, attn_name, p.merge_prefill.kernel]
    (at0, at1), (mg0, mg1) = (layer[3], layer[5]), (layer[4], layer[6])
    assert at0[3][0] == a.qkv and at1[3][0] == a.qkv + 4 * 32 * nqkv
    assert at0[3][5] == a.meta_parallel and at1[3][5] == a.meta_parallel + 4 * META_INTS
    assert (at0[2], at1[2]) == (False, True)  # tile 1 launched after tile 0's attention and merge completed
    assert mg0[3][6] == a.meta_parallel and mg1[3][6] == a.meta_tile(1)
    assert mg0[3][-1] == a.attn_bf and mg1[3][-1] == a.attn_bf + 2 * 32 * nq
    gemms = [r for r in layer if r[0].startswith("gemm")]
    assert len(gemms) == 8 and [r[0] for r in gemms[::2]] == [r[0] for r in gemms[1::2]]
    qkv0, qkv1 = gemms[0][3], gemms[1][3]
    assert (qkv0[0], qkv1[0]) == (a.h_bf, a.h_bf + 2 * 32 * H)
    gu0, gu1 = gemms[4][3], gemms[5][3]
    assert gu1[0] == a.h_bf + 2 * 32 * H and gu1[5] == gu0[5] + 2 * 32 * padded_intermediate(cfg)
    down1 = gemms[7][3]
    assert down1[0] == a.act_bf + 2 * 32 * padded_intermediate(cfg)
    assert par[-3][0] == "rmsnorm_rows_f32" and par[-3][1][0] == 64
    (lg, lg_grid, _, _, _), (am, am_grid, _, am_args, _) = par[-2:]
    assert lg_grid[1] == 56 and am_grid == (56, 1) and am_args[3:] == (a.tok_buf, 1, a.forced)
    serial = [i for i, r in enumerate(par) if r[2]]
    assert serial == [0] + [i * per_layer + 5 for i in range(L)]


@pytest.mark.parametrize("weight_dtype", ["int8", "fp8", "int4"])
def test_a_quantised_chunk_launches_the_quantised_kernels_with_their_scales_and_zero_points(weight_dtype):
    from vla_edge_ros.engine.cuda.plan import KERNEL_SUFFIX, for_weight_dtype
    cfg = cfg_of("1.5b")
    p = for_weight_dtype(plan(cfg, Tuning(), limits(H200, cfg)), weight_dtype, cfg)
    names = [name for name, _, _ in record_chunk(cfg, p, 4104, quantized=True)]  # signatures checked inside
    suffix = KERNEL_SUFFIX[weight_dtype]
    L = cfg.num_hidden_layers
    assert sum(n.endswith(suffix) for n in names) == 4 * L + 8 * 4 * L  # 4 GEMMs + 8 x 4 GEMVs per layer
    assert names.count("gemv_logits") == 9 and "gemv_qkv" not in names


@pytest.mark.parametrize("geometry", ["1.5b", "tiny"])
def test_a_tiled_parallel_pass_runs_each_gemm_once_over_both_tiles(geometry):
    """tuning parallel_gemm = "tiled" (H = 8, 56 slots, bf16): each GEMM is one gemm_tiled64 launch over the 64 rows
    (A and C from row 0, tiles = 2; the gate/up one writes act_bf), the attention and merge still per tile; with
    quantised weights the plan keeps the per-tile 32-row kernels (and says so); one tile: nothing tiled."""
    from vla_edge_ros.engine.cuda.plan import for_weight_dtype
    vla = {**tiny_default_dict()["vla"], "action_horizon": 8, "chunk_decode": "parallel"}
    cfg = cfg_of(geometry, vla=vla)
    p = plan(cfg, Tuning(parallel_gemm="tiled"), limits(H200, cfg))
    assert [g.kernel for g in p.parallel_gemms] == [f"gemm_tiled64_{m}" for m in ("atomic", "atomic", "silu",
                                                                                  "atomic")]
    assert all(p.raise_smem[g.kernel] == g.smem for g in p.parallel_gemms)
    rec = record_chunk(cfg, p, 4104, parallel_slots=56, with_args=True)
    L, I = cfg.num_hidden_layers, padded_intermediate(cfg)
    par = rec[8 * L + 3:]
    a = rec[0][4]
    per_layer = 1 + 1 + 4 + 1 + 1 + 1 + 1  # norm, qkv, (attn, merge) x 2, o, norm, gate/up, down
    assert len(par) == per_layer * L + 3
    gemms = [r for r in par[:per_layer] if r[0].startswith("gemm")]
    assert [r[0] for r in gemms] == [g.kernel for g in p.parallel_gemms]
    assert [r[3][0] for r in gemms] == [a.h_bf, a.attn_bf, a.h_bf, a.act_bf] and all(r[3][-1] == 2 for r in gemms)
    assert gemms[2][3][5] == a.act_bf and gemms[3][3][6] == a.x_pre and 2 * I == gemms[2][3][3]
    q = for_weight_dtype(p, "int8", cfg)
    assert q.parallel_gemms == () and any("bf16 weights only" in n for n in q.notes)
    one = cfg_of(geometry, vla={**vla, "action_horizon": 4})  # 28 slots: one tile
    assert plan(one, Tuning(parallel_gemm="tiled"), limits(H200, one)).parallel_gemms == ()


def test_a_tiled_gemm_the_device_cannot_hold_leaves_the_parallel_pass_on_the_32_row_kernels():
    """H = 10 (70 slots, 3 tiles: one 128-row block tile) on a 99 KB part: sm_90's K step (110592 B for that tile)
    does not fit, so the plan keeps the per-tile kernels and says why, instead of refusing the model; the module's
    own constants for that part (K step 32 x 4: 81920 B) keep the tiled GEMMs."""
    from dataclasses import replace
    from cuda_plan_fixtures import RTX40
    vla = {**tiny_default_dict()["vla"], "action_horizon": 10, "chunk_decode": "parallel"}
    cfg = cfg_of("1.5b", vla=vla)
    lim = limits(RTX40, cfg)
    p = plan(cfg, Tuning(parallel_gemm="tiled"), lim)
    assert p.parallel_gemms == () and any("110592 B of shared memory" in n for n in p.notes)
    sm89 = replace(lim, constants=replace(lim.constants, GT_SMEM128=81920, GT_SMEM64=61440, GT_BK=32))
    q = plan(cfg, Tuning(parallel_gemm="tiled"), sm89)
    assert [g.kernel for g in q.parallel_gemms][0] == "gemm_tiled128_atomic" and q.raise_smem[
        "gemm_tiled128_atomic"] == 81920


@pytest.mark.parametrize("geometry, slots, gemm", [("1.5b", 56, "tiles32"), ("1.5b", 56, "tiled"),
                                                   ("tiny", 56, "tiled"), ("1.5b", 28, "tiled")])
def test_a_fused_parallel_chunk_is_one_pass_the_frame_tile_first_then_both_heads(geometry, slots, gemm):
    """tuning fused_parallel: ONE pass over the frame's tile and the slot tiles, no prefill pass before it. The norms
    take every row; the GEMMs run per tile (tiles32) or once over all of them (tiled); per layer the frame's tile is
    attended first (a.meta, QKV row 0), then each slot tile on its record from QKV row 32 (t + 1) on, launched
    serially (it stages the keys the launch before stored); then the frame's head (its last row: logits[0],
    tok_buf[0]) and the slots' (final_h from row 32: logits[1 ..], tok_buf[1 ..])."""
    vla = {**tiny_default_dict()["vla"], "action_horizon": slots // 7, "chunk_decode": "parallel"}
    cfg = cfg_of(geometry, vla=vla)
    p = plan(cfg, Tuning(parallel_gemm=gemm, fused_parallel=True), limits(H200, cfg))
    tiles = 1 + -(-slots // 32)
    assert p.fused_parallel and len(p.parallel_gemms) == (4 if gemm == "tiled" else 0)
    rec = record_chunk(cfg, p, 4104, parallel_slots=slots, with_args=True)
    L, H, HD, n_bins = cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.n_action_bins
    nq = cfg.num_attention_heads * HD
    nqkv = nq + 2 * cfg.num_key_value_heads * HD
    a = rec[0][4]
    per_layer = 2 + (4 if gemm == "tiled" else 4 * tiles) + 2 * tiles  # norms, GEMMs, (attention, merge) per tile
    assert len(rec) == per_layer * L + 1 + 4  # the final norm, two heads of two launches
    layer = rec[:per_layer]
    records = [a.meta] + [a.meta_tile(t) for t in range(tiles - 1)]
    attn = [r for r in layer if r[0] == f"attn_prefill_hd{HD}"]
    merges = [r for r in layer if r[0] == p.merge_prefill.kernel]
    assert [r[3][5] for r in attn] == [r[3][6] for r in merges] == records
    assert [r[3][0] for r in attn] == [a.qkv + 4 * 32 * t * nqkv for t in range(tiles)]
    assert [r[3][-1] for r in merges] == [a.attn_bf + 2 * 32 * t * nq for t in range(tiles)]
    assert [r[2] for r in attn] == [False] + [True] * (tiles - 1)
    assert [r[1][0] for r in layer if r[0] == "rmsnorm_rows_bf16"] == [32 * tiles] * 2
    gemms = [r for r in layer if r[0].startswith("gemm")]
    if gemm == "tiled":  # one block tile over the pass's 32 x tiles rows: 64 (28 slots) or 128 (56) rows
        assert [r[0] for r in gemms] == [g.kernel for g in p.parallel_gemms]
        bm = 64 if tiles == 2 else 128
        assert all(r[0].startswith(f"gemm_tiled{bm}_") and r[1][0] == 1 and r[3][-1] == tiles for r in gemms)
    else:
        assert [r[3][0] for r in gemms[:tiles]] == [a.h_bf + 2 * 32 * t * H for t in range(tiles)]
    fl, fa, sl, sa = rec[-4:]
    assert [r[0] for r in rec[-5:]] == ["rmsnorm_rows_f32", "gemv_logits", "argmax_tokens", "gemv_logits",
                                        "argmax_tokens"] and rec[-5][1][0] == 32 * tiles
    assert fl[3][:3] == (a.final_h, a.meta, 2) and fl[3][8] == a.logits and fa[3][3:] == (a.tok_buf, 0, a.forced)
    assert sl[1] == (p.logits.grid[0], slots) and sl[3][:3] == (a.final_h + 4 * 32 * H, a.meta_parallel, -1)
    assert sl[3][8] == a.logits + 4 * n_bins and sa[1] == (slots, 1) and sa[3][3:] == (a.tok_buf, 1, a.forced)
    assert [r for r in rec if r[2]] == [rec[0]] + [r for r in rec if r[0] == attn[0][0] and r[3][5] != a.meta]
    # autoregressive chunks have no fused pass: the tuning is ignored there
    ar = cfg_of(geometry, vla={**vla, "chunk_decode": "autoregressive"})
    assert not plan(ar, Tuning(fused_parallel=True), limits(H200, ar)).fused_parallel
