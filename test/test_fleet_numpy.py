"""FleetNumpyEngine (issue 24) against its oracle: each robot's own NumpyEngine run one chunk at a time.

A batch must equal the robots run one by one: the same greedy tokens, actions, evictions and occupancy per robot,
logits to float32 rounding (a GEMM row's sum order may depend on how many rows it has), for robots with different
frames, budgets and eviction policies, robots evicting mid-run (one by a live budget shrink), robots joining
late, leaving and coming back, batches of a subset, and members with bad vision tokens left out.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_chunk_horizon import cfg_for  # tiny geometry (hidden 64, 2 layers) with H / action_start chosen
from test_numpy_engine import random_weights  # non-degenerate random weights (tied head)
from vla_edge_ros.core.kv.manager import KVManager
from vla_edge_ros.engine.fleet_numpy import BatchRequest, FleetNumpyEngine, UnknownRobotError
from vla_edge_ros.engine.numpy_backend import NumpyEngine

INSTRUCTION = "pick up"  # 7 byte tokens
TPF = 32
P = len(INSTRUCTION.encode())
# per robot: (frames its budget holds, policy, window_frames); the oracle twin gets the same settings
KV_SETTINGS = {"a": (3, "fifo", 16), "b": (2, "semantic", 16), "c": (4, "sliding_window", 2), "d": (6, "fifo", 16)}


def budget_for(frames: int) -> int:
    return -(-(P + frames * TPF) // TPF) * TPF


def make_kv(cfg, name):
    frames, policy, window = KV_SETTINGS[name]
    return KVManager(budget_for(frames), TPF, P, policy=policy, window_frames=window, embed_dim=cfg.hidden_size)


class Fleet:
    """A FleetNumpyEngine and, per robot, its oracle twin (a NumpyEngine with its own weights and KV manager)."""

    def __init__(self, cfg, names, seed=3):
        self.cfg = cfg
        self.w = random_weights(cfg, seed=seed)
        self.engine = FleetNumpyEngine(cfg, self.w, lambda name: make_kv(cfg, name), instruction=INSTRUCTION)
        self.twins: dict[str, NumpyEngine] = {}
        self.rng = np.random.default_rng(seed + 100)
        self.frame_ids: dict[str, int] = {}
        self.checked = 0
        for name in names:
            self.add(name)

    def add(self, name):
        self.engine.add_robot(name)
        twin = NumpyEngine(self.cfg, self.w, make_kv(self.cfg, name), instruction=INSTRUCTION)
        twin.speculative = name in ("a", "c")  # speculative or not, greedy is greedy
        self.twins[name] = twin

    def frame(self, name):
        fid = self.frame_ids.get(name, 0)
        self.frame_ids[name] = fid + 1
        if name == "b" and fid % 2:  # repeated scenes: semantic eviction has a most-similar pair to choose
            tokens = self.last_b + 0.01 * self.rng.standard_normal(self.last_b.shape).astype(np.float32)
        else:
            tokens = self.rng.standard_normal((TPF, self.cfg.hidden_size)).astype(np.float32)
        if name == "b":
            self.last_b = tokens
        return BatchRequest(tokens, fid, salient=bool(fid % 3 == 0))

    def cycle(self, names):
        """One batch of ``names`` against each twin's run_chunk; returns the batch's results."""
        requests = {name: self.frame(name) for name in names}
        results = self.engine.run_batch(requests)
        assert list(results) == list(requests)
        for name, req in requests.items():
            self.check(name, results[name], self.twins[name].run_chunk(req.vision_tokens, req.frame_id, req.salient))
        return results

    def check(self, name, got, want):
        assert not isinstance(got, Exception), f"{name}: {got!r}"
        mine = self.engine.robot(name)
        assert got.frame_id == want.frame_id
        assert np.array_equal(got.token_ids, want.token_ids), f"{name} frame {got.frame_id}: tokens differ"
        np.testing.assert_allclose(mine.last_logits, self.twins[name].last_logits, rtol=1e-4, atol=1e-5,
                                   err_msg=f"{name} frame {got.frame_id}")
        assert got.evicted_frames == want.evicted_frames
        assert got.kv_occupancy_tokens == want.kv_occupancy_tokens
        assert got.salient == want.salient
        np.testing.assert_array_equal(got.chunk, want.chunk)
        np.testing.assert_array_equal(got.chunk_bins, want.chunk_bins)
        np.testing.assert_array_equal(got.action, want.action)
        assert mine.delta == self.twins[name].delta
        self.checked += 1


@pytest.mark.parametrize("horizon, start", [(1, "token"), (2, "token"), (2, "prefill")])
def test_a_batch_equals_each_robot_run_one_by_one(horizon, start):
    cfg = cfg_for(horizon, start)
    fleet = Fleet(cfg, ["a", "b", "c"])
    eng = fleet.engine
    assert eng.decode_steps == fleet.twins["a"].decode_steps
    forwards = []
    inner = eng._forward
    eng._forward = lambda *a, **k: forwards.append(1) or inner(*a, **k)  # count the stacked passes
    evicted = {name: 0 for name in "abc"}
    tokens_seen = []
    for _ in range(5):
        forwards.clear()
        results = fleet.cycle(["a", "b", "c"])
        assert len(forwards) == 1 + eng.decode_steps, "one prefill pass + S decode passes for the whole batch"
        assert eng.last_batch_size == 3
        timing = eng.last_batch_timing
        assert timing["prefill_ms"] > 0 and timing["decode_ms"] > 0
        for name, r in results.items():
            assert (r.prefill_ms, r.decode_ms) == (timing["prefill_ms"], timing["decode_ms"])
            assert r.chunk.shape == (horizon, cfg.action_dims)
            evicted[name] += len(r.evicted_frames)
            tokens_seen.append((name, tuple(r.token_ids)))
    assert fleet.checked == 15
    # a evicts 2 (budget 3), b evicts 3 (budget 2), c's window of 2 evicts 3: every robot evicted mid-run
    assert evicted == {"a": 2, "b": 3, "c": 3}
    assert len({t for _, t in tokens_seen}) > 3, "the robots' chunks are alike: a row mix-up could not show"


def test_subsets_late_joiners_and_a_live_budget_shrink_keep_each_robot_its_own_history():
    cfg = cfg_for(2, "token")
    fleet = Fleet(cfg, ["a", "d"])
    fleet.cycle(["a", "d"])
    fleet.cycle(["a"])  # d is silent: its cache must stay as it was
    fleet.add("c")  # joins late, with its own budget and policy
    fleet.cycle(["d", "c"])
    fleet.cycle(["d"])
    fleet.cycle(["a", "d", "c"])
    # a live budget shrink on one robot: frames evicted and relocated (take_moves) in its cache only
    got = fleet.engine.robot("d").apply_kv_changes({"kv_budget_tokens": budget_for(2)})
    want = fleet.twins["d"].apply_kv_changes({"kv_budget_tokens": budget_for(2)})
    assert got == want and len(got) == 2
    fleet.cycle(["c", "d", "a"])
    fleet.cycle(["d", "c"])
    assert fleet.checked == 14
    assert fleet.engine.robot("d").kv.occupancy_tokens == P + 2 * TPF  # the shrunken budget: two frames


def test_a_removed_robot_is_refused_by_name_and_comes_back_with_a_fresh_cache():
    cfg = cfg_for(1, "token")
    fleet = Fleet(cfg, ["a", "b", "c"])
    for _ in range(2):
        fleet.cycle(["a", "b", "c"])
    before = fleet.engine.memory()
    fleet.engine.remove_robot("b")
    assert fleet.engine.memory()["current_bytes"] == before["current_bytes"] - before["per_robot_kv_bytes"]["b"]
    req_a, req_b = fleet.frame("a"), fleet.frame("b")
    results = fleet.engine.run_batch({"a": req_a, "b": req_b})
    assert isinstance(results["b"], UnknownRobotError) and isinstance(results["b"], KeyError)
    assert "'b'" in str(results["b"]) and "add_robot" in str(results["b"])
    fleet.check("a", results["a"], fleet.twins["a"].run_chunk(req_a.vision_tokens, req_a.frame_id, req_a.salient))
    with pytest.raises(KeyError, match="not served"):
        fleet.engine.remove_robot("b")
    fleet.add("b")  # back: a fresh cache, its twin a fresh engine
    assert fleet.engine.robot("b").kv.occupancy_tokens == P
    with pytest.raises(ValueError, match="already served"):
        fleet.engine.add_robot("b")
    for _ in range(3):
        fleet.cycle(["a", "b", "c"])
    assert fleet.checked == 6 + 1 + 9


@pytest.mark.parametrize("bad", ["shape", "nan"])
def test_a_member_with_bad_tokens_is_rejected_and_the_others_match_the_oracle(bad):
    cfg = cfg_for(1, "token")
    fleet = Fleet(cfg, ["a", "b", "c"])
    fleet.cycle(["a", "b", "c"])
    occupancy = fleet.engine.robot("b").kv.occupancy_tokens
    reqs = {name: fleet.frame(name) for name in "abc"}
    tokens = reqs["b"].vision_tokens.copy()
    if bad == "shape":
        tokens = tokens[:-1]
    else:
        tokens[3, 5] = np.nan
    reqs["b"] = BatchRequest(tokens, reqs["b"].frame_id, False)
    results = fleet.engine.run_batch(reqs)
    assert isinstance(results["b"], ValueError)
    assert ("shape" if bad == "shape" else "NaN") in str(results["b"])
    assert fleet.engine.last_batch_size == 2
    assert fleet.engine.robot("b").kv.occupancy_tokens == occupancy  # its cache untouched
    for name in "ac":
        req = reqs[name]
        fleet.check(name, results[name], fleet.twins[name].run_chunk(req.vision_tokens, req.frame_id, req.salient))
    fleet.cycle(["a", "b", "c"])  # b's twin never saw the bad frame: b's next chunk must equal it
    assert fleet.checked == 3 + 2 + 3
    only_bad = fleet.engine.run_batch({"b": BatchRequest(tokens, 99, False)})
    assert isinstance(only_bad["b"], ValueError) and fleet.engine.last_batch_size == 0
    assert fleet.engine.last_batch_timing == {"prefill_ms": 0.0, "decode_ms": 0.0}


def test_the_weights_are_held_once_and_a_robot_adds_only_its_kv_bytes():
    cfg = cfg_for(1, "token")
    w = random_weights(cfg, seed=1)
    eng = FleetNumpyEngine(cfg, w, lambda: KVManager(budget_for(4), TPF, P, policy="fifo"),  # a factory of no args
                           instruction=INSTRUCTION)
    alone = NumpyEngine(cfg, w, KVManager(budget_for(4), TPF, P, policy="fifo"), instruction=INSTRUCTION)
    weight_bytes = alone.memory()["current_bytes"] - alone.cache_bytes()
    empty = eng.memory()
    assert empty["weight_bytes"] == weight_bytes and empty["current_bytes"] == weight_bytes
    sizes = [empty["current_bytes"]]
    for name in ("r0", "r1", "r2"):
        eng.add_robot(name)
        sizes.append(eng.memory()["current_bytes"])
        assert sizes[-1] - sizes[-2] == alone.cache_bytes(), f"adding {name} added more than its KV cache"
    mem = eng.memory()
    assert mem["kv_bytes"] == 3 * alone.cache_bytes() == sum(mem["per_robot_kv_bytes"].values())
    assert mem["current_bytes"] < 2 * alone.memory()["current_bytes"]  # three robots, not three models
    assert mem["device_weight_bytes"] == alone.memory()["device_weight_bytes"]
    r0, r1 = eng.robot("r0"), eng.robot("r1")
    assert r0.layers[0].wqkv_t is r1.layers[0].wqkv_t and r0.embed is r1.embed and r0.rope is r1.rope
    assert not np.shares_memory(r0.k_pre, r1.k_pre)
    tokens = eng.encode_frame(np.zeros((48, 64, 3), np.uint8))
    np.testing.assert_array_equal(tokens, alone.encode_frame(np.zeros((48, 64, 3), np.uint8)))
    results = eng.run_batch({"r0": BatchRequest(tokens, 0), "r2": BatchRequest(tokens, 0)})
    np.testing.assert_array_equal(results["r0"].token_ids, results["r2"].token_ids)  # same frame, same history
    assert eng.memory()["peak_bytes"] >= eng.memory()["current_bytes"]
    assert eng.action_names == tuple(cfg.action_names)


def test_a_failed_pass_raises_and_leaves_its_members_with_consistent_empty_caches():
    from types import SimpleNamespace

    cfg = cfg_for(1, "token")
    fleet = Fleet(cfg, ["a", "b", "c"])
    fleet.cycle(["a", "b", "c"])
    eng, inner, calls = fleet.engine, fleet.engine._forward, []

    def failing_forward(members, x, last_only):
        calls.append(last_only)
        if not last_only:  # the prefill went through, K/V are half written: the first decode pass fails
            raise MemoryError("no memory for the decode pass")
        return inner(members, x, last_only)

    eng._forward = failing_forward
    reqs = {"a": fleet.frame("a"), "b": SimpleNamespace(**fleet.frame("b")._asdict())}  # any object with the fields
    with pytest.raises(MemoryError, match="decode pass"):
        eng.run_batch(reqs)
    assert calls == [True, False]
    assert eng.cache_resets == {"a": 1, "b": 1} and not eng.needs_reset
    assert eng.robot("a").kv.occupancy_tokens == eng.robot("b").kv.occupancy_tokens == P  # frames dropped
    assert eng.robot("c").kv.occupancy_tokens == P + TPF  # not in the pass: untouched
    eng._forward = inner
    for name in "ab":  # their twins start over as they did
        fleet.twins[name].reset()
    fleet.cycle(["a", "b", "c"])
    assert fleet.checked == 6


def test_a_member_whose_admission_fails_gets_its_error_and_an_empty_cache_while_the_others_run():
    cfg = cfg_for(1, "token")
    fleet = Fleet(cfg, ["a", "b"])
    fleet.cycle(["a", "b"])
    kv_b = fleet.engine.robot("b").kv

    def refuse(*_args, **_kw):
        raise RuntimeError("slot table corrupted")

    kv_b.admit = refuse
    reqs = {"a": fleet.frame("a"), "b": fleet.frame("b")}
    results = fleet.engine.run_batch(reqs)
    assert isinstance(results["b"], RuntimeError) and fleet.engine.cache_resets == {"b": 1}
    assert kv_b.occupancy_tokens == P and fleet.engine.last_batch_size == 1
    fleet.check("a", results["a"], fleet.twins["a"].run_chunk(reqs["a"].vision_tokens, reqs["a"].frame_id,
                                                               reqs["a"].salient))
