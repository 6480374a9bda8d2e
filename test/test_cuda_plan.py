"""engine/cuda/plan.py and kernels.py without a GPU: the launch plan for each geometry and device class (every
Qwen2.5 size, 0.5B to 72B, on the H200, Jetson Orin and a 99 KB part), the refusals and their reasons, the kernel
table against the .cu sources, the layout of the host-written meta buffer and the refusal of a parallel chunk wider
than a pass. The forward sequence through a recording launcher: test_cuda_forward.py."""
from __future__ import annotations

import math
import re
import shutil
import subprocess

import numpy as np
import pytest

from cuda_plan_fixtures import (GEOMETRIES, H200, ORIN, PREFILL_REGS, QWEN2_5, RTX40, record_chunk, cfg_of, covers,
                                limits)
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict
from vla_edge_ros.engine.cuda.kernels import (BENCH_KERNELS, BY_NAME, KERNEL_FILES, KERNELS, LAUNCH_CONSTANTS)
from vla_edge_ros.engine.cuda.pass_meta import (FORCED_AT, META_INTS, PARALLEL_MAX_TILES, PARALLEL_RECORD,
                                                chunk_meta, forced_at, meta_ints, meta_record, parallel_record,
                                                parallel_records, parallel_slots_problem, parallel_tiles,
                                                pass_tiles)
from vla_edge_ros.engine.cuda.plan import (LATE_TRIGGER_FAMILIES, T_CHUNK, DeviceLimits, LaunchConstants, Tuning,
                                           check_geometry, gemm4_grid, late_trigger_mask, padded_intermediate,
                                           plan, split_len)
from vla_edge_ros.engine.cuda.probe import CUDA_DIR
from vla_edge_ros.engine.cuda.vram import memory_plan
from vla_edge_ros.engine.interface import EngineError


# ------------------------------------------------------------------------------------------------- plan
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_h200_default_plan(geometry):
    cfg = cfg_of(geometry)
    p = plan(cfg, Tuning(), limits(H200, cfg))
    H, I, HD, G = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    assert p.pdl and p.keys_per_split == 64
    # the gate/up and down GEMMs on gemm32v4 (one block per SM), qkv and o split-K
    assert (p.gemm_gateup.kernel, p.gemm_down.kernel) == ("gemm32v4_silu", "gemm32v4_atomic")
    assert p.gemm_gateup.grid[1] == 1 and p.gemm_gateup.grid[0] * p.gemm_gateup.grid[1] <= 132
    assert p.gemm_down.grid[0] * p.gemm_down.grid[1] <= 132
    assert p.raise_smem == {"gemm32v4_silu": 147456, "gemm32v4_atomic": 147456}
    nqkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * HD
    for launch, N, K in ((p.gemm_qkv, nqkv, H), (p.gemm_o, H, cfg.num_attention_heads * HD)):
        assert launch.kernel == "gemm32_atomic" and launch.ks % 32 == 0
        covers(launch, N, K, 128)
    for launch, K in ((p.gemv_o, cfg.num_attention_heads * HD), (p.gemv_down, I)):
        assert launch.kernel == "gemv_resid" and launch.ks % 256 == 0 and launch.smem == 4 * launch.ks
        covers(launch, H, K, 16)
    assert p.gemv_qkv.grid == (math.ceil(nqkv / 16), 1) and p.gemv_gateup.grid == (math.ceil(I / 8), 1)
    # attention: per head_dim, 2G warps in the prefill; the prefill's merge with 4 dims per thread where HD allows
    assert p.attn_prefill.kernel == f"attn_prefill_hd{HD}" and p.attn_prefill.block == (64 * G, 1, 1)
    assert p.attn_decode.kernel == f"attn_decode_hd{HD}" and p.attn_decode.block == (128, 1, 1)
    assert p.merge_prefill.kernel == ("attn_combine_v4" if HD == 128 else "attn_combine_v2")
    assert p.merge_prefill.grid[0] * 256 // 8 * (4 if HD == 128 else 2) == cfg.num_attention_heads * 32 * HD
    assert p.merge_decode.kernel == "attn_combine"
    assert p.splits(4104) == 65 and p.splits(64) == 1
    assert p.late_trigger_mask == late_trigger_mask(Tuning().late_trigger) and not p.late_trigger_mask & 1
    assert p.notes == ()


@pytest.mark.parametrize("device,v4", [(ORIN, True), (RTX40, False)])
def test_pre_hopper_plans(device, v4):
    """No PDL below sm_90; on 99 KB parts the gemm32v4 GEMMs move to the split-K gemm32 and the plan says so."""
    cfg = cfg_of("1.5b")
    p = plan(cfg, Tuning(), limits(device, cfg))
    assert not p.pdl
    assert (p.gemm_gateup.kernel == "gemm32v4_silu") == v4 and (p.gemm_down.kernel == "gemm32v4_atomic") == v4
    if not v4:
        assert p.gemm_gateup.kernel == "gemm32_silu" and p.gemm_down.kernel == "gemm32_atomic"
        covers(p.gemm_down, cfg.hidden_size, cfg.intermediate_size, 128)
        assert p.raise_smem == {} and len(p.notes) == 1 and "101376" in p.notes[0]
    else:
        assert p.gemm_gateup.grid[0] <= 16 and p.notes == ()


def test_tuning_moves_gemms_and_pdl():
    cfg = cfg_of("1.5b")
    h200 = limits(H200, cfg)
    p = plan(cfg, Tuning(gemm_v4=("qkv", "o", "gateup", "down"), pdl=False), h200)
    assert {p.gemm_qkv.kernel, p.gemm_o.kernel, p.gemm_down.kernel} == {"gemm32v4_atomic"} and not p.pdl
    p = plan(cfg, Tuning.from_mapping({"gemm_v4": "", "late_trigger": ""}), h200)
    assert p.gemm_gateup.kernel == "gemm32_silu" and p.gemm_down.kernel == "gemm32_atomic"
    assert p.late_trigger_mask == 0 and p.raise_smem == {}
    assert not plan(cfg, Tuning(), limits({**H200, "pdl": False}, cfg)).pdl  # the driver cannot, the tuning wants
    # a gate/up whose K does not fit one gemm32v4 block (hidden > 1536) stays on gemm32_silu
    wide = cfg_of("1.5b", hidden_size=2048, num_attention_heads=16, num_key_value_heads=4)
    assert plan(wide, Tuning(), h200).gemm_gateup.kernel == "gemm32_silu"


def test_tuning_refuses_unknown_values():
    with pytest.raises(EngineError, match="unknown 'nope'"):
        Tuning(gemm_v4=("gateup", "nope"))
    with pytest.raises(EngineError, match="late_trigger"):
        Tuning.from_mapping({"late_trigger": "attn,nope"})
    with pytest.raises(EngineError, match="unknown tuning key"):
        Tuning().with_changes(decode_kernel="persistent")  # removed alternatives are refused by name
    with pytest.raises(EngineError, match="positive integer"):
        Tuning(gemv_min_ks=0)
    with pytest.raises(EngineError, match="true or false"):
        Tuning(pdl="yes")
    with pytest.raises(EngineError, match="tuning fused_parallel must be true or false, got 1"):
        Tuning(fused_parallel=1)
    assert Tuning.from_mapping({"gemm_v4": "down, gateup"}).gemm_v4 == ("down", "gateup")


@pytest.mark.parametrize("over,match", [
    ({"hidden_size": 1152, "num_attention_heads": 12}, r"head_dim=96 \(hidden_size / num_attention_heads; the "
                                                       r"attention kernels are built for 64 and 128\)"),
    ({"hidden_size": 640, "num_attention_heads": 20, "num_key_value_heads": 4}, "head_dim=32"),
    ({"hidden_size": 2560, "num_attention_heads": 10, "num_key_value_heads": 2}, "head_dim=256"),
    # the decode GEMVs' fp32 input vector (4 x hidden bytes) beyond the H200's 227 KB per block
    ({"hidden_size": 65536, "num_attention_heads": 512, "num_key_value_heads": 64},
     "hidden_size=65536: the decode GEMVs need 262144 bytes of shared memory .* allows 232448"),
    ({"vocab_size": 4096, "vla": {"n_action_bins": 2048}}, "n_action_bins=2048 > 1024"),
])
def test_geometries_the_kernels_cannot_run_are_refused_by_name(over, match):
    cfg = cfg_of("1.5b", **over)
    for check in (lambda: check_geometry(cfg, DeviceLimits(**H200)), lambda: plan(cfg, Tuning(), limits(H200, cfg))):
        with pytest.raises(EngineError, match=match) as e:
            check()
        assert "geometry not supported by the CUDA kernels" in str(e.value)


def test_every_reason_is_given_at_once():
    cfg = cfg_of("1.5b", hidden_size=1152, num_attention_heads=12, vocab_size=4096, vla={"n_action_bins": 2048})
    with pytest.raises(EngineError, match="head_dim=96 .*; n_action_bins=2048 > 1024"):
        plan(cfg, Tuning(), limits(H200, cfg))


def test_gemv_split_is_capped_by_the_shared_memory():
    """A down GEMV whose single split would not fit the block's shared memory gets more splits, not a refusal: an
    intermediate of 65536 with one block asked for, and Qwen2.5-72B's 29568 on a 99 KB part."""
    cfg = cfg_of("1.5b", intermediate_size=65536)
    p = plan(cfg, Tuning(gemv_target_blocks=1), limits(H200, cfg))
    assert p.gemv_down.smem == 4 * p.gemv_down.ks <= 232448 and p.gemv_down.grid[1] >= 2
    covers(p.gemv_down, cfg.hidden_size, 65536, 16)
    big = ModelConfig.from_json(QWEN2_5["72b"][0]())
    down = plan(big, Tuning(), limits(RTX40, big)).gemv_down
    assert down.smem <= 101376 and down.grid[1] >= 2
    covers(down, big.hidden_size, big.intermediate_size, 16)
    # where one split fits (the H200), the same geometry keeps it
    assert plan(big, Tuning(), limits(H200, big)).gemv_down.grid[1] == 1


def test_intermediate_sizes_off_the_quantum_run_padded():
    """intermediate 8968 (not a multiple of 32): the MLP kernels run at 8992 (zero-padded weights), everywhere."""
    cfg = cfg_of("1.5b", intermediate_size=8968)
    I = padded_intermediate(cfg)
    assert I == 8992 and padded_intermediate(cfg_of("1.5b")) == 8960
    for device in (H200, ORIN, RTX40):
        p = plan(cfg, Tuning(), limits(device, cfg))
        covers(p.gemv_down, cfg.hidden_size, I, 16)
        assert p.gemv_gateup.grid == (I // 8, 1)
        if p.gemm_gateup.kernel == "gemm32_silu":
            assert p.gemm_gateup.grid == (-(-2 * I // 128), 1)
    assert memory_plan(cfg, 1024, 8)["model"] > memory_plan(cfg_of("1.5b"), 1024, 8)["model"]


def _attention_expectations(cfg, device):
    c = LaunchConstants()
    G, HD = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    maxg = min(c.PF_MAXG_128 if HD == 128 else c.PF_MAXG_64, 65536 // (64 * PREFILL_REGS[HD]))
    return G, HD, maxg


@pytest.mark.parametrize("device", [H200, ORIN, RTX40], ids=["h200", "orin", "rtx40"])
@pytest.mark.parametrize("name", list(QWEN2_5))
def test_every_qwen2_5_size_plans(name, device):
    """Qwen2.5 0.5B .. 72B: the plan succeeds (shapes only) on every device class; a KV head's query heads beyond
    one attention block (3B and 72B: 8, 7B: 7, at head_dim 128) go to the head-group kernels, split evenly; every
    launch fits the device (threads, shared memory) and the forward's launches match the table."""
    make, G_want = QWEN2_5[name]
    cfg = ModelConfig.from_json(make())
    G, HD, maxg = _attention_expectations(cfg, device)
    assert G == G_want
    check_geometry(cfg, DeviceLimits(**device))  # the engine's early check (no registers known yet)
    p = plan(cfg, Tuning(), limits(device, cfg))
    n_kvh = cfg.num_key_value_heads
    pf, dec = p.attn_prefill, p.attn_decode
    if G <= maxg:
        assert (pf.kernel, pf.grid, pf.block) == (f"attn_prefill_hd{HD}", (0, n_kvh), (64 * G, 1, 1))
    else:
        groups, per = pf.grid[2], pf.block[0] // 64
        per_max = LaunchConstants().PFG_MAXG_128 if HD == 128 else LaunchConstants().PFG_MAXG_64
        assert pf.kernel == f"attn_prefill_hd{HD}_hg" and pf.grid[:2] == (0, n_kvh)
        assert per <= per_max and groups * per >= G > (groups - 1) * per and groups == -(-G // per_max)
        assert per - (groups * per - G) >= 1  # the last group holds at least one real head
        assert any("prefill attention" in n and "head groups" in n for n in p.notes)
    if G <= 8:
        assert (dec.kernel, dec.grid) == (f"attn_decode_hd{HD}", (0, n_kvh))
    else:
        assert dec.kernel == f"attn_decode_hd{HD}_hg" and dec.grid == (0, n_kvh, -(-G // 8))
    if name in ("3b", "72b", "7b"):
        assert pf.kernel.endswith("_hg") and pf.grid[2] == 2 and pf.block == (256, 1, 1)
    if name in ("0.5b", "1.5b", "14b", "32b"):
        assert not pf.kernel.endswith("_hg")
    launches = [v for v in p.__dict__.values() if hasattr(v, "kernel")]
    for launch in launches:
        assert launch.kernel in BY_NAME, launch
        assert launch.block[0] <= 1024 and launch.smem <= device["smem_optin"], launch
        assert p.raise_smem.get(launch.kernel, launch.smem) >= launch.smem
    assert all(v <= device["smem_optin"] for v in p.raise_smem.values())
    I = cfg.intermediate_size
    covers(p.gemv_down, cfg.hidden_size, I, 16)
    if p.gemm_down.kernel == "gemm32_atomic":
        covers(p.gemm_down, cfg.hidden_size, I, 128)
    else:
        R, S = p.gemm_down.grid
        assert R * S <= device["sm_count"] and -(-(I // 32) // S) <= 48
    rec = record_chunk(cfg, p, 4104)
    attn = [r for r in rec if r[0].startswith(("attn_prefill", "attn_decode"))]
    assert len(attn) == cfg.num_hidden_layers * 9 and all(r[1][0] == 65 and r[1][1:] in ((n_kvh,), (n_kvh, 2))
                                                          for r in attn)


def test_many_query_heads_per_kv_head_use_head_groups_in_both_attentions():
    """16 query heads on one KV head (head_dim 64): two prefill groups of 8, two decode groups of 8; 20 heads at
    head_dim 128: five prefill groups of 4, three decode groups (7, 7, 6)."""
    cfg = cfg_of("1.5b", hidden_size=1024, num_attention_heads=16, num_key_value_heads=1)
    p = plan(cfg, Tuning(), limits(H200, cfg))
    assert (p.attn_prefill.kernel, p.attn_prefill.grid, p.attn_prefill.block) == \
        ("attn_prefill_hd64_hg", (0, 1, 2), (512, 1, 1))
    assert (p.attn_decode.kernel, p.attn_decode.grid) == ("attn_decode_hd64_hg", (0, 1, 2))
    cfg = cfg_of("1.5b", hidden_size=2560, num_attention_heads=20, num_key_value_heads=1)
    p = plan(cfg, Tuning(), limits(H200, cfg))
    assert (p.attn_prefill.grid, p.attn_prefill.block) == ((0, 1, 5), (256, 1, 1))
    assert p.attn_decode.grid == (0, 1, 3) and len(p.notes) == 2
    # fewer registers per block than the compiled kernel needs for 6 heads: the groups get smaller
    small = DeviceLimits(**H200, regs_per_block=32768, prefill_attn_regs=168)
    one = cfg_of("1.5b")  # G = 6
    assert plan(one, Tuning(), small).attn_prefill.block == (192, 1, 1)
    with pytest.raises(EngineError, match="does not fit one block"):
        plan(one, Tuning(), DeviceLimits(**H200, regs_per_block=8192, prefill_attn_regs=168))


def test_gemm32v4_falls_back_where_the_device_has_too_few_sms():
    """72B's down GEMM (K = 29568: 20 gemm32v4 splits) on Jetson Orin's 16 SMs: the split-K gemm32, logged."""
    cfg = ModelConfig.from_json(QWEN2_5["72b"][0]())
    p = plan(cfg, Tuning(), limits(ORIN, cfg))
    assert p.gemm_down.kernel == "gemm32_atomic" and "gemm32v4_atomic" not in p.raise_smem
    covers(p.gemm_down, cfg.hidden_size, cfg.intermediate_size, 128)
    assert any(n.startswith("down GEMM on gemm32") for n in p.notes)
    assert plan(cfg, Tuning(), limits(H200, cfg)).gemm_down.kernel == "gemm32v4_atomic"


def test_split_len_covers_k_in_quanta():
    for K in (256, 896, 1536, 4864, 8960):
        for rb in (1, 18, 24, 192, 280):
            ks = split_len(K, rb, 264, 32, 256)
            assert ks % 32 == 0 and ks >= min(256, K)
            assert (K + ks - 1) // ks * ks >= K
    # a shortest split (tuning gemm_min_ks) off the quantum is rounded up to it: a kernel's K step never straddles
    assert split_len(1000, 1, 264, 32, 100) == 128 and split_len(8960, 12, 264, 64, 500) == 512


@pytest.mark.parametrize("N,K,n_sm,max_splits", [(17920, 1536, 132, 1), (2048, 1536, 132, 1), (1536, 8960, 132, 0),
                                                  (896, 4864, 132, 0), (9728, 896, 114, 1), (1536, 8960, 16, 0),
                                                  (32, 64, 132, 0)])
def test_gemm4_grid_fits_the_sms_and_the_kernel(N, K, n_sm, max_splits):
    """At most one block per SM, every split's K range within what a block's warps hold (G4_NW x G4_U k32 steps),
    every row group and step covered, no block larger than needed by more than 2 %."""
    c = LaunchConstants()
    R, S = gemm4_grid(N, K, n_sm, max_splits)
    nrg, nsteps = N // 16, K // 32
    assert 1 <= R <= nrg and 1 <= S <= nsteps and R * S <= n_sm
    assert -(-nsteps // S) <= c.G4_NW * c.G4_U
    if max_splits:
        assert S <= max_splits
    work = -(-nrg // R) * -(-nsteps // S)
    best = min(-(-nrg // max(1, min(nrg, n_sm // s))) * -(-nsteps // s)
               for s in range(-(-nsteps // (c.G4_NW * c.G4_U)), (max_splits or min(n_sm, nsteps)) + 1))
    assert work <= best * 1.02


def test_gemm4_grid_refuses_what_the_kernel_cannot_do():
    with pytest.raises(EngineError):
        gemm4_grid(2 * 8960, 3072, 132, max_splits=1)  # SiLU epilogue: K must fit one block
    with pytest.raises(EngineError):
        gemm4_grid(1000, 1536, 132)  # N not a multiple of 16
    with pytest.raises(EngineError):
        gemm4_grid(1536, 8960, 4)  # 280 k32 steps need 6 splits


def test_late_trigger_mask_matches_the_kernel_families():
    assert late_trigger_mask("") == 0 and late_trigger_mask(()) == 0
    assert late_trigger_mask("qkv") == 1
    assert late_trigger_mask("attn, combine") == 0b110 == late_trigger_mask(("attn", "combine"))
    assert late_trigger_mask(LATE_TRIGGER_FAMILIES) == (1 << len(LATE_TRIGGER_FAMILIES)) - 1
    with pytest.raises(EngineError, match="unknown kernel family"):
        late_trigger_mask("attn,nope")
    enum = re.search(r"enum VlaFamily \{([^}]*)\}", (CUDA_DIR / "common.cuh").read_text()).group(1)
    assert [m.group(1).lower() for m in re.finditer(r"FAM_(\w+) = \d+", enum)] == list(LATE_TRIGGER_FAMILIES)


def test_memory_plan_grows_with_the_kv_budget():
    cfg = cfg_of("1.5b")
    small, big = memory_plan(cfg, 1024, 8), memory_plan(cfg, 4096, 8)
    assert small["model"] == big["model"] > 2.6e9 * 1.1  # bf16 weights incl. the embedding
    assert big["kv"] == 2 * 28 * (4096 + 8) * 256 * 2 and small["kv"] < big["kv"] and small["scratch"] < big["scratch"]


def test_memory_plan_of_a_parallel_chunk_counts_its_slots_and_input_rows():
    """A parallel H = 4 chunk: 28 scratch slots (geometry.chunk_scratch_slots, not decode_steps = 1) in the KV cache;
    in the scratch its 32 constant input rows (fp32) and a second tile of the passes' rows (pass_meta.pass_tiles:
    the fused pass runs the frame's tile and the slots' at once)."""
    vla = {**tiny_default_dict()["vla"], "action_horizon": 4}  # (a Qwen2.5 dict has no vla block: the defaults)
    ar, par = cfg_of("1.5b", vla=vla), cfg_of("1.5b", vla={**vla, "chunk_decode": "parallel"})
    a, b = memory_plan(ar, 4096, 28), memory_plan(par, 4096, 28)
    assert a["kv"] == b["kv"] == 2 * 28 * (4096 + 28) * 256 * 2
    H, nqkv, I = 1536, 1536 + 2 * 256, padded_intermediate(par)
    tile = 4 * T_CHUNK * (3 * H + nqkv) + 2 * T_CHUNK * (2 * H + I)  # memory_plan's fp32 and bf16 rows of a tile
    assert b["scratch"] - a["scratch"] == 4 * T_CHUNK * H + tile


# ------------------------------------------------------------------------------------------------- meta, refusal
def test_meta_buffer_layout():
    """Records of META_INTS ints (the frame prefill's at 0, the parallel pass's at PARALLEL_RECORD), then forced[gen];
    the kernels read [L, p0, T, n_ctx, bidirectional] (cuda/rope_attention.cu) and forced at FORCED_AT."""
    assert (META_INTS, PARALLEL_RECORD, FORCED_AT) == (8, 8, 16)
    assert meta_record(160, 128, 32, 160) == [160, 128, 32, 160, 0, 0, 0, 0]
    assert parallel_record(160, 28) == [188, 160, 28, 160, 1, 0, 0, 0]  # slots at n_ctx .., see each other
    m = chunk_meta(30, meta_record(160, 128, 32, 160))
    assert m.dtype == np.int32 and m.shape == (16 + 30,)
    assert list(m[:8]) == [160, 128, 32, 160, 0, 0, 0, 0] and not m[8:16].any() and (m[16:] == -1).all()
    forced = np.full(29, -1, np.int64)
    forced[1:8] = 300 + np.arange(7)  # geometry.forced_gen's layout: one forced step of 7 bins after the start
    m = chunk_meta(29, meta_record(160, 128, 32, 160), parallel_record(160, 28), forced)
    assert list(m[8:16]) == [188, 160, 28, 160, 1, 0, 0, 0]
    np.testing.assert_array_equal(m[16:], forced)
    with pytest.raises(EngineError, match="forced has 28 entries, gen 29"):
        chunk_meta(29, meta_record(1, 0, 1, 0), None, forced[:28])


@pytest.mark.parametrize("horizon, decode, tiles, problem", [
    (4, "parallel", 1, False), (1, "parallel", 1, False),  # 28 and 7 slots: one row tile
    (5, "parallel", 2, False), (8, "parallel", 2, False), (10, "parallel", 3, False),  # 35, 56, 70 slots
    (36, "parallel", 8, False), (37, "parallel", 9, True),  # 252 slots: 8 tiles, the most; 259: refused
    (40, "autoregressive", 1, False)])  # the decode steps take any A
def test_a_parallel_chunk_is_tiled_and_one_wider_than_the_most_tiles_is_refused_by_name(horizon, decode, tiles,
                                                                                        problem):
    cfg = cfg_of("tiny", vla={**tiny_default_dict()["vla"], "action_horizon": horizon, "chunk_decode": decode})
    assert parallel_tiles(cfg) == tiles
    assert pass_tiles(cfg) == (tiles + 1 if decode == "parallel" else 1)  # the frame's tile first
    why = parallel_slots_problem(cfg)
    if not problem:
        assert why is None
        return
    a = 7 * horizon
    assert PARALLEL_MAX_TILES == 8
    assert f"vla.chunk_decode='parallel' with {a} action slots (vla.action_horizon {horizon} x 7" in why
    assert "at most 256 slots (8 row tiles of 32)" in why and "action_horizon of at most 36" in why


def test_the_parallel_records_of_a_tiled_pass_and_the_meta_buffer_that_holds_them():
    """56 slots: two tiles, every tile sees all n_ctx + 56 keys (bidirectional), tile 1's rows start at slot 32
    (position n_ctx + 32) and are 24; the meta buffer holds the frame's record, both tiles' and then forced."""
    recs = parallel_records(160, 56)
    assert recs == [[216, 160, 32, 160, 1, 0, 0, 0], [216, 192, 24, 160, 1, 0, 0, 0]]
    assert parallel_records(160, 28) == [parallel_record(160, 28)]  # one tile: the single record
    assert forced_at(2) == 24 and meta_ints(57, 2) == 24 + 57
    forced = np.full(57, -1, np.int64)
    forced[1:8] = 300 + np.arange(7)
    m = chunk_meta(57, meta_record(160, 128, 32, 160), recs, forced, tiles=2)
    assert m.shape == (24 + 57,) and list(m[8:16]) == recs[0] and list(m[16:24]) == recs[1]
    np.testing.assert_array_equal(m[24:], forced)
    with pytest.raises(EngineError, match="2 parallel records, the meta buffer holds 1"):
        chunk_meta(57, meta_record(1, 0, 1, 0), recs)


# ------------------------------------------------------------------------------------------------- kernel table
def _defines() -> dict[str, int]:
    """Integer values of the #defines of cuda/ (expressions of other defines evaluated)."""
    raw = {}
    for p in sorted(CUDA_DIR.glob("*.cu*")):
        for m in re.finditer(r"^#define (\w+) ([0-9A-Z_ ()*+/-]+?)\s*(?://.*)?$", p.read_text(), re.M):
            raw[m.group(1)] = m.group(2)

    def value(name: str, depth: int = 0) -> int:
        expr = re.sub(r"[A-Z_][A-Z0-9_]*", lambda t: str(value(t.group(0), depth + 1)), raw[name])
        return int(eval(expr, {"__builtins__": {}}))  # digits and + - * / ( ) only (the regex above)
    return {k: value(k) for k in raw}


def test_launch_constants_defaults_are_the_sources_values():
    """LaunchConstants (what the host plans with before the modules are loaded, and on CPU) = the .cu defines, and
    each file's vla_launch array lists exactly the names the host reads (kernels.LAUNCH_CONSTANTS), in order."""
    d, c = _defines(), LaunchConstants()
    for name in LaunchConstants.__dataclass_fields__:
        assert getattr(c, name) == d[name], name
    for fname, names in LAUNCH_CONSTANTS.items():
        m = re.search(r"__constant__ int vla_launch\[(\d+)\] = \{([^}]*)\};", (CUDA_DIR / fname).read_text())
        assert m, fname
        assert int(m.group(1)) == len(names) and tuple(x.strip() for x in m.group(2).split(",")) == names


def _preprocessed(fname: str) -> str:
    cpp = shutil.which("cpp")
    if cpp is None:
        pytest.skip("no C preprocessor")
    return subprocess.run([cpp, "-P", "-I", str(CUDA_DIR), "-D__CUDA_ARCH__=900", str(CUDA_DIR / fname)],
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("fname", sorted(set(KERNEL_FILES + tuple(k.file for k in BENCH_KERNELS))))
def test_kernel_table_matches_the_sources(fname):
    """Every extern "C" kernel of a file is in the table with its file, and its signature has one letter per
    parameter of the right kind (pointer / int / float): no kernel is compiled that the host does not know."""
    src = _preprocessed(fname)
    found = {}
    for m in re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(([^)]*)\)', src):
        params = [p.strip() for p in m.group(2).split(",")]
        found[m.group(1)] = "".join("P" if "*" in p else ("f" if p.split()[-2] == "float" else "i") for p in params)
    want = {k.name: k.sig for k in KERNELS + BENCH_KERNELS if k.file == fname}
    assert found == want
