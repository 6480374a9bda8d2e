"""The batched CUDA fleet engine (issue 24, engine/cuda/fleet.py).

CPU: what it refuses, by name, before touching a GPU; its passes recorded (launches against the kernel table, the
GEMMs tuning.fleet_gemv and fleet_gemm name); gpu_fleet_bench's variants.
GPU (marked ``gpu``): a batch equals each robot run alone by the numpy engine (the oracle) on the tiny geometry
with eviction, changing memberships (subsets, a late joiner, a leaver), graphs on and off, either few-row GEMM; bad
members rejected alone; on the Qwen2.5-1.5B geometry (head_dim 128) a batch equals each robot's single CUDA engine;
both with either many-row prefill GEMM (tuning.fleet_gemm). The GEMM kernels alone: test_cuda_fleet_gemms.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from vla_edge_ros.engine.config import ModelConfig, qwen2_5_1_5b_dict, tiny_default_dict
from vla_edge_ros.engine.cuda.fleet import fleet_unsupported_reason

INSTRUCTION = "pick up the red block"  # 21 prefix tokens
TPF = 32


# ---------------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("change, weight_dtype, tpf, why", [
    ({}, "int8", 32, "bf16 weights only"),
    ({"vla": {"chunk_decode": "parallel", "action_horizon": 2}}, "bf16", 32, "autoregressively only"),
    ({"num_attention_heads": 32, "num_key_value_heads": 2, "hidden_size": 2048}, "bf16", 32, "query heads per KV"),
    ({}, "bf16", 64, "tokens_per_frame=64"),
])
def test_refusals_are_named(change, weight_dtype, tpf, why):
    d = tiny_default_dict()
    for k, v in change.items():
        if isinstance(v, dict):
            d[k].update(v)
        else:
            d[k] = v
    reason = fleet_unsupported_reason(ModelConfig.from_json(d), weight_dtype, tpf)
    assert reason is not None and why in reason, reason


def test_the_tiny_and_1_5b_geometries_are_accepted():
    for d in (tiny_default_dict(), qwen2_5_1_5b_dict()):
        assert fleet_unsupported_reason(ModelConfig.from_json(d), "bf16", 32) is None


class _FakeWeights:
    def __init__(self, cfg):
        from vla_edge_ros.engine.cuda.buffers import LayerWeights
        self.layers = [LayerWeights(*[1000 * (10 * i + j + 1) for j in range(7)]) for i in range(cfg.num_hidden_layers)]
        self.embed, self.final_norm, self.head_rows = 11, 12, 13


def _fake_engine(cfg, max_robots=8, budget=4096, tuning=None):
    """A FleetCudaEngine with the plan of an H200 and made-up device pointers: its pass recorded without a GPU."""
    from cuda_plan_fixtures import H200, limits
    from vla_edge_ros.engine.cuda.fleet import FleetCudaEngine
    from vla_edge_ros.engine.cuda.plan import Tuning, plan
    e = FleetCudaEngine.__new__(FleetCudaEngine)
    e.cfg, e.tuning, e.limits = cfg, tuning or Tuning(), limits(H200, cfg)
    e.plan, e.weights = plan(cfg, e.tuning, e.limits), _FakeWeights(cfg)
    e.max_robots, e.tpf, e.decode_steps, e.budget_tokens = max_robots, cfg.n_patches, 8, budget
    e.region = budget + 8
    e.slots_total, e.nkv, e.kps = max_robots * e.region, cfg.num_key_value_heads * cfg.head_dim, 64
    e.nsplit = -(-e.region // 64)
    e.part_rows = e.nsplit * cfg.num_attention_heads * 32
    for i, name in enumerate(("kc", "vc", "rope", "part_o", "part_ml", "x", "h_bf", "qkv", "attn_bf", "gu", "act_bf",
                              "xg", "logits", "tok", "forced", "one", "meta", "key_slots")):
        setattr(e, name, 10**9 * (i + 1))
    return e


@pytest.mark.parametrize("fleet_gemv, fleet_gemm", [("rows", "tiles32"), ("mma", "tiles32"), ("mma", "tiled")])
@pytest.mark.parametrize("geometry", ["1.5b", "tiny"])
@pytest.mark.parametrize("n", [1, 3, 8, 16])
def test_the_batched_pass_launches_match_the_table(geometry, n, fleet_gemv, fleet_gemm):
    """The prefill and decode graphs of n robots as recorded launches: every argument list matches the kernel's
    signature, grids are positive, per-member launches span the n members, the GEMMs pick the few-row GEMM that
    tuning.fleet_gemv names for a decode step of <= 16 robots and the many-row GEMM tuning.fleet_gemm names for
    the prefill (over the pass's 32-row tiles), each decode step's first launch is serial, and the gate/up buffer
    is zeroed before every gate/up GEMM that adds into it (the tiled one writes silu(gate) * up instead)."""
    from cuda_plan_fixtures import cfg_of, check_launch
    from vla_edge_ros.engine.cuda import fleet_forward
    from vla_edge_ros.engine.cuda.plan import Tuning
    cfg = cfg_of(geometry)
    e = _fake_engine(cfg, max_robots=16, tuning=Tuning(fleet_gemv=fleet_gemv, fleet_gemm=fleet_gemm))
    rec, zeros = [], []

    def k(launch, *args, serial=False):
        check_launch(launch, args)
        rec.append((launch.kernel, launch.grid, serial, args))

    zero = lambda ptr, count: zeros.append((len(rec), ptr, count))  # noqa: E731
    fleet_forward.prefill(e, k, zero, n)
    L = cfg.num_hidden_layers
    tiles = -(-n * cfg.n_patches // 32)
    tiled = fleet_gemm == "tiled" and tiles > 1  # its gate/up writes silu(gate) * up: no memset, no silu_rows
    many = "gemm_tiled" if tiled else "gemm32t"  # one tile stays on gemm32t
    per_layer = 8 if tiled else 9
    assert len(rec) == per_layer * L + 3 and len(zeros) == (0 if tiled else L)
    gemms = [r for r in rec if r[0].startswith(many)]
    assert len(gemms) == 4 * L and all(r[3][-1] == tiles for r in gemms)  # every tile of every member
    if tiled:  # 128-row block tiles once the pass has more than 64 rows; the grid's x covers every row
        bm = 128 if 32 * tiles > 64 else 64
        assert [r[0] for r in gemms[:4]] == [f"gemm_tiled{bm}_{m}" for m in ("atomic", "atomic", "silu", "atomic")]
        assert all(r[1][0] * bm >= 32 * tiles for r in gemms)
        assert all(r[3][5] == e.act_bf for r in gemms[2::4]) and "silu_rows" not in [r[0] for r in rec]
    assert all(r[1][-1] == n for r in rec if "batch" in r[0] or r[0] in ("rows_gather",))
    assert rec[-1][1] == (n, 1) and rec[-2][1][1] == n  # one argmax block / logits row per member
    assert [i for i, r in enumerate(rec) if r[2]] == [0]
    for at, ptr, count in zeros:
        assert ptr == e.gu and count == 32 * tiles * 2 * fleet_forward.padded_intermediate(cfg)
        assert rec[at][0] == "rmsnorm_rows_bf16"  # zeroed before the norm, whose output feeds the gate/up GEMM
        assert rec[at + 1][0].startswith(many) and rec[at + 1][3][6] == e.gu
    rec.clear()
    zeros.clear()
    fleet_forward.decode(e, k, zero, n)
    step = 1 + 10 * L + 3
    assert len(rec) == 8 * step
    names = [r[0] for r in rec[:step]]
    assert names[0] == "embed_gather" and rec[0][1][1] == n and rec[0][2]
    few = {"rows": "gemv_rows_atomic", "mma": "gemv_rows_mma"}[fleet_gemv]
    assert names[1:11] == ["rmsnorm_rows_bf16", few if n <= 16 else "gemm32t_atomic",
                           "kv_store_rows", f"attn_decode_batch_hd{cfg.head_dim}", "attn_combine_batch",
                           names[2], "rmsnorm_rows_bf16", names[2], "silu_rows", names[2]]
    assert [i for i, r in enumerate(rec) if r[2]] == [s * step + j for s in range(8) for j in (0, 1)]
    attn = [r for r in rec if r[0].startswith("attn_decode_batch")]
    assert [r[3][6] for r in attn[::L]] == list(range(1, 9))  # each step's attention is told its step
    assert all(r[3][5] == fleet_forward.rec_ptr(e, r[3][6]) for r in attn)  # ... and reads that step's records
    assert all(r[3][-1] == n for r in rec if r[0] == few)  # the few-row GEMMs take the rows themselves
    assert not any(r[0].startswith("gemv_rows") for r in rec if r[0] != few)


def test_the_fleet_gemv_knob_is_checked_by_name():
    from cuda_plan_fixtures import cfg_of
    from vla_edge_ros.engine.cuda import fleet_forward
    from vla_edge_ros.engine.cuda.plan import Tuning
    from vla_edge_ros.engine.interface import EngineError
    with pytest.raises(EngineError, match="tuning fleet_gemv must be one of mma, rows, got 'tensor'"):
        Tuning(fleet_gemv="tensor")  # at the tuning's construction, before any engine
    e = _fake_engine(cfg_of("tiny"), tuning=Tuning())
    object.__setattr__(e.tuning, "fleet_gemv", "tensor")  # past the check: the launch refuses it too
    with pytest.raises(EngineError, match="fleet_gemv must be one of 'rows', 'mma', got 'tensor'"):
        fleet_forward.linear(e, 512, 256, 3)
    fleet_forward.linear(e, 512, 256, 17)  # past the few rows the knob does not matter: gemm32t tiles
    with pytest.raises(EngineError, match="tuning fleet_gemm must be one of tiles32, tiled, got 'wide'"):
        Tuning(fleet_gemm="wide")


# ---------------------------------------------------------------------------------------------------- GPU
def _near_tie(logits: np.ndarray, chosen: int, tol: float) -> bool:
    """The reference's logit of the token the engine chose is within tol x std of the reference's best: the two
    engines' sums in other orders (bf16 rows between the layers) may pick either."""
    return bool(logits.max() - logits[chosen] < tol * np.std(logits))


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


class _Twins:
    """A FleetCudaEngine and, per robot, a reference engine fed the same frames one by one."""

    def __init__(self, torch, tmp_path, cfg_dict, budgets, reference="numpy", use_graphs=True, seed=3, tie=1e-2,
                 tuning=None):
        from test_cuda_model import random_checkpoint
        from vla_edge_ros.core.kv.manager import KVManager
        from vla_edge_ros.engine.checkpoint import load_checkpoint
        from vla_edge_ros.engine.cuda.fleet import FleetCudaEngine
        random_checkpoint(torch, cfg_dict, tmp_path / "ckpt", seed=seed)
        self.cfg = cfg = ModelConfig.from_json(cfg_dict)
        self.ckpt, self.budgets, self.reference = tmp_path / "ckpt", dict(budgets), reference
        self.kv = lambda name, policy="fifo": KVManager(self.budgets[name], TPF, len(INSTRUCTION.encode()),
                                                        policy=policy, embed_dim=cfg.hidden_size)
        self.engine = FleetCudaEngine(cfg, self.ckpt, lambda name: self.kv(name), instruction=INSTRUCTION,
                                      decode_tokens=8, max_robots=4, budget_tokens=max(self.budgets.values()),
                                      max_vram_gb=16.0, log=lambda m: None, use_graphs=use_graphs, tuning=tuning)
        self.weights = load_checkpoint(self.ckpt, cfg) if reference == "numpy" else None
        self.twins, self.rng, self.fid, self.checked, self.ties = {}, np.random.default_rng(seed), 0, 0, 0
        self.tie = tie

    def add(self, name):
        from vla_edge_ros.engine.cuda import CudaEngine
        from vla_edge_ros.engine.numpy_backend import NumpyEngine
        self.engine.add_robot(name)
        if self.reference == "numpy":
            self.twins[name] = NumpyEngine(self.cfg, self.weights, self.kv(name), instruction=INSTRUCTION,
                                           decode_tokens=8)
        else:
            self.twins[name] = CudaEngine(self.cfg, self.ckpt, self.kv(name), instruction=INSTRUCTION,
                                          decode_tokens=8, max_vram_gb=16.0, log=lambda m: None)

    def cycle(self, names):
        from vla_edge_ros.engine.fleet_numpy import BatchRequest
        reqs = {}
        for name in names:
            self.fid += 1
            x = (0.05 * self.rng.standard_normal((TPF, self.cfg.hidden_size))).astype(np.float32)
            reqs[name] = BatchRequest(x, self.fid, salient=self.fid % 3 == 0)
        results = self.engine.run_batch(reqs)
        assert list(results) == list(reqs)
        for name, req in reqs.items():
            want = self.twins[name].run_chunk(req.vision_tokens, req.frame_id, req.salient)
            self.check(name, results[name], want)
        return results

    def check(self, name, got, want):
        assert not isinstance(got, Exception), f"{name}: {got!r}"
        assert got.frame_id == want.frame_id and got.evicted_frames == want.evicted_frames
        assert got.kv_occupancy_tokens == want.kv_occupancy_tokens
        mine, ref = self.engine.robot(name).last_logits, self.twins[name].last_logits
        assert mine.shape == ref.shape
        for i in range(len(want.token_ids)):
            c = _cosine(mine[i], ref[i])
            assert c >= 0.999, (name, got.frame_id, i, c)
            if got.token_ids[i] != want.token_ids[i]:  # a near-tie parts the chains: later steps not comparable
                chosen = int(got.token_ids[i]) - self.cfg.action_token_offset
                assert _near_tie(ref[i], chosen, self.tie), (name, got.frame_id, i, got.token_ids, want.token_ids)
                self.ties += 1
                break
        self.checked += 1

    def close(self):
        self.engine.close()
        for t in self.twins.values():
            if hasattr(t, "close"):
                t.close()


P = len(INSTRUCTION.encode())


def _budget(frames):
    return -(-(P + frames * TPF) // TPF) * TPF


@pytest.mark.gpu
@pytest.mark.parametrize("fleet_gemv, fleet_gemm", [("rows", "tiles32"), ("mma", "tiles32"), ("mma", "tiled")])
@pytest.mark.parametrize("use_graphs", [True, False])
def test_a_batch_equals_each_robot_run_alone_by_numpy(torch_cuda, tmp_path, use_graphs, fleet_gemv, fleet_gemm):
    """Tiny geometry (head_dim 64): three robots with budgets of 3, 2 and 4 frames (FIFO eviction mid-run), full
    batches, subsets, a robot silent for cycles, a late joiner and a leaver; the decode steps' GEMMs on either
    few-row kernel (tuning.fleet_gemv), the prefill's on either many-row one (tuning.fleet_gemm)."""
    t = _Twins(torch_cuda, tmp_path, tiny_default_dict(), {"a": _budget(3), "b": _budget(2), "c": _budget(4),
                                                            "d": _budget(2)}, use_graphs=use_graphs,
               tuning={"fleet_gemv": fleet_gemv, "fleet_gemm": fleet_gemm})
    try:
        for name in "abc":
            t.add(name)
        evicted = {n: 0 for n in "abcd"}
        for names in ("abc", "abc", "b", "ac", "abc", "cab", "a", "abc"):
            for name, r in t.cycle(list(names)).items():
                evicted[name] += len(r.evicted_frames)
                assert r.chunk.shape == (1, t.cfg.action_dims) and r.prefill_ms > 0 and r.decode_ms > 0
            assert t.engine.last_batch_size == len(names)
        t.engine.remove_robot("b")
        t.add("d")  # takes b's region: must not see b's frames
        for names in ("dac", "d", "cd", "dca"):
            for name, r in t.cycle(list(names)).items():
                evicted[name] += len(r.evicted_frames)
        assert evicted["a"] >= 2 and evicted["b"] >= 2 and evicted["d"] >= 1, evicted
        assert t.checked == 28 and t.ties <= 3, (t.checked, t.ties)
        mem = t.engine.memory()
        assert mem["current_bytes"] > 0 and set(mem["per_robot_kv_bytes"]) == {"a", "c", "d"}
    finally:
        t.close()


@pytest.mark.gpu
def test_bad_members_are_rejected_alone(torch_cuda, tmp_path):
    from vla_edge_ros.engine.fleet_numpy import BatchRequest, UnknownRobotError
    t = _Twins(torch_cuda, tmp_path, tiny_default_dict(), {"a": _budget(3), "b": _budget(3)})
    try:
        for name in "ab":
            t.add(name)
        good = (0.05 * np.random.default_rng(1).standard_normal((TPF, t.cfg.hidden_size))).astype(np.float32)
        res = t.engine.run_batch({"a": BatchRequest(good, 1), "b": BatchRequest(good[:5], 1),
                                  "zz": BatchRequest(good, 1)})
        assert isinstance(res["b"], ValueError) and isinstance(res["zz"], UnknownRobotError)
        want = t.twins["a"].run_chunk(good, 1)
        t.check("a", res["a"], want)
        assert t.engine.robot("b").kv.frames == []  # the bad frame never reached b's cache
        t.fid = 10
        t.cycle(["a", "b"])
        assert t.checked == 3
    finally:
        t.close()


@pytest.mark.gpu
def test_a_pass_reports_its_host_split_next_to_the_gpu_figures(torch_cuda, tmp_path):
    """launch (staging + launches) and sync (the wait for the device) beside prefill / decode: the fleet loop's
    pass profile (core/pass_profile.py) copies them; an empty batch reports no split."""
    from vla_edge_ros.engine.fleet_numpy import BatchRequest
    t = _Twins(torch_cuda, tmp_path, tiny_default_dict(), {"a": _budget(3)})
    try:
        t.add("a")
        x = (0.05 * np.random.default_rng(2).standard_normal((TPF, t.cfg.hidden_size))).astype(np.float32)
        t.engine.run_batch({"a": BatchRequest(x, 1)})
        timing = t.engine.last_batch_timing
        assert timing["launch_ms"] > 0 and timing["sync_ms"] >= 0 and timing["decode_ms"] > 0
        t.engine.run_batch({"zz": BatchRequest(x, 2)})  # no member: nothing ran
        assert "launch_ms" not in t.engine.last_batch_timing
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fleet_gemv, fleet_gemm", [("rows", "tiles32"), ("mma", "tiles32"), ("mma", "tiled")])
def test_the_1_5b_geometry_batch_equals_each_single_cuda_engine(torch_cuda, tmp_path, fleet_gemv, fleet_gemm):
    """head_dim 128, 28 layers: three robots, eviction on; the single-robot CUDA engine is the reference. Random
    weights give flat logits: a token the two engines choose differently must be within 0.1 std of the best."""
    t = _Twins(torch_cuda, tmp_path, qwen2_5_1_5b_dict(), {n: _budget(3) for n in "abc"}, reference="cuda", seed=1,
               tie=0.1, tuning={"fleet_gemv": fleet_gemv, "fleet_gemm": fleet_gemm})
    try:
        for name in "abc":
            t.add(name)
        for names in ("abc", "abc", "ca", "abc", "b", "abc"):
            t.cycle(list(names))
        # every parting was a near-tie (checked above); the H200 run saw 4 in 15 chunks of flat random logits
        assert t.checked == 15 and t.ties <= 8, t.ties
    finally:
        t.close()


def test_the_fleet_bench_times_every_pair_of_gemm_variants():
    """gpu_fleet_bench's --fleet-gemm x --fleet-gemv: every pair, labelled as before when --fleet-gemm is absent;
    an unknown name refused by the parser."""
    import argparse

    from vla_edge_ros.bench import gpu_fleet_bench as bench
    from vla_edge_ros.engine.cuda.plan import Tuning
    ns = argparse.Namespace
    assert bench.variants(ns(fleet_gemv=None, fleet_gemm=None), Tuning()) == [
        ("mma", {"fleet_gemv": "mma", "fleet_gemm": "tiled"})]
    assert [v for v, _ in bench.variants(ns(fleet_gemv=["rows", "mma"], fleet_gemm=None), Tuning())] == ["rows", "mma"]
    got = bench.variants(ns(fleet_gemv=None, fleet_gemm=bench.fleet_gemm_variants("tiles32, tiled")), Tuning())
    assert got == [("mma+tiles32", {"fleet_gemv": "mma", "fleet_gemm": "tiles32"}),
                   ("mma+tiled", {"fleet_gemv": "mma", "fleet_gemm": "tiled"})]
    with pytest.raises(argparse.ArgumentTypeError, match="--fleet-gemm takes tiles32, tiled"):
        bench.fleet_gemm_variants("tiled,wide")
