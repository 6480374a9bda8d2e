"""AdmissionController (EMAs, decisions, live updates, probes) and CycleClock (fixed grid)."""
import math

import pytest

from vla_edge_ros.core.admission import AdmissionController, CycleClock, Decision


def test_unseeded_controller_admits_to_learn_the_cost():
    ac = AdmissionController()
    assert not ac.seeded
    assert ac.estimate_ms(8) == 0.0
    assert ac.decide(10.0, 8).admit
    assert not ac.decide(1.5, 8).admit  # 1.5 ms left minus the 2 ms margin: no budget at all


def test_seed_sets_estimate_without_touching_live_figures():
    ac = AdmissionController(deadline_ms=33.0, safety_margin_ms=2.0, ema_alpha=0.2)
    ac.seed(prefill_ms=10.0, decode_ms_per_token=1.5)
    assert ac.estimate_ms(8) == pytest.approx(22.0)
    assert ac.estimate_ms(0) == pytest.approx(10.0)
    s = ac.stats()
    assert s["admitted"] == s["refused"] == s["recorded"] == s["deadline_misses"] == 0
    assert s["chunk_ms"]["count"] == 0
    assert s["seeded_with"] == (10.0, 1.5)


def test_decision_budget_is_time_left_minus_margin():
    ac = AdmissionController(safety_margin_ms=2.0)
    ac.seed(10.0, 1.5)  # estimate 22 ms for 8 tokens
    d = ac.decide(24.0, 8)
    assert d == Decision(admit=True, estimate_ms=pytest.approx(22.0), budget_ms=pytest.approx(22.0))
    d = ac.decide(23.9, 8)
    assert not d.admit and d.budget_ms == pytest.approx(21.9)
    assert ac.admitted == 1 and ac.refused == 1
    assert ac.decide(100.0, 8).admit


def test_separate_emas_for_prefill_and_per_token_decode():
    ac = AdmissionController(ema_alpha=0.5)
    ac.seed(10.0, 1.0)
    # A chunk with 4 decode tokens taking 8 ms of decode: 2 ms per token.
    ac.record(prefill_ms=20.0, decode_ms_total=8.0, decode_tokens=4, missed_deadline=False)
    assert ac.prefill_ema_ms == pytest.approx(15.0)
    assert ac.decode_ema_ms_per_token == pytest.approx(1.5)
    assert ac.mean_estimate_ms(10) == pytest.approx(15.0 + 15.0)
    ac.record(prefill_ms=15.0, decode_ms_total=30.0, decode_tokens=10, missed_deadline=True)
    assert ac.prefill_ema_ms == pytest.approx(15.0)
    assert ac.decode_ema_ms_per_token == pytest.approx(2.25)
    s = ac.stats()
    assert s["recorded"] == 2 and s["deadline_misses"] == 1
    assert s["chunk_ms"]["count"] == 2
    assert s["chunk_ms"]["max"] == pytest.approx(45.0)


def test_first_record_without_seed_initialises_the_emas():
    ac = AdmissionController(ema_alpha=0.2)
    ac.record(12.0, 16.0, 8, False)
    assert ac.prefill_ema_ms == 12.0 and ac.decode_ema_ms_per_token == 2.0


@pytest.mark.parametrize("args", [(-1.0, 1.0, 8), (math.nan, 1.0, 8), (1.0, math.inf, 8), (1.0, 1.0, 0)])
def test_record_rejects_bad_samples(args):
    ac = AdmissionController()
    with pytest.raises(ValueError):
        ac.record(*args, missed_deadline=False)
    assert ac.recorded == 0


def test_seed_rejects_bad_values():
    ac = AdmissionController()
    with pytest.raises(ValueError):
        ac.seed(-1.0, 1.0)
    with pytest.raises(ValueError):
        ac.seed(1.0, math.nan)
    assert not ac.seeded


def test_live_update_validates_and_is_all_or_nothing():
    ac = AdmissionController()
    ac.update(deadline_ms=50.0, safety_margin_ms=5.0, ema_alpha=0.5)
    assert (ac.deadline_ms, ac.safety_margin_ms, ac.ema_alpha) == (50.0, 5.0, 0.5)
    ac.update(deadline_ms=20)  # ints are accepted for float parameters
    assert ac.deadline_ms == 20.0 and isinstance(ac.deadline_ms, float)
    for bad in ({"ema_alpha": 0.0}, {"ema_alpha": 1.5}, {"deadline_ms": "33"}, {"deadline_ms": True},
                {"safety_margin_ms": -1.0}, {"safety_margin_ms": 20.0},  # margin >= deadline
                {"deadline_ms": 4.0}, {"bogus": 1.0}, {"deadline_ms": 40.0, "ema_alpha": 0.0}):
        with pytest.raises(ValueError) as err:
            ac.update(**bad)
        assert str(err.value)
        assert (ac.deadline_ms, ac.safety_margin_ms, ac.ema_alpha) == (20.0, 5.0, 0.5), bad


def test_constructor_rejects_invalid_settings():
    with pytest.raises(ValueError, match="safety_margin_ms"):
        AdmissionController(deadline_ms=10.0, safety_margin_ms=10.0)
    with pytest.raises(ValueError, match="ema_alpha"):
        AdmissionController(ema_alpha=0.0)


def test_new_margin_applies_to_the_next_decision():
    ac = AdmissionController(safety_margin_ms=2.0)
    ac.seed(10.0, 1.0)  # 18 ms for 8 tokens
    assert ac.decide(20.0, 8).admit
    ac.update(safety_margin_ms=5.0)
    assert not ac.decide(20.0, 8).admit


def test_probe_after_consecutive_refusals_relearns_a_pessimistic_estimate():
    ac = AdmissionController(probe_after_refusals=3, ema_alpha=1.0)
    ac.seed(100.0, 10.0)  # far above any budget
    decisions = [ac.decide(33.0, 8) for _ in range(4)]
    assert [d.admit for d in decisions] == [False, False, False, True]
    assert decisions[-1].probe and not any(d.probe for d in decisions[:-1])
    assert ac.probes == 1 and ac.refused == 3 and ac.admitted == 1
    ac.record(5.0, 8.0, 8, False)  # the probe measures the real cost
    assert ac.decide(33.0, 8).admit
    assert not ac.decide(0.0, 8).admit  # never probes without any budget


def test_probing_can_be_disabled():
    ac = AdmissionController(probe_after_refusals=0)
    ac.seed(100.0, 10.0)
    assert not any(ac.decide(33.0, 8).admit for _ in range(200))


# ---- CycleClock -------------------------------------------------------------------------------------------
MS = 1_000_000


def test_cycle_clock_grid():
    clk = CycleClock(33.0, start_ns=1_000 * MS)
    assert clk.period_ms == 33.0
    assert clk.cycle_start(1_000 * MS) == 1_000 * MS
    assert clk.cycle_start(1_032 * MS) == 1_000 * MS
    assert clk.cycle_start(1_033 * MS) == 1_033 * MS
    assert clk.cycle_index(1_100 * MS) == 3
    assert clk.next_deadline(1_010 * MS) == 1_033 * MS
    assert clk.time_left_ms(1_010 * MS, 33.0) == pytest.approx(23.0)
    assert clk.time_left_ms(1_010 * MS, 5.0) == pytest.approx(-5.0)  # this cycle's deadline already passed
    assert clk.time_left_ms(1_040 * MS, 33.0) == pytest.approx(26.0)  # next cycle
    assert clk.cycle_index(990 * MS) == -1  # before the start: previous grid cell, no crash


def test_cycle_clock_period_change_restarts_the_grid():
    clk = CycleClock(10.0, start_ns=0)
    clk.set_period_ms(25.0, start_ns=7 * MS)
    assert clk.cycle_start(31 * MS) == 7 * MS
    assert clk.next_deadline(31 * MS) == 32 * MS
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            clk.set_period_ms(bad)
    assert clk.period_ms == 25.0


def test_refusals_relax_a_spiked_estimate_toward_the_recent_median():
    ac = AdmissionController(deadline_ms=33.0, safety_margin_ms=2.0, ema_alpha=0.2, probe_after_refusals=0,
                             outlier_factor=100.0)
    for _ in range(20):
        ac.record(12.0, 8.0, 8, missed_deadline=False)  # 20 ms chunks
    for _ in range(6):
        ac.record(40.0, 16.0, 8, missed_deadline=True)  # a slow spell lifts the estimate past the budget
    assert ac.estimate_ms(8) > 31.0
    refusals = 0
    while not ac.decide(33.0, 8).admit:
        refusals += 1
        assert refusals < 30, f"still refusing, estimate {ac.estimate_ms(8):.1f} ms"
    assert refusals >= 1 and ac.stats()["relaxations"] == refusals
    assert 20.0 <= ac.estimate_ms(8) <= 31.0


def test_lasting_cost_increase_keeps_refusing_despite_relaxation():
    ac = AdmissionController(deadline_ms=33.0, safety_margin_ms=2.0, ema_alpha=0.2, probe_after_refusals=0)
    for _ in range(40):
        ac.record(30.0, 16.0, 8, missed_deadline=True)  # 46 ms chunks: the median itself is over budget
    decisions = [ac.decide(33.0, 8).admit for _ in range(200)]
    assert not any(decisions)
    assert ac.estimate_ms(8) == pytest.approx(46.0)


def _admitted_miss_share(cost_quantile: float, seed: int = 1, cycles: int = 3000) -> tuple[float, int]:
    """Chunks whose typical cost creeps from 20 to 40 ms (a KV cache filling, a machine getting busier) with
    lognormal noise, offered every cycle with 33 ms left: the share of ADMITTED chunks that end past the
    31 ms budget, and how many were admitted. Admission cannot pick the cheap chunks of an i.i.d. noise, but it
    can stop admitting once the typical chunk no longer fits reliably."""
    import random
    rng = random.Random(seed)
    ac = AdmissionController(deadline_ms=33.0, safety_margin_ms=2.0, ema_alpha=0.2, probe_after_refusals=0,
                             cost_quantile=cost_quantile)
    ac.seed(12.0, 1.0)
    admitted = late = 0
    for i in range(cycles):
        if not ac.decide(33.0, 8).admit:
            continue
        total = (20.0 + 20.0 * i / cycles) * rng.lognormvariate(0.0, 0.08)
        admitted += 1
        late += total > 31.0
        ac.record(total * 0.6, total * 0.4, 8, total > 31.0)
    return late / max(1, admitted), admitted


def test_the_mean_alone_admits_chunks_that_miss_and_the_quantile_refuses_them():
    mean_share, mean_admitted = _admitted_miss_share(0.0)
    q_share, q_admitted = _admitted_miss_share(0.99)
    assert mean_share > 0.05  # the mean admits while half of the chunks near the budget are late
    assert q_share < 0.3 * mean_share
    assert q_admitted > 0.5 * mean_admitted  # still serving while the chunks fit, not refusing everything


def test_spread_is_the_quantile_of_overruns_over_the_mean_estimate():
    ac = AdmissionController(ema_alpha=0.2, cost_quantile=0.5, outlier_factor=100.0)
    ac.seed(10.0, 1.0)  # mean 18 ms for 8 tokens
    assert ac.spread_ms() == 0.0 and ac.estimate_ms(8) == pytest.approx(18.0)
    ac.record(14.0, 8.0, 8, False)  # 22 ms against a mean of 18: overrun 4 (fewer than 8 samples: max)
    assert ac.spread_ms() == pytest.approx(4.0)
    assert ac.estimate_ms(8) == pytest.approx(ac.mean_estimate_ms(8) + 4.0)
    ac.update(cost_quantile=0.0)
    assert ac.estimate_ms(8) == pytest.approx(ac.mean_estimate_ms(8))
    assert ac.stats()["overrun_samples"] == 1


def test_a_burst_of_slow_chunks_leaves_the_spread_after_as_many_refusals():
    ac = AdmissionController(deadline_ms=33.0, safety_margin_ms=2.0, ema_alpha=0.2, probe_after_refusals=0,
                             cost_quantile=0.99)
    for _ in range(100):
        ac.record(12.0, 8.0, 8, False)  # steady 20 ms chunks: spread ~0
    for _ in range(4):
        ac.record(24.0, 16.0, 8, True)  # a 4-chunk burst of 40 ms chunks
    assert not ac.decide(33.0, 8).admit
    refusals = 1
    while not ac.decide(33.0, 8).admit:
        refusals += 1
        assert refusals <= 12, f"still refusing after a 4-chunk burst: {ac.stats()}"
    assert ac.spread_ms() < 5.0


def test_one_slow_first_chunk_does_not_stop_a_sparse_stream():
    ac = AdmissionController(deadline_ms=33.0, safety_margin_ms=2.0, ema_alpha=0.2, probe_after_refusals=0)
    ac.seed(10.0, 1.0)  # warm-up: 18 ms
    ac.record(40.0, 8.0, 8, True)  # the first live chunk took 48 ms (a first frame of a new size, say)
    refusals = 0
    while not ac.decide(33.0, 8).admit:
        refusals += 1
        assert refusals <= 20, ac.stats()
    assert ac.stats()["overrun_samples"] == 0
