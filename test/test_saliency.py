"""Saliency retention tracker: hand-computed cases and the exact fifo figures."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vla_edge_ros.core.kv import KVManager, SaliencyTracker


def test_hand_computed_retention():
    t = SaliencyTracker(ks=(1, 2, 5))
    for i in range(10):
        t.on_admit(i, salient=i in (0, 3))
        if i == 2:
            pass
        if i == 4:
            t.on_evict([3])  # stamped 5: frame 3 is gone from the state after admitting frame 5 on
    # frame 0 never evicted; frame 3 admitted at 3, evicted with stamp 5
    r = t.retention()
    assert r[1] == {"matured": 2, "retained": 2, "fraction": 1.0}  # 3+1=4 < 5: still there after frame 4
    assert r[2] == {"matured": 2, "retained": 1, "fraction": 0.5}  # 3+2=5: gone
    assert r[5] == {"matured": 2, "retained": 1, "fraction": 0.5}
    assert t.salient_seen == 2 and t.salient_retained_now == 1
    rep = t.report()
    assert rep["frames_seen"] == 10 and rep["retention"]["2"]["fraction"] == 0.5


@settings(max_examples=100, deadline=None)
@given(events=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 30), max_size=3)), max_size=80),
       ks=st.lists(st.integers(1, 20), min_size=1, max_size=4))
def test_incremental_tracker_matches_brute_force(events, ks):
    """Random admits (salient or not) and evictions vs. a recomputation from the full history."""
    t = SaliencyTracker(ks=tuple(ks))
    admitted_at: dict[int, int] = {}
    evicted_at: dict[int, int] = {}
    retained: set[int] = set()
    for i, (salient, evict) in enumerate(events):
        victims = [f for f in evict if f in retained]
        t.on_evict(victims)
        for f in victims:
            retained.discard(f)
            evicted_at.setdefault(f, i)
        t.on_admit(i, salient)
        retained.add(i)
        if salient:
            admitted_at[i] = i
    last = len(events) - 1
    for k, r in t.retention().items():
        matured = [f for f, i in admitted_at.items() if i + k <= last]
        kept = [f for f in matured if evicted_at.get(f, 10**9) > admitted_at[f] + k]
        assert (r["matured"], r["retained"]) == (len(matured), len(kept)), k


def test_immature_frames_not_counted():
    t = SaliencyTracker(ks=(4,))
    for i in range(6):
        t.on_admit(i, salient=i in (1, 3))
    # newest index 5: frame 1 matured (1+4=5), frame 3 not (3+4=7)
    assert t.retention()[4] == {"matured": 1, "retained": 1, "fraction": 1.0}
    t2 = SaliencyTracker(ks=(4,))
    t2.on_admit(0, salient=False)
    assert t2.retention()[4]["fraction"] is None


def test_evicting_non_salient_or_unknown_ids_is_ignored():
    t = SaliencyTracker(ks=(1,))
    t.on_admit(7, salient=True)
    t.on_evict([1, 2, 99])
    t.on_admit(8, salient=False)
    assert t.retention()[1]["retained"] == 1


def test_bad_ks_and_duplicates():
    for bad in ((), (0,), (-1, 2), (1.5,), (True,)):
        with pytest.raises(ValueError, match="positive integers"):
            SaliencyTracker(ks=bad)
    t = SaliencyTracker()
    t.on_admit(1, salient=True)
    with pytest.raises(ValueError, match="already tracked"):
        t.on_admit(1, salient=True)


@pytest.mark.parametrize("capacity", [3, 10])
def test_fifo_retention_is_exact(capacity):
    """Under fifo a frame lives exactly `capacity` admissions: retained at k iff k < capacity."""
    m = KVManager(capacity * 4, 4, 0, policy="fifo", saliency_ks=(1, 2, 9, 10, 11))
    rng = np.random.default_rng(0)
    for i in range(200):
        m.admit(i, rng.normal(size=5), salient=(i % 7 == 0))
    r = m.saliency.retention()
    for k, v in r.items():
        assert v["matured"] > 0
        assert v["fraction"] == (1.0 if k < capacity else 0.0), (k, v)


def test_budget_shrink_eviction_counts():
    m = KVManager(5, 1, 0, policy="fifo", saliency_ks=(1,))
    for i in range(5):
        m.admit(i, np.ones(2), salient=(i == 4))
    assert m.set_budget(1) == [0, 1, 2, 3]
    m.admit(5, np.ones(2))  # evicts 4 (the only frame): stamp 5 -> not retained 1 frame later
    assert m.saliency.retention()[1] == {"matured": 1, "retained": 0, "fraction": 0.0}
    assert m.stats()["saliency"]["salient_seen"] == 1


def _static_stream_with_events(n, dim, rng):
    """Static stretches (small noise) with isolated salient events: a frame unlike both neighbours."""
    vecs, salient = [], []
    base = rng.normal(size=dim)
    for i in range(n):
        if i % 40 == 20:
            vecs.append(rng.normal(size=dim))
            salient.append(True)
        else:
            if i % 200 == 0:
                base = rng.normal(size=dim)
            vecs.append(base + 0.01 * rng.normal(size=dim))
            salient.append(False)
    return vecs, salient


def test_semantic_retains_isolated_salient_frames_longer_than_fifo():
    rng = np.random.default_rng(5)
    vecs, salient = _static_stream_with_events(1200, 16, rng)
    frac = {}
    for policy in ("semantic", "fifo"):
        m = KVManager(32 * 4, 4, 0, policy=policy, saliency_ks=(64,))
        for i, (v, s) in enumerate(zip(vecs, salient)):
            m.admit(i, v, salient=s)
        frac[policy] = m.saliency.retention()[64]["fraction"]
    assert frac["fifo"] == 0.0  # 64 > 32 frames of capacity
    assert frac["semantic"] > 0.75, frac  # fifo keeps none of them


def test_scene_onsets_kept_by_default_semantic_and_newer_lost_by_untagged_older():
    """Scene changes: the first frame of each static stretch is salient. The default semantic policy (older of
    the pair, salient frames protected) and 'newer' keep it; plain 'older' without tag protection does not."""
    rng = np.random.default_rng(6)
    vecs, salient = [], []
    while len(vecs) < 1500:
        base = rng.normal(size=16)
        for j in range(int(rng.integers(40, 120))):
            vecs.append(base + 0.02 * rng.normal(size=16))
            salient.append(j == 0)
    frac = {}
    for name, evict, protect in (("older", "older", False), ("newer", "newer", False), ("default", "older", True)):
        m = KVManager(32, 1, 0, policy="semantic", semantic_evict=evict, protect_salient=protect,
                      saliency_ks=(100,))
        for i, (v, s) in enumerate(zip(vecs, salient)):
            m.admit(i, v, salient=s)
        frac[name] = m.saliency.retention()[100]["fraction"]
    assert frac["newer"] > 0.9 and frac["default"] > 0.9 and frac["older"] < 0.5, frac


def test_bench_generated_event_stream_semantic_beats_fifo():
    """The benchmark's generated stream through the real patch embedder (small: 300 frames, 12-frame cache)."""
    from vla_edge_ros.bench import kv_bench

    embed = kv_bench._embedder()
    rng = np.random.default_rng(11)
    pooled, salient = kv_bench.generated_stream(300, "event", embed, rng, stretch=(40, 120), event_every=(20, 40))
    assert 5 <= sum(salient) <= 16 and len(pooled) == 300 and pooled[0].shape == (256,)
    ks = (24,)
    sem = kv_bench.retention(pooled, salient, "semantic", "older", True, 12 * 8 + 8, 8, 8, 16, ks)[24]
    fifo = kv_bench.retention(pooled, salient, "fifo", "older", False, 12 * 8 + 8, 8, 8, 16, ks)[24]
    assert fifo["fraction"] == 0.0 and sem["fraction"] >= 0.4, (sem, fifo)  # fifo: k=24 > 12 frames
    cost = kv_bench.eviction_cost("semantic", 32, 300, 16, 4096, 18, 16)
    assert cost["frames_retained"] == 127 and cost["evictions"] == 300 - 127
