"""FleetScheduler (EDF batch admission for N robots on one engine) and BatchCostModel (cost per batch size)."""
import json
import math

import pytest

from vla_edge_ros.core.fleet_scheduler import (BAD_DEADLINE, CAPACITY, DEADLINE, UNKNOWN, BatchCostModel,
                                               FleetScheduler)

MS = 1_000_000
NOW = 1_000 * MS
STEPS = 8


def model(costs: dict, quantile: float = 0.0) -> BatchCostModel:
    """A cost model with one record per batch size: ``costs[M] = (prefill_ms, decode_ms_total)``."""
    m = BatchCostModel(cost_quantile=quantile)
    for size, (prefill, decode) in costs.items():
        m.record(size, prefill, decode, STEPS)
    return m


def fleet(names, costs, max_batch=4, margin_ms=2.0, starvation_limit=3, **kw) -> FleetScheduler:
    fs = FleetScheduler(max_batch, safety_margin_ms=margin_ms, starvation_limit=starvation_limit,
                        cost_model=model(costs), decode_steps=STEPS, **kw)
    for n in names:
        fs.join(n)
    return fs


# 10 ms alone, +2 ms per extra robot (weights read once per pass)
LINEAR = {m: (4.0 + 2.0 * m, 4.0) for m in range(1, 9)}


def test_edf_admits_the_earliest_deadlines_whatever_the_order_given():
    fs = fleet("abcd", LINEAR, max_batch=2)
    ready = {"a": NOW + 90 * MS, "b": NOW + 30 * MS, "c": NOW + 60 * MS, "d": NOW + 40 * MS}
    plan = fs.plan(NOW, ready)
    assert plan.batch == ("b", "d")
    assert plan.refused == {"a": CAPACITY, "c": CAPACITY}
    assert plan.estimate_ms == pytest.approx(fs.cost_model.estimate_ms(2, STEPS))
    assert set(plan.batch) | set(plan.refused) == set(ready)  # every ready robot has exactly one outcome


def test_robot_that_cannot_finish_alone_is_refused_alone_and_does_not_shrink_the_batch():
    fs = fleet("abc", LINEAR, max_batch=2)
    # "tight" has the earliest deadline but 8 ms minus the 2 ms margin is less than the 10 ms pass alone
    fs.join("tight")
    plan = fs.plan(NOW, {"tight": NOW + 8 * MS, "b": NOW + 30 * MS, "c": NOW + 31 * MS})
    assert plan.refused == {"tight": DEADLINE}
    assert plan.batch == ("b", "c")
    assert plan.counters["tight"]["refused_deadline"] == 1 and plan.counters["tight"]["refused_capacity"] == 0
    assert plan.counters["b"]["admitted"] == plan.counters["c"]["admitted"] == 1


def test_deadline_in_the_past_or_inside_the_margin_is_refused_at_once():
    fs = fleet("abc", {}, max_batch=4)  # no cost known yet: the estimate is 0, only time decides
    plan = fs.plan(NOW, {"a": NOW - 1 * MS, "b": NOW + 1 * MS, "c": NOW + 3 * MS})
    assert plan.refused == {"a": DEADLINE, "b": DEADLINE}  # b has 1 ms left, less than the 2 ms margin
    assert plan.batch == ("c",)


def test_capacity_by_max_batch_and_by_the_cost_of_one_more_member():
    fs = fleet("abcd", LINEAR, max_batch=2)
    plan = fs.plan(NOW, {n: NOW + (50 + i) * MS for i, n in enumerate("abcd")})
    assert plan.batch == ("a", "b") and plan.refused == {"c": CAPACITY, "d": CAPACITY}

    # max_batch 4 but a pass of 3 costs 14 ms > a's 15 - 2 = 13 ms: c would make a late
    fs = fleet("abcd", LINEAR, max_batch=4)
    plan = fs.plan(NOW, {"a": NOW + 15 * MS, "b": NOW + 40 * MS, "c": NOW + 41 * MS, "d": NOW + 42 * MS})
    assert plan.batch == ("a", "b")
    assert plan.refused == {"c": CAPACITY, "d": CAPACITY}
    assert fs.cost_model.estimate_ms(2, STEPS) <= 13.0 < fs.cost_model.estimate_ms(3, STEPS)


def run_latest_loses(starvation_limit, cycles):
    """Three robots, room for two; "late" always has the latest deadline."""
    fs = fleet(["a", "b", "late"], LINEAR, max_batch=2, starvation_limit=starvation_limit)
    plans = [fs.plan(NOW + k * 33 * MS, {"a": NOW + k * 33 * MS + 30 * MS, "b": NOW + k * 33 * MS + 31 * MS,
                                         "late": NOW + k * 33 * MS + 32 * MS}) for k in range(cycles)]
    return fs, plans


def test_without_promotion_the_latest_deadline_starves():
    fs, plans = run_latest_loses(starvation_limit=0, cycles=20)
    assert all("late" not in p.batch for p in plans)
    s = fs.stats()["robots"]["late"]
    assert s["refused_capacity"] == 20 and s["longest_refusal_streak"] == 20 and s["starvation_promotions"] == 0


def test_starved_robot_is_promoted_after_the_limit_and_counted():
    fs, plans = run_latest_loses(starvation_limit=3, cycles=8)
    assert [("late" in p.batch) for p in plans] == [False, False, False, True] * 2
    assert plans[3].batch[0] == "late" and plans[3].promoted == ("late",)
    assert plans[3].refused == {"b": CAPACITY}  # the promoted robot displaces the latest of the others
    s = fs.stats()
    assert s["robots"]["late"]["starvation_promotions"] == 2
    assert s["robots"]["late"]["longest_refusal_streak"] == 3
    assert s["fleet"]["starvation_promotions"] == 2
    assert max(r["longest_refusal_streak"] for r in s["robots"].values()) <= 3  # nobody starves


def test_promotion_never_makes_a_member_late():
    # a pass of 2 (12 ms) misses a's 13 - 2 = 11 ms: a runs alone, late is refused for capacity ...
    fs = fleet(["a", "late"], LINEAR, max_batch=2, starvation_limit=1)
    first = fs.plan(NOW, {"a": NOW + 13 * MS, "late": NOW + 40 * MS})
    assert first.batch == ("a",) and first.refused == {"late": CAPACITY}
    # ... then late is promoted and goes first, and a is refused rather than made late
    plan = fs.plan(NOW, {"a": NOW + 13 * MS, "late": NOW + 40 * MS})
    assert plan.batch == ("late",) and plan.refused == {"a": CAPACITY}


def drive(fs, cycles, names, silent=lambda k: ()):
    out = []
    for k in range(cycles):
        now = NOW + k * 33 * MS
        ready = {n: now + 30 * MS for n in names if n in fs.robots and n not in silent(k)}
        out.append(fs.plan(now, ready))
    return out


def test_equal_deadlines_share_the_passes_round_robin():
    """The fleet loop gives all robots of a cycle one deadline: the batch must rotate, not go to the first names
    (promotion alone left r1 in every pass and r4..r8 at what the starvation limit gave them)."""
    names = [f"r{i}" for i in range(1, 9)]
    fs = fleet(names, LINEAR, max_batch=3, margin_ms=2.0, starvation_limit=3)
    admitted = dict.fromkeys(names, 0)
    for _ in range(80):
        plan = fs.plan(NOW, dict.fromkeys(names, NOW + 30 * MS))
        assert len(plan.batch) == 3  # 14 ms for three: the batch is full, five refused for capacity
        for n in plan.batch:
            admitted[n] += 1
    assert max(admitted.values()) - min(admitted.values()) <= 1, admitted  # 240 passes-members over 8: 30 each
    assert fs.stats()["fleet"]["starvation_promotions"] == 0  # nobody waited as long as the limit


def test_join_leave_and_silence_do_not_disturb_the_others():
    base = fleet("ab", LINEAR, max_batch=4)
    base_plans = drive(base, 12, "ab")

    fs = fleet("ab", LINEAR, max_batch=4)
    plans = drive(fs, 4, "ab")
    fs.join("c")  # joins mid-run, with zero counters
    assert fs.stats()["robots"]["c"] == {k: 0 for k in fs.stats()["robots"]["a"]}
    plans += drive(fs, 4, "abc", silent=lambda k: "c" if k % 2 else "")  # c goes silent every other cycle
    c_before_silence = fs.stats()["robots"]["c"]
    plans += drive(fs, 2, "ab")  # c silent: its counters do not move
    assert fs.stats()["robots"]["c"] == c_before_silence and c_before_silence["admitted"] == 2
    fs.leave("c")
    for k in range(2):  # frames from c after it left are unknown: counted, not planned
        now = NOW + k * 33 * MS
        plans.append(fs.plan(now, {n: now + 30 * MS for n in "abc"}))
        assert plans[-1].refused == {"c": UNKNOWN}
    assert "c" not in fs.robots and len(plans) == len(base_plans)
    assert all(set(p.batch) >= {"a", "b"} for p in plans)
    assert [tuple(n for n in p.batch if n != "c") for p in plans] == [p.batch for p in base_plans]
    for n in "ab":
        assert fs.stats()["robots"][n] == base.stats()["robots"][n]
    assert fs.stats()["fleet"]["unknown_robot"] == 2


def test_leaving_removes_state_and_rejoining_starts_from_zero():
    fs = fleet("ab", LINEAR, max_batch=1)
    for k in range(3):
        fs.plan(NOW, {"a": NOW + 20 * MS, "b": NOW + 30 * MS})
    before = fs.stats()
    assert before["robots"]["b"]["refused_capacity"] == 3
    fs.leave("b")
    after = fs.stats()
    assert "b" not in after["robots"] and after["robots"]["a"] == before["robots"]["a"]
    assert after["fleet"]["refused_capacity"] == 3 and after["fleet"]["left"] == 1  # totals keep its history
    fs.join("b")
    assert fs.stats()["robots"]["b"]["refused_capacity"] == 0


def test_cost_model_interpolates_between_and_extrapolates_conservatively_above():
    m = model({1: (10.0, 8.0), 4: (16.0, 16.0)})  # mean 18 ms alone, 32 ms for four
    e1, e4 = m.estimate_ms(1, STEPS), m.estimate_ms(4, STEPS)
    assert (e1, e4) == (pytest.approx(18.0), pytest.approx(32.0))
    # M=2, a third of the way: prefill 12, decode 4/3 per step
    assert m.estimate_ms(2, STEPS) == pytest.approx(12.0 + STEPS * 4.0 / 3.0)
    assert e1 < m.estimate_ms(2, STEPS) < m.estimate_ms(3, STEPS) < e4
    # M=8 beyond the largest measured size: four's cost scaled by 8 / 4, never below four's estimate
    assert m.estimate_ms(8, STEPS) == pytest.approx(2 * e4) and m.estimate_ms(5, STEPS) >= e4
    # below the smallest measured size: that size's cost
    only4 = model({4: (16.0, 16.0)})
    assert only4.estimate_ms(1, STEPS) == pytest.approx(32.0)
    assert BatchCostModel().estimate_ms(3, STEPS) == 0.0  # nothing measured: admit to learn


def test_cost_model_estimate_never_falls_with_batch_size():
    m = model({2: (20.0, 8.0), 3: (12.0, 8.0)})  # a noisy size 3 looks faster than size 2
    assert m.mean_ms(3, STEPS) == pytest.approx(20.0)
    assert m.estimate_ms(3, STEPS) == pytest.approx(m.estimate_ms(2, STEPS)) == pytest.approx(28.0)


def test_cost_model_emas_spread_and_clipping():
    m = BatchCostModel(ema_alpha=0.5, cost_quantile=1.0)
    m.record(2, 10.0, 8.0, STEPS)
    m.record(2, 14.0, 16.0, STEPS)  # overran the 18 ms mean by 12 ms
    s = m.stats()["by_batch_size"]["2"]
    assert s["prefill_ema_ms"] == pytest.approx(12.0) and s["decode_ema_ms_per_step"] == pytest.approx(1.5)
    assert m.mean_ms(2, STEPS) == pytest.approx(24.0)
    assert m.estimate_ms(2, STEPS) == pytest.approx(24.0 + 12.0)
    m.record(2, 1000.0, 8.0, STEPS)  # one hung pass: clipped at 3x the prefill EMA
    assert m.stats()["by_batch_size"]["2"]["prefill_ema_ms"] == pytest.approx(12.0 + 0.5 * (36.0 - 12.0))
    assert m.stats()["clipped_samples"] == 1
    assert BatchCostModel(cost_quantile=0.0).estimate_ms(2, STEPS) == 0.0


def test_cost_model_keeps_the_host_part_apart_and_admits_against_the_sum():
    m = BatchCostModel(ema_alpha=0.5, cost_quantile=1.0)
    m.record(1, 3.0, 16.0, STEPS, host_ms=5.0)  # engine 19 ms (GPU), host 5 ms: 24 ms from decision to results
    s = m.stats()["by_batch_size"]["1"]
    assert (s["prefill_ema_ms"], s["decode_ema_ms_per_step"], s["host_ema_ms"]) == (3.0, 2.0, 5.0)
    assert m.mean_ms(1, STEPS) == pytest.approx(24.0)
    m.record(1, 3.0, 16.0, STEPS, host_ms=15.0)  # the same pass, 10 ms more waiting on the host
    s = m.stats()["by_batch_size"]["1"]
    assert s["prefill_ema_ms"] == 3.0 and s["decode_ema_ms_per_step"] == 2.0  # the pass did not get slower
    assert s["host_ema_ms"] == pytest.approx(10.0) and s["spread_ms"] == pytest.approx(10.0)
    assert m.estimate_ms(1, STEPS) == pytest.approx(29.0 + 10.0)
    m.record(1, 3.0, 16.0, STEPS, host_ms=1000.0)  # one hung host: the EMA clipped at 3x, as the others
    assert m.stats()["by_batch_size"]["1"]["host_ema_ms"] == pytest.approx(10.0 + 0.5 * (30.0 - 10.0))
    # the scheduler admits against the sum: 19 ms of engine fits a 30 ms deadline, 19 + host does not
    fs = FleetScheduler(2, safety_margin_ms=2.0, cost_model=model({1: (3.0, 16.0)}, quantile=1.0),
                        decode_steps=STEPS)
    fs.join("a")
    assert fs.plan(NOW, {"a": NOW + 30 * MS}).batch == ("a",)
    fs.record(1, 3.0, 16.0, STEPS, host_ms=12.0)  # the admitted pass took 31 ms from the decision
    assert fs.plan(NOW, {"a": NOW + 30 * MS}).refused == {"a": DEADLINE}
    with pytest.raises(ValueError):
        fs.record(1, 3.0, 16.0, STEPS, host_ms=-1.0)


def relaxing_fleet(samples_host_ms, quantile=0.95) -> FleetScheduler:
    """One robot, probes off, a cost model fed one-robot passes of 20 ms on the engine plus the given host ms."""
    m = BatchCostModel(cost_quantile=quantile)
    for h in samples_host_ms:
        m.record(1, 4.0, 16.0, STEPS, host_ms=h)
    fs = FleetScheduler(2, safety_margin_ms=2.0, cost_model=m, decode_steps=STEPS, probe_after_cycles=0)
    fs.join("a")
    return fs


def test_a_burst_of_slow_passes_expires_while_refused_a_lasting_slowness_does_not():
    """A refused pass is never measured, so without relaxation a burst of three slow passes would keep a high
    quantile's spread (and every robot refused) until 256 newer samples came, which only probes give."""
    fs = relaxing_fleet([0.0] * 20 + [20.0] * 3)  # 20 ms passes, then three with 20 ms more on the host
    assert fs.cost_model.estimate_ms(1, STEPS) > 28.0  # the spread holds the burst: nothing fits 30 - 2 ms
    plans = [fs.plan(NOW, {"a": NOW + 30 * MS}) for _ in range(6)]
    first = next(i for i, p in enumerate(plans) if p.batch)
    assert first <= 3 and plans[0].refused == {"a": DEADLINE} and not any(p.probe for p in plans)
    assert fs.cost_model.stats()["relaxations"] == first
    assert fs.cost_model.estimate_ms(1, STEPS) <= 28.0

    lasting = relaxing_fleet([20.0] * 20)  # every pass 40 ms: no burst to expire, the median is the cost
    assert all(not lasting.plan(NOW, {"a": NOW + 30 * MS}).batch for _ in range(100))
    assert lasting.cost_model.mean_ms(1, STEPS) == pytest.approx(40.0)


def test_probe_relearns_a_cost_that_got_too_high():
    fs = fleet("ab", {1: (96.0, 4.0)}, max_batch=2, probe_after_cycles=3)  # 100 ms alone, 30 ms deadlines
    plans = [fs.plan(NOW, {"a": NOW + 31 * MS, "b": NOW + 30 * MS}) for _ in range(4)]
    assert [p.batch for p in plans] == [(), (), ("b",), ()]
    assert plans[2].probe and plans[2].refused == {"a": DEADLINE}
    assert fs.stats()["fleet"]["probes"] == 1 and fs.stats()["robots"]["b"]["probes"] == 1
    # no probe for deadlines already past: a probe there is a sure miss
    fs = fleet("a", {1: (96.0, 4.0)}, probe_after_cycles=1)
    assert fs.plan(NOW, {"a": NOW + 1 * MS}).batch == ()


def test_unknown_robot_and_bad_deadline_are_counted_and_do_not_stop_the_others():
    fs = fleet("ab", LINEAR)
    plan = fs.plan(NOW, {"ghost": NOW + 30 * MS, 7: NOW + 30 * MS, "a": float("nan"), "b": NOW + 30 * MS})
    assert plan.batch == ("b",)
    assert plan.refused == {"ghost": UNKNOWN, 7: UNKNOWN, "a": BAD_DEADLINE}
    s = fs.stats()
    assert s["fleet"]["unknown_robot"] == 2 and s["fleet"]["unknown_recent"] == ["'ghost'", "7"]
    assert s["robots"]["a"]["bad_deadline"] == 1 and s["robots"]["a"]["refusal_streak"] == 1
    assert fs.plan(NOW, {"a": "soon"}).refused == {"a": BAD_DEADLINE}
    json.dumps(s)  # JSON-able for /diagnostics


@pytest.mark.parametrize("args", [(1, math.nan, 1.0, 1), (1, 1.0, -1.0, 1), (0, 1.0, 1.0, 1),
                                  (1, 1.0, 1.0, 0), (True, 1.0, 1.0, 1), (1, math.inf, 1.0, 1)])
def test_record_rejects_bad_costs(args):
    fs = fleet("a", {})
    with pytest.raises(ValueError):
        fs.record(*args)
    assert fs.cost_model.stats()["by_batch_size"] == {}  # nothing half-recorded


def test_bad_configuration_and_membership_are_clear_errors():
    for kwargs in ({"max_batch": 0}, {"max_batch": 2, "safety_margin_ms": -1.0},
                   {"max_batch": 2, "starvation_limit": -1}, {"max_batch": 2, "decode_steps": 0},
                   {"max_batch": 2.5}):
        with pytest.raises(ValueError):
            FleetScheduler(**kwargs)
    for kwargs in ({"ema_alpha": 0.0}, {"cost_quantile": 1.5}, {"outlier_factor": 0.5}):
        with pytest.raises(ValueError):
            BatchCostModel(**kwargs)
    fs = fleet("a", {})
    with pytest.raises(ValueError, match="already joined"):
        fs.join("a")
    with pytest.raises(ValueError, match="has not joined"):
        fs.leave("zz")
    with pytest.raises(ValueError):
        fs.join("")
    with pytest.raises(ValueError):
        fs.plan(math.nan, {"a": NOW})
    with pytest.raises(ValueError):
        fs.plan(NOW, [("a", NOW)])
    assert fs.robots == ("a",) and fs.stats()["fleet"]["cycles"] == 0
