"""The fleet's GEMM kernels (issue 24; cuda/fleet.cu, cuda/gemm_tiled.cu): their launch grids on CPU
(gemv_rows_mma for the decode steps of <= 16 robots, gemm_tiled*_atomic / _silu for the prefill under tuning
fleet_gemm = "tiled") and, on a GPU (marked ``gpu``), each kernel alone against float64 numpy on the same bf16
inputs: gemv_rows_mma for 1..16 rows, gemm_tiled* for 32..512 rows (ragged rows and columns, odd K splits, the SiLU
epilogue over interleaved gate/up rows). The engine around them: test_cuda_fleet.py."""
from __future__ import annotations

import numpy as np
import pytest

from test_cuda_fleet import _fake_engine

I32 = np.int32


# ---------------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("geometry", ["1.5b", "0.5b"])
@pytest.mark.parametrize("rows", [33, 64, 96, 256, 512])
def test_gemm_tiled_launches_cover_every_row_column_and_k(geometry, rows):
    """tuning fleet_gemm = "tiled" (cuda/gemm_tiled.cu) past one 32-row tile (one tile stays on gemm32t_atomic):
    64-row block tiles up to 64 rows, 128-row ones past that; the grid (row blocks first: those of one column block
    run together) covers every 32-row tile and column, the K splits cover K in whole GT_BK-column steps, the blocks
    come near gemm_target_blocks without a split shorter than gemm_min_ks,
    and the shared memory is the module's."""
    from cuda_plan_fixtures import cfg_of
    from vla_edge_ros.engine.cuda import fleet_forward
    from vla_edge_ros.engine.cuda.plan import Tuning
    cfg = cfg_of(geometry)
    e = _fake_engine(cfg, tuning=Tuning(fleet_gemm="tiled"))
    c, t = e.limits.constants, e.tuning
    H, I = cfg.hidden_size, fleet_forward.padded_intermediate(cfg)
    nqkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    R = 32 * -(-rows // 32)
    assert fleet_forward.linear(e, 2 * I, H, 32).kernel == "gemm32t_atomic"
    for N, K in ((nqkv, H), (H, cfg.num_attention_heads * cfg.head_dim), (2 * I, H), (H, I)):
        launch = fleet_forward.linear(e, N, K, rows)
        bm = 64 if R <= 64 else 128
        gy, gx, gz = launch.grid
        assert launch.kernel == f"gemm_tiled{bm}_atomic" and launch.block == (256, 1, 1)
        assert launch.smem == (c.GT_SMEM128 if bm == 128 else c.GT_SMEM64)
        assert gx * c.GT_BN >= N > (gx - 1) * c.GT_BN and gy * bm >= R > (gy - 1) * bm
        assert launch.ks % c.GT_BK == 0 and gz * launch.ks >= K > (gz - 1) * launch.ks
        assert launch.ks >= min(K, t.gemm_min_ks)
        if gz > 1:  # split only to come near the target, never past twice it
            assert gx * gy * gz < 2 * t.gemm_target_blocks
    silu = fleet_forward.tiled_gemm(c, t, 2 * I, H, rows, silu=True)  # the gate/up GEMM writing silu(gate) * up
    assert silu.kernel == f"gemm_tiled{bm}_silu" and silu.grid == (-(-R // bm), -(-2 * I // c.GT_BN), 1)


def test_a_gemm_the_tiled_kernel_cannot_take_stays_on_the_32_row_kernels():
    """A K off the build's K step, or a block tile larger than the device's shared memory: the fleet's GEMM stays on
    gemm32t_atomic, and the single engine's parallel pass on the per-tile kernels with the reason in the plan's
    notes; neither refuses the model."""
    import types
    from dataclasses import replace

    from cuda_plan_fixtures import H200, RTX40, cfg_of, limits
    from vla_edge_ros.engine.config import tiny_default_dict
    from vla_edge_ros.engine.cuda import fleet_forward
    from vla_edge_ros.engine.cuda.plan import Tuning, plan, tiled_gemm_unfit
    from vla_edge_ros.engine.interface import EngineError
    lim = limits(H200, cfg_of("1.5b"))
    c, t = lim.constants, Tuning(fleet_gemm="tiled")
    e = types.SimpleNamespace(limits=lim, tuning=t)
    assert fleet_forward.linear(e, 1536, 1536, 256).kernel == "gemm_tiled128_atomic"
    assert fleet_forward.linear(e, 1536, 1536 + c.GT_BK // 2, 256).kernel == "gemm32t_atomic"
    assert "K of 64, not 1536 x 1568" in tiled_gemm_unfit(c, [(1536, 1568, False)], 256, lim.smem_optin)
    assert "N a multiple of 32" in tiled_gemm_unfit(c, [(1552, 1536, True)], 256, lim.smem_optin)
    with pytest.raises(EngineError, match="gemm_tiled: the tiled GEMM takes N a multiple of 2 and K of 64"):
        fleet_forward.tiled_gemm(c, t, 1536, 1568, 256)  # asked directly, the kernel's rule is an error
    small = types.SimpleNamespace(limits=replace(lim, smem_optin=RTX40["smem_optin"]), tuning=t)
    assert fleet_forward.linear(small, 1536, 1536, 256).kernel == "gemm32t_atomic"
    assert fleet_forward.linear(small, 1536, 1536, 64).kernel == "gemm_tiled64_atomic"  # its 82944 B fit
    vla = {**tiny_default_dict()["vla"], "action_horizon": 8, "chunk_decode": "parallel"}
    cfg = cfg_of("tiny", vla=vla)  # hidden 256: no whole step of 512
    p = plan(cfg, Tuning(parallel_gemm="tiled"), replace(limits(H200, cfg), constants=replace(c, GT_BK=512)))
    assert p.parallel_gemms == () and any("K of 512, not" in n for n in p.notes)


@pytest.mark.parametrize("geometry", ["1.5b", "0.5b", "tiny"])
@pytest.mark.parametrize("rows", [1, 8, 9, 16])
def test_gemv_rows_mma_launches(geometry, rows):
    """Every linear layer of a decode step on gemv_rows_mma: GEMM_WARPS x 16 weight rows per block cover N, the K
    splits (multiples of 64, at least one 256-column chunk, at most GR_MAX_KS) cover K with none empty, at most
    gemv_target_blocks blocks where the row blocks alone do not exceed it, and the staged rows (8 or 16 of them,
    bf16) fit the default 48 KiB of shared memory."""
    from cuda_plan_fixtures import cfg_of
    from vla_edge_ros.engine.cuda import fleet_forward
    from vla_edge_ros.engine.cuda.plan import SMEM_DEFAULT, Tuning, padded_intermediate
    cfg = cfg_of(geometry)
    e = _fake_engine(cfg, tuning=Tuning(fleet_gemv="mma"))
    c, target = e.limits.constants, e.tuning.gemv_target_blocks
    H, I, HD = cfg.hidden_size, padded_intermediate(cfg), cfg.head_dim
    nq = cfg.num_attention_heads * HD
    for N, K in ((nq + 2 * cfg.num_key_value_heads * HD, H), (H, nq), (2 * I, H), (H, I)):
        launch = fleet_forward.linear(e, N, K, rows)
        rb, splits = launch.grid
        assert launch.kernel == "gemv_rows_mma" and launch.block == (32 * c.GEMM_WARPS, 1, 1)
        assert rb * 16 * c.GEMM_WARPS >= N > (rb - 1) * 16 * c.GEMM_WARPS
        assert launch.ks % 64 == 0 and 256 <= launch.ks <= fleet_forward.GR_MAX_KS
        assert splits * launch.ks >= K > (splits - 1) * launch.ks
        assert rb * splits <= target or splits == 1 or launch.ks == 256, (N, K, launch)
        assert launch.smem == 2 * (8 if rows <= 8 else 16) * launch.ks <= SMEM_DEFAULT


def test_a_micro_benchmark_ends_with_its_per_layer_table_verdict_and_json(tmp_path, capsys):
    """gpu_gemm_micro.finish (both micro-benchmarks' end): the layer's four GEMMs summed per row count with the
    speed-up, the checks' verdict and exit status, the JSON as timed."""
    import json

    from vla_edge_ros.bench import gpu_gemm_micro as micro
    rows = [{"rows": 64, "variant": v, "us": us} for v, us in (("tiles32", 30.0), ("tiled", 20.0), ("tiles32", 10.0),
                                                                ("tiled", 5.0))]
    out = {"rows": rows}
    assert micro.finish(out, [64], ("tiles32", "tiled"), 0, 0.01, str(tmp_path / "m.json")) == 0
    text = capsys.readouterr().out
    assert "  64     40.00     25.00     1.60x" in text and "all checks passed (max |err| / max |ref| < 0.01)" in text
    assert json.loads((tmp_path / "m.json").read_text()) == out
    assert micro.finish(out, [64], ("tiles32", "tiled"), 2, 0.01, "") == 1
    assert "2 checks FAILED" in capsys.readouterr().out


def test_the_gemm_micro_benchmark_times_the_engines_launches_and_refuses_bad_rows(capsys):
    """bench/gpu_gemm_micro.py: --rows takes multiples of 32 past one tile; each variant is the launch the fleet makes
    (tiles32: gemm32t_atomic; tiled: gemm_tiled*, the gate/up one the SiLU form); without a GPU it exits 2 with the
    reason."""
    import argparse

    from cuda_plan_fixtures import H200, cfg_of, limits
    from vla_edge_ros.bench import gpu_gemm_micro as micro
    assert micro.row_counts("64, 96,256") == [64, 96, 256]
    for bad in ("32", "64,100", "", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--rows"):
            micro.row_counts(bad)
    lim = limits(H200, cfg_of("1.5b"))
    assert micro.launch_for(lim, "tiles32", 17920, 1536, 96, True).kernel == "gemm32t_atomic"
    assert micro.launch_for(lim, "tiled", 17920, 1536, 96, True).kernel == "gemm_tiled128_silu"
    assert micro.launch_for(lim, "tiled", 1536, 8960, 64, False).kernel == "gemm_tiled64_atomic"
    qkv = micro.launch_for(lim, "tiled", 2048, 1536, 64, False)  # 16 column blocks, K in 6 splits of 256
    finer = micro.launch_for(lim, "tiled", 2048, 1536, 64, False, {"gemm_min_ks": 128})  # --tune: 12 of 128
    assert (qkv.grid, qkv.ks, finer.grid, finer.ks) == ((1, 16, 6), 256, (1, 16, 12), 128)
    from vla_edge_ros.engine.interface import EngineError
    with pytest.raises(EngineError, match="unknown tuning key"):
        micro.main(["--tune", '{"gemm_min_k": 128}'])
    from vla_edge_ros.engine.cuda.probe import cuda_status
    if not cuda_status()[0]:
        assert micro.main(["--rows", "64"]) == 2 and "gpu_gemm_micro: no usable GPU" in capsys.readouterr().err


# ---------------------------------------------------------------------- gemv_rows_mma, gemm_tiled alone (GPU)
@pytest.fixture(scope="module")
def fleet_kernels():
    """cuda/fleet.cu and gemm_tiled.cu, compiled for the GPU present (test_cuda_kernels.Dev: uploads, poisoned
    buffers)."""
    from test_cuda_kernels import open_dev
    yield from open_dev(["fleet.cu", "gemm_tiled.cu"])


def _module_limits(d):
    """The H200's limits with the launch constants of the gemm_tiled.cu module under test (its K step is the
    build's: 64 on sm_90, 32 on sm_86 / sm_89 or under a GT_BK knob)."""
    from dataclasses import replace

    from cuda_plan_fixtures import H200, cfg_of, limits
    from vla_edge_ros.engine.cuda.kernels import LAUNCH_CONSTANTS
    ptr, nbytes = d.mods["gemm_tiled.cu"].get_global("vla_launch")
    got = np.zeros(nbytes // 4, np.int32)
    d.cuda.memcpy_dtoh(got, ptr)
    lim = limits(H200, cfg_of("1.5b"))
    return replace(lim, constants=replace(lim.constants, **dict(zip(LAUNCH_CONSTANTS["gemm_tiled.cu"],
                                                                    map(int, got)))))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,rows,steps", [
    (2048, 1536, 256, 0), (1536, 1536, 256, 0), (17920, 1536, 256, 0), (1536, 8960, 256, 0),  # 8 robots, 1.5B
    (2048, 1536, 96, 0), (17920, 1536, 64, 0), (1536, 8960, 512, 0),  # 3 / 2 / 16 robots
    (272, 704, 160, 0), (272, 704, 160, 3), (136, 128, 32, 1)])  # ragged columns, odd splits, one step per split
def test_gemm_tiled_against_numpy(fleet_kernels, N, K, rows, steps):
    """C[rows] += A W^T by gemm_tiled*_atomic on the engine's grids (steps = 0: fleet_forward.linear with tuning
    fleet_gemm = "tiled"; tiled_gemm's for one tile) and on splits of `steps` K steps of the build, against float64
    numpy on the same bf16 inputs. A's rows past `rows` are NaN (must not be read), C's rows past `rows` and columns
    past N keep their values, lda / ldc wider than K / N."""
    import types

    from test_cuda_kernels import rand_bf16, rel_err, set_smem
    from vla_edge_ros.engine.cuda import fleet_forward
    from vla_edge_ros.engine.cuda.plan import Tuning
    d, rng = fleet_kernels, np.random.default_rng(N + K + rows + steps)
    lda, ldc = K + 64, N + 16
    a_b, a = rand_bf16(rng, (rows, K))
    w_b, w = rand_bf16(rng, (N, K), 0.05)
    A = np.full((rows + 32, lda), 0x7FC0, np.uint16)
    A[:rows, :K] = a_b
    e = types.SimpleNamespace(limits=_module_limits(d), tuning=Tuning(fleet_gemm="tiled"))
    launch = fleet_forward.linear(e, N, K, rows) if rows > 32 else fleet_forward.tiled_gemm(
        e.limits.constants, e.tuning, N, K, rows)  # (the fleet keeps one tile on gemm32t; the kernel takes it)
    assert launch.kernel.startswith("gemm_tiled")
    if steps:
        ks = steps * e.limits.constants.GT_BK
        launch = launch._replace(grid=launch.grid[:2] + (-(-K // ks),), ks=ks)
        assert launch.grid[2] > 1
    f = d.fn(launch.kernel)
    set_smem(d, f, launch.smem)
    c0 = rng.standard_normal((rows + 32, ldc)).astype(np.float32)
    C = d.up(c0)
    f(d.up(A), I32(lda), d.up(w_b), I32(N), I32(K), I32(launch.ks), C, I32(ldc), I32(rows // 32),
      block=launch.block, grid=launch.grid, shared=launch.smem)
    out = d.down(C, (rows + 32, ldc), np.float32)
    assert rel_err(out[:rows, :N], c0[:rows, :N] + a @ w.T) < 1e-5, launch
    assert np.array_equal(out[rows:], c0[rows:]) and np.array_equal(out[:rows, N:], c0[:rows, N:]), launch


@pytest.mark.gpu
@pytest.mark.parametrize("I,K,rows", [(8960, 1536, 256), (8960, 1536, 64), (4864, 896, 96), (144, 128, 160)])
def test_gemm_tiled_silu_against_numpy(fleet_kernels, I, K, rows):
    """act[rows][I] = silu(gate) * up by gemm_tiled*_silu on the fleet's grid over interleaved gate/up weights (the
    1.5B and 0.5B widths; I = 144: a ragged last block tile), against float64 numpy; the rows past `rows` keep
    their poison (0xFFFF), A's rows past `rows` are NaN."""
    from test_cuda_kernels import bits_f32, rand_bf16, rel_err, set_smem
    from vla_edge_ros.engine.cuda.buffers import interleave_gate_up
    from vla_edge_ros.engine.cuda.plan import Tuning, tiled_gemm
    d, rng = fleet_kernels, np.random.default_rng(I + K + rows)
    a_b, a = rand_bf16(rng, (rows, K))
    g_b, g = rand_bf16(rng, (I, K), 0.05)
    u_b, u = rand_bf16(rng, (I, K), 0.05)
    A = np.full((rows + 32, K), 0x7FC0, np.uint16)
    A[:rows] = a_b
    launch = tiled_gemm(_module_limits(d).constants, Tuning(), 2 * I, K, rows, silu=True)
    assert launch.grid[2] == 1
    f = d.fn(launch.kernel)
    set_smem(d, f, launch.smem)
    act = d.poisoned(2 * (rows + 32) * I)
    f(d.up(A), I32(K), d.up(interleave_gate_up(g_b, u_b)), I32(2 * I), I32(K), act, I32(rows // 32),
      block=launch.block, grid=launch.grid, shared=launch.smem)
    out = d.down(act, (rows + 32, I), np.uint16)
    gg, uu = a @ g.T, a @ u.T
    assert rel_err(bits_f32(out[:rows]), gg / (1 + np.exp(-gg)) * uu) < 5e-3, launch
    assert np.all(out[rows:] == 0xFFFF), launch


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,ks", [
    (16, 32, 0), (48, 96, 64), (272, 704, 256), (272, 704, 0),  # one step, a split of 1.5 chunks' steps, tails
    (2048, 1536, 0), (1536, 1536, 0), (17920, 1536, 0), (1536, 8960, 0),  # the 1.5B decode step (engine grids)
    (1152, 896, 0), (896, 896, 0), (9728, 896, 0), (896, 4864, 0),  # 0.5B: K = 896 is 3.5 chunks
    (1536, 8960, 1536), (2048, 1536, 192)])  # split-K grids of other lengths (ks = 192: a tail step per split)
def test_gemv_rows_mma_against_numpy(fleet_kernels, N, K, ks):
    """C[rows] += A W^T for every row count 1..16 on the engine's grids (ks = 0: fleet_forward.linear) and chosen
    split lengths, against float64 numpy on the same bf16 inputs. The rows of A past `rows` are NaN (they must not
    be read), C's rows past `rows` must keep their values, lda / ldc wider than K / N."""
    import types

    from test_cuda_kernels import rand_bf16, rel_err
    from cuda_plan_fixtures import H200, cfg_of, limits
    from vla_edge_ros.engine.cuda import fleet_forward
    from vla_edge_ros.engine.cuda.plan import Tuning
    d, rng = fleet_kernels, np.random.default_rng(N + K + ks)
    lda, ldc = K + 64, N + 16
    a_b, a = rand_bf16(rng, (16, K))
    w_b, w = rand_bf16(rng, (N, K), 0.05)
    A = np.full((17, lda), 0x7FC0, np.uint16)  # bf16 NaN everywhere, the rows' K columns overwritten per case
    W = d.up(w_b)
    ref = a @ w.T
    e = types.SimpleNamespace(limits=limits(H200, cfg_of("1.5b")), tuning=Tuning(fleet_gemv="mma"))
    f = d.fn("gemv_rows_mma")
    for rows in range(1, 17):
        launch = fleet_forward.linear(e, N, K, rows)
        if ks:
            launch = launch._replace(grid=(launch.grid[0], -(-K // ks)), ks=ks,
                                     smem=2 * (8 if rows <= 8 else 16) * (-(-ks // 64) * 64))
        A[:] = 0x7FC0
        A[:rows, :K] = a_b[:rows]
        c0 = rng.standard_normal((17, ldc)).astype(np.float32)
        C = d.up(c0)
        f(d.up(A), I32(lda), W, I32(N), I32(K), I32(launch.ks), C, I32(ldc), I32(rows), block=launch.block,
          grid=launch.grid, shared=launch.smem)
        out = d.down(C, (17, ldc), np.float32)
        assert rel_err(out[:rows, :N], c0[:rows, :N] + ref[:rows]) < 1e-5, (rows, launch)
        assert np.array_equal(out[rows:], c0[rows:]) and np.array_equal(out[:rows, N:], c0[:rows, N:]), rows
