"""KVManager against a plain O(n^2) reference oracle written here, plus invariants and bad input."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vla_edge_ros.core.kv import KVManager, SlotTable
from vla_edge_ros.core.kv import policies as policies_mod

DIM = 4


# ---- reference oracle --------------------------------------------------------------------------------------
def ref_cos(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(a @ b / (na * nb))


class Oracle:
    """Retained frames as a plain list; every eviction rescans all adjacent pairs."""

    def __init__(self, capacity, policy, window, evict="older", protect=False):
        self.capacity, self.policy, self.window, self.evict = capacity, policy, window, evict
        self.protect = protect
        self.frames: list[tuple[int, np.ndarray]] = []
        self.salient: set[int] = set()

    def candidates(self) -> set[int]:
        """Frame ids the policy may name next: several only when similarities tie within 1e-9 (float
        rounding differs between this oracle and the manager; exact tie-breaking has its own test)."""
        if self.policy == "semantic" and len(self.frames) >= 2:
            sims = [ref_cos(self.frames[i][1], self.frames[i + 1][1]) for i in range(len(self.frames) - 1)]
            best = max(sims)
            pick = 0 if self.evict == "older" else 1
            out = set()
            for i, s in enumerate(sims):
                if s >= best - 1e-9:
                    victim, partner = self.frames[i + pick][0], self.frames[i + 1 - pick][0]
                    if self.protect and victim in self.salient and partner not in self.salient:
                        victim = partner
                    out.add(victim)
            return out
        return {self.frames[0][0]}

    def remove(self, fid):
        self.frames = [(f, v) for f, v in self.frames if f != fid]


def check_invariants(m: KVManager, oracle: Oracle):
    tpf, prefix, budget = m.tokens_per_frame, m.prefix_tokens, m.budget_tokens
    assert m.frames == [f for f, _ in oracle.frames]
    assert m.occupancy_tokens == prefix + len(m.frames) * tpf
    assert m.occupancy_tokens <= budget
    assert m.max_occupancy_tokens <= max(budget, m.max_occupancy_tokens)
    np.testing.assert_array_equal(m.prefix_slots, np.arange(prefix))
    all_slots = [m.slots_of(f) for f in m.frames]
    flat = np.concatenate(all_slots) if all_slots else np.zeros(0, np.int32)
    assert len(set(flat.tolist())) == flat.size, "two frames share a slot"
    assert flat.size == 0 or (flat.min() >= prefix and flat.max() < budget), "frame slot in prefix or over budget"
    for s in all_slots:
        assert s.dtype == np.int32 and s.shape == (tpf,)
    ctx = m.context_slots()
    assert ctx.dtype == np.int32
    np.testing.assert_array_equal(ctx, np.concatenate([np.arange(prefix, dtype=np.int32), flat]))
    assert ctx.size == m.occupancy_tokens <= budget
    st_ = m.stats()
    assert st_["occupancy_tokens"] == m.occupancy_tokens and st_["frames_retained"] == len(m.frames)


vec_strategy = st.lists(st.integers(-2, 2), min_size=DIM, max_size=DIM).map(lambda v: np.array(v, float))
op_strategy = st.one_of(
    st.tuples(st.just("admit"), vec_strategy, st.booleans()),
    st.tuples(st.just("admit"), vec_strategy, st.booleans()),
    st.tuples(st.just("admit"), vec_strategy, st.booleans()),
    st.tuples(st.just("policy"), st.sampled_from(policies_mod.POLICIES)),
    st.tuples(st.just("budget"), st.integers(1, 9)),
    st.tuples(st.just("window"), st.integers(1, 6)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tpf=st.sampled_from([1, 2, 4]), prefix=st.integers(0, 5), frames_cap=st.integers(1, 7),
       policy=st.sampled_from(policies_mod.POLICIES), window=st.integers(1, 6),
       evict=st.sampled_from(["older", "newer"]), protect=st.booleans(),
       ops=st.lists(op_strategy, min_size=1, max_size=60))
def test_random_streams_match_oracle(tpf, prefix, frames_cap, policy, window, evict, protect, ops):
    budget = -(-(prefix + frames_cap * tpf) // tpf) * tpf  # round up to a multiple of tpf
    m = KVManager(budget, tpf, prefix, policy=policy, window_frames=window, semantic_evict=evict,
                  protect_salient=protect)
    oracle = Oracle(m.capacity_frames, policy, window, evict, protect)
    check_invariants(m, oracle)
    next_id = 100
    for op in ops:
        if op[0] == "admit":
            _, vec, salient = op
            keep = oracle.capacity - 1
            if oracle.policy == "sliding_window":
                keep = min(keep, oracle.window - 1)
            n_expected = max(0, len(oracle.frames) - keep)
            occupancy_before = m.occupancy_tokens
            adm = m.admit(next_id, vec, salient=salient)
            assert len(adm.evicted) == n_expected, "must evict exactly enough"
            for victim in adm.evicted:
                assert victim in oracle.candidates(), f"{policy} evicted {victim}, oracle names {oracle.candidates()}"
                oracle.remove(victim)
            oracle.frames.append((next_id, vec))
            if salient:
                oracle.salient.add(next_id)
            assert m.occupancy_tokens == occupancy_before + (1 - len(adm.evicted)) * tpf
            np.testing.assert_array_equal(adm.slots, m.slots_of(next_id))
            np.testing.assert_array_equal(m.context_slots()[-tpf:], adm.slots)  # the new frame is last
            next_id += 1
        elif op[0] == "policy":
            m.set_policy(op[1])
            oracle.policy = op[1]
        elif op[0] == "window":
            m.set_window(op[1])
            oracle.window = op[1]
        else:
            new_budget = -(-(prefix + op[1] * tpf) // tpf) * tpf
            before = {f: m.slots_of(f).copy() for f in m.frames}
            new_cap = (new_budget - prefix) // tpf
            n_expected = max(0, len(oracle.frames) - new_cap)
            evicted = m.set_budget(new_budget)
            assert len(evicted) == n_expected
            for victim in evicted:
                assert victim in oracle.candidates()
                oracle.remove(victim)
            oracle.capacity = new_cap
            moves = m.take_moves()
            moved = {f: (old, new) for f, old, new in moves}
            for f in m.frames:
                if f in moved:
                    np.testing.assert_array_equal(moved[f][0], before[f])
                    np.testing.assert_array_equal(moved[f][1], m.slots_of(f))
                    assert moved[f][0].max() >= new_budget and moved[f][1].max() < new_budget
                    # a copy source never overlaps any retained frame's (new) slots
                    assert not set(moved[f][0].tolist()) & set(m.context_slots().tolist())
                else:
                    np.testing.assert_array_equal(before[f], m.slots_of(f)), "an unmoved frame changed slots"
        check_invariants(m, oracle)


def test_budget_never_exceeded_and_max_occupancy_reported():
    m = KVManager(128, 8, 5, policy="fifo")
    rng = np.random.default_rng(0)
    seen = []
    for i in range(50):
        adm = m.admit(i, rng.normal(size=16))
        seen.append(m.occupancy_tokens)
        assert m.occupancy_tokens <= 128
        if i >= m.capacity_frames:
            assert adm.evicted == [i - m.capacity_frames]
    assert m.max_occupancy_tokens == max(seen) == 5 + 15 * 8
    assert m.stats()["max_occupancy_tokens"] == 125 and m.stats()["evictions"] == 50 - 15


def test_freed_slots_reused_and_other_frames_not_moved():
    m = KVManager(4 * 4 + 4, 4, 4, policy="fifo")  # 4 prefix + 4 frames
    slots = {i: m.admit(i, np.ones(3) * (i + 1)).slots.copy() for i in range(4)}
    adm = m.admit(4, np.ones(3))
    assert adm.evicted == [0]
    np.testing.assert_array_equal(adm.slots, slots[0])  # the freed block is reused
    for i in (1, 2, 3):
        np.testing.assert_array_equal(m.slots_of(i), slots[i])


def test_semantic_keeps_salient_older_frame_of_the_pair_unless_disabled():
    a, b, c = np.array([1.0, 0, 0]), np.array([0, 1.0, 0]), np.array([0, 1.0, 0.01])
    for protect, expected in ((True, [3]), (False, [2])):
        m = KVManager(3 * 2, 2, 0, policy="semantic", protect_salient=protect)
        m.admit(1, a)
        m.admit(2, b, salient=True)  # scene-change onset: older frame of the most similar pair (2, 3)
        m.admit(3, c)
        assert m.admit(4, np.array([0, 0, 1.0])).evicted == expected
    m = KVManager(3 * 2, 2, 0, policy="semantic")
    m.admit(1, a)
    m.admit(2, b, salient=True)
    m.admit(3, c, salient=True)  # both salient: the plain rule (older goes)
    assert m.admit(4, np.array([0, 0, 1.0])).evicted == [2]
    with pytest.raises(ValueError, match="protect_salient"):
        KVManager(64, 8, 0, protect_salient="yes")


def test_semantic_evicts_older_of_most_similar_pair():
    m = KVManager(3 * 2, 2, 0, policy="semantic")  # 3 frames
    a, b, c = np.array([1.0, 0, 0]), np.array([0, 1.0, 0]), np.array([0, 1.0, 0.01])
    m.admit(1, a)
    m.admit(2, b)
    m.admit(3, c)
    assert m.admit(4, np.array([0, 0, 1.0])).evicted == [2]  # (2,3) most similar -> older (2) goes
    assert m.frames == [1, 3, 4]
    m2 = KVManager(3 * 2, 2, 0, policy="semantic", semantic_evict="newer")
    for i, v in enumerate((a, b, c), 1):
        m2.admit(i, v)
    assert m2.admit(4, np.array([0, 0, 1.0])).evicted == [3]


def test_huge_finite_vectors_keep_their_direction():
    m = KVManager(3, 1, 0, policy="semantic")
    m.admit(0, np.array([1e300, 0.0]))
    m.admit(1, np.array([0.0, 1e300]))
    m.admit(2, np.array([0.0, 2e300]))
    assert m.admit(3, np.array([1.0, 0.0])).evicted == [1]  # (1, 2) parallel despite the overflow risk


def test_semantic_ties_go_to_the_oldest_pair():
    m = KVManager(4, 1, 0, policy="semantic")
    for i in range(4):
        m.admit(i, np.array([1.0, 2.0]))  # all pairs identical
    assert [m.admit(i, np.array([1.0, 2.0])).evicted[0] for i in range(4, 7)] == [0, 1, 2]


def test_similarity_maintained_incrementally(monkeypatch):
    calls = []
    real = policies_mod.cosine_of_units
    monkeypatch.setattr(policies_mod, "cosine_of_units", lambda a, b: calls.append(1) or real(a, b))
    m = KVManager(64 * 4, 4, 0, policy="semantic")  # 64 frames
    rng = np.random.default_rng(1)
    for i in range(64):
        m.admit(i, rng.normal(size=8))
    calls.clear()
    for i in range(64, 264):
        n_before = len(calls)
        adm = m.admit(i, rng.normal(size=8))
        # one new pair from the eviction (unless the oldest went) + one for (newest, new frame)
        assert len(adm.evicted) == 1 and len(calls) - n_before <= 2
    assert len(m.frames) == 64


def test_heap_bounded_under_fifo_long_stream():
    m = KVManager(32 * 8, 8, 0, policy="fifo")
    rng = np.random.default_rng(2)
    for i in range(3000):
        m.admit(i, rng.normal(size=4))
        assert len(m._order._heap) <= 2 * len(m.frames) + 65
    assert m.context_slots().size == 256 and m.context_slots().max() < 256


def test_live_switch_fifo_to_semantic_uses_similarities_kept_under_fifo():
    m = KVManager(4 * 1, 1, 0, policy="fifo")  # 4 frames
    vs = [np.array([1.0, 0]), np.array([0.0, 1.0]), np.array([0.0, 1.0]), np.array([1.0, 1.0])]
    for i, v in enumerate(vs):
        m.admit(i, v)
    m.set_policy("semantic")
    assert m.stats()["policy"] == "semantic"
    assert m.admit(4, np.array([-1.0, 0])).evicted == [1]  # pair (1,2) identical -> older (1)
    m.set_policy("fifo")
    assert m.admit(5, np.array([1.0, 0])).evicted == [0]


def test_sliding_window_evicts_below_budget_and_window_applies_next_admit():
    m = KVManager(100, 1, 0, policy="sliding_window", window_frames=3)
    for i in range(10):
        m.admit(i, np.ones(2))
    assert m.frames == [7, 8, 9] and m.occupancy_tokens == 3
    m.set_window(1)
    assert m.frames == [7, 8, 9]  # applies at the next admitted frame
    assert m.admit(10, np.ones(2)).evicted == [7, 8, 9]
    assert m.frames == [10]
    m.set_window(5)
    for i in range(11, 20):
        m.admit(i, np.ones(2))
    assert m.frames == [15, 16, 17, 18, 19]


def test_budget_shrink_evicts_by_policy_and_relocates_into_new_range():
    m = KVManager(10 * 2 + 2, 2, 2, policy="fifo")  # 10 frames
    for i in range(10):
        m.admit(i, np.ones(3))
    assert m.set_budget(4 * 2 + 2) == [0, 1, 2, 3, 4, 5]
    assert m.frames == [6, 7, 8, 9] and m.occupancy_tokens == 10
    moves = m.take_moves()
    assert sorted(f for f, _, _ in moves) == [6, 7, 8, 9]
    assert m.take_moves() == []
    assert m.context_slots().max() < 10 and sorted(m.context_slots().tolist()) == list(range(10))
    assert m.set_budget(6 * 2 + 2) == []  # grow
    m.admit(10, np.ones(3))
    m.admit(11, np.ones(3))
    assert m.admit(12, np.ones(3)).evicted == [6]


def test_reset_drops_frames_keeps_prefix_and_settings():
    m = KVManager(6 * 2 + 3, 3, 3, policy="fifo")
    for i in range(6):
        m.admit(i, np.ones(2) * (i + 1), salient=i == 5)
    m.set_budget(3 * 3 + 3)
    assert m.reset() == [3, 4, 5]
    assert m.frames == [] and m.occupancy_tokens == 3 and m.take_moves() == []
    np.testing.assert_array_equal(m.context_slots(), [0, 1, 2])
    assert m.policy == "fifo" and m.budget_tokens == 12 and m.stats()["salient_retained"] == 0
    for i in range(10, 14):
        m.admit(i, np.ones(2))  # frame ids may be reused after a reset; slots come from the fresh free list
    assert m.frames == [11, 12, 13] and sorted(m.context_slots().tolist()) == list(range(12))


def test_budget_shrink_semantic():
    m = KVManager(4, 1, 0, policy="semantic")
    for i, v in enumerate([[1, 0], [0, 1], [0, 1], [1, 0.1]]):
        m.admit(i, np.array(v, float))
    assert m.set_budget(3) == [1]


@pytest.mark.parametrize("args,match", [
    ((40, 8, 33), "smaller than the pinned prefix"),
    ((8, 8, 1), "smaller than the pinned prefix"),
    ((100, 32, 0), "not a multiple of tokens_per_frame"),
    ((64, 0, 0), "tokens_per_frame"),
    ((64, 8, -1), "prefix_tokens"),
    ((64.0, 8, 0), "budget_tokens must be an integer"),
])
def test_bad_geometry(args, match):
    with pytest.raises(ValueError, match=match):
        KVManager(*args)
    with pytest.raises(ValueError, match=match):
        SlotTable(*args)


def test_bad_policy_and_window():
    with pytest.raises(ValueError, match="unknown eviction policy 'lru'"):
        KVManager(64, 8, 0, policy="lru")
    m = KVManager(64, 8, 0)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        m.set_policy("LRU")
    assert m.policy == "semantic"
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window_frames"):
            m.set_window(bad)
    with pytest.raises(ValueError, match="semantic_evict"):
        KVManager(64, 8, 0, semantic_evict="middle")


def test_bad_live_budget_leaves_state_unchanged():
    m = KVManager(64, 8, 4, policy="fifo")
    for i in range(7):
        m.admit(i, np.ones(2))
    before = (m.frames, m.context_slots().copy(), m.budget_tokens)
    for bad, match in ((60, "not a multiple"), (8, "smaller than the pinned prefix"), (0, "smaller")):
        with pytest.raises(ValueError, match=match):
            m.set_budget(bad)
    assert (m.frames, m.budget_tokens) == (before[0], before[2])
    np.testing.assert_array_equal(m.context_slots(), before[1])


def test_bad_pooled_and_duplicate_ids():
    m = KVManager(64, 8, 0, embed_dim=4)
    with pytest.raises(ValueError, match="expected 4"):
        m.admit(0, np.ones(5))
    with pytest.raises(ValueError, match="1-D"):
        m.admit(0, np.ones((2, 2)))
    with pytest.raises(ValueError, match="NaN"):
        m.admit(0, np.array([1.0, np.nan, 0, 0]))
    with pytest.raises(ValueError, match="NaN or infinite"):
        m.admit(0, np.array([1.0, np.inf, 0, 0]))
    with pytest.raises(ValueError, match="not numeric"):
        m.admit(0, ["a", "b", "c", "d"])
    with pytest.raises(ValueError, match="frame id must be an integer"):
        m.admit("x", np.ones(4))
    assert m.frames == [] and m.occupancy_tokens == 0
    m.admit(0, np.ones(4))
    with pytest.raises(ValueError, match="duplicate frame id 0"):
        m.admit(0, np.ones(4))
    m2 = KVManager(64, 8, 0)  # dimension fixed by the first vector
    m2.admit(np.int64(1), np.ones(3))
    with pytest.raises(ValueError, match="expected 3"):
        m2.admit(2, np.ones(4))
    assert m2.frames == [1]


def test_prefix_slots_pinned_and_positions_bounded_over_long_stream():
    m = KVManager(4096, 32, 17, policy="semantic")
    rng = np.random.default_rng(3)
    for i in range(2000):
        adm = m.admit(i, rng.normal(size=8))
        assert adm.slots.min() >= 17 and adm.slots.max() < 4096
    ctx = m.context_slots()
    np.testing.assert_array_equal(ctx[:17], np.arange(17))
    assert ctx.size <= 4096 and len(set(ctx.tolist())) == ctx.size
    assert m.stats()["eviction_time_us"]["samples"] > 0


def test_live_changes_from_another_thread_keep_the_table_consistent():
    import threading

    m = KVManager(64 * 2, 2, 2, policy="semantic")
    stop = threading.Event()
    errors = []

    def tweak():
        rng = np.random.default_rng(9)
        while not stop.is_set():
            try:
                m.set_budget(int(rng.integers(2, 64)) * 2)
                m.set_policy(str(rng.choice(["semantic", "fifo", "sliding_window"])))
                m.set_window(int(rng.integers(1, 20)))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

    th = threading.Thread(target=tweak)
    th.start()
    rng = np.random.default_rng(8)
    try:
        for i in range(3000):
            m.admit(i, rng.normal(size=4))
            ctx = m.context_slots()
            assert len(set(ctx.tolist())) == ctx.size
    finally:
        stop.set()
        th.join()
    assert not errors
    ctx = m.context_slots()
    assert ctx.size == m.occupancy_tokens <= m.budget_tokens and ctx.max() < m.budget_tokens


def test_slots_of_frames_matches_per_frame_slots_in_order():
    """The vectorised context build equals concatenating each frame's own slots, in the order asked for (not the
    block order), also after frees have left holes and prefix_tokens is not a multiple of tokens_per_frame."""
    t = SlotTable(21 + 11 + 32 * 6, 32, 21)
    for f in range(6):
        t.allocate(f)
    t.free(1)
    t.free(4)
    t.allocate(7)  # takes block 1 (lowest free)
    order = [5, 0, 7, 3, 2]
    got = t.slots_of_frames(order)
    want = np.concatenate([t.slots(f) for f in order])
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    assert t.slots_of_frames([]).size == 0
    with pytest.raises(KeyError):
        t.slots_of_frames([1])  # freed
