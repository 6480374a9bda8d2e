"""FleetLoop: N robots, one batched fake engine; cycles driven by run_cycle on a fake clock (one threaded smoke).
The fakes and the harness: fleet_loop_harness.py."""
import json
import threading
import time
from dataclasses import dataclass

import pytest

from fleet_loop_harness import DECODE_MS, MS, STEPS, add, cycle, frame, harness, robot
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.fleet_loop import BAD_FRAME, DELIVERED, ERROR, LATE, FleetLoop
from vla_edge_ros.core.metrics import CumulativeHistogram, window_percentiles
from vla_edge_ros.core.image_convert import ImageRejected
from vla_edge_ros.core.fleet_scheduler import CAPACITY, DEADLINE, FleetScheduler


def test_three_fresh_frames_run_as_one_batch_and_each_robot_gets_its_own_result():
    h = harness()
    out = cycle(h, {"a": 11, "b": 22, "c": 33})
    assert h.engine.batches == [{"a": 11, "b": 22, "c": 33}]
    assert sorted((n, r.robot, r.frame_id) for n, r in h.got) == [("a", "a", 11), ("b", "b", 22), ("c", "c", 33)]
    assert all(r.frame_stamp_ns == r.frame_id * 33 * MS and r.salient for _, r in h.got)
    assert out.outcomes == {"a": DELIVERED, "b": DELIVERED, "c": DELIVERED} and out.missed == ()
    s = h.loop.stats()
    assert s["batch_sizes"] == {"3": 1} and s["batches"] == 1 and s["cycles"] == 1
    for n in "abc":
        assert {k: s["robots"][n][k] for k in ("frames_run", "admitted", "actions_delivered", "deadline_misses")} \
            == {"frames_run": 1, "admitted": 1, "actions_delivered": 1, "deadline_misses": 0}
        assert s["robots"][n]["latency_ms"]["p50"] == pytest.approx(8.0)  # 5 + 3 robots
    # the scheduler learned the pass as the engine timed it; nothing else took time on the fake clock
    cost = s["scheduler"]["cost"]["by_batch_size"]["3"]
    assert cost["prefill_ema_ms"] == pytest.approx(8.0 - DECODE_MS)
    assert cost["decode_ema_ms_per_step"] == pytest.approx(DECODE_MS / STEPS)
    assert cost["host_ema_ms"] == 0.0 and s["last_batch_timing"]["host_ms"] == 0.0
    json.dumps(s)  # JSON-able for /diagnostics


def test_silent_camera_is_not_in_the_batch_and_the_others_run_every_cycle():
    h = harness()
    for k in range(1, 4):
        out = cycle(h, {"a": k, "b": 100 + k})
        assert h.engine.batches[-1] == {"a": k, "b": 100 + k}
        assert sorted(n for n, _ in h.got) == ["a", "b"] and "c" not in out.outcomes
    c = robot(h, "c")
    assert c["frames_run"] == 0 and c["admitted"] == 0 and c[f"refused_{DEADLINE}"] == c[f"refused_{CAPACITY}"] == 0
    assert robot(h, "a")["actions_delivered"] == 3 == robot(h, "b")["actions_delivered"]


def test_remove_mid_pass_keeps_that_cycle_and_totals_then_a_new_robot_joins():
    h = harness()
    cycle(h, {"a": 1, "b": 2, "c": 3})
    h.engine.during_pass = lambda: h.loop.remove_robot("b")  # a discovery callback lands mid-pass
    cycle(h, {"a": 4, "b": 5, "c": 6})
    h.engine.during_pass = None
    assert sorted(n for n, _ in h.got) == ["a", "b", "c"]  # the cycle in progress delivered b's result
    assert "b" in h.engine.robots and h.loop.stats()["pending_membership"] == ["remove b"]

    cycle(h, {"a": 7, "b": 8, "c": 9})  # removal applied before this cycle: b's frame is nobody's now
    assert h.engine.batches[-1] == {"a": 7, "c": 9}
    assert "b" not in h.engine.robots and "b" not in h.sched.robots
    s = h.loop.stats()
    assert set(s["robots"]) == {"a", "c"} and s["robots_removed"] == 1
    assert s["totals"]["actions_delivered"] == 3 + 3 + 2  # b's two actions are still in the totals
    with pytest.raises(ValueError, match="not served"):
        h.loop.remove_robot("b")

    add(h, "d")
    cycle(h, {"a": 10, "c": 11, "d": 12})
    assert h.engine.batches[-1] == {"a": 10, "c": 11, "d": 12}
    assert dict((n, r.frame_id) for n, r in h.got)["d"] == 12
    assert robot(h, "d")["actions_delivered"] == 1 and "d" in h.sched.robots


def test_membership_errors_are_refused_clearly_or_counted():
    h = harness(names=("a",))
    with pytest.raises(ValueError, match="already served"):
        h.loop.add_robot("a", DoubleBuffer())
    with pytest.raises(ValueError, match="non-empty string"):
        h.loop.add_robot("__warmup0", DoubleBuffer())
    with pytest.raises(ValueError, match="DoubleBuffer"):
        h.loop.add_robot("z", object())
    h.engine.fail_add.add("full")
    add(h, "full")  # the engine cannot hold its KV cache: refused when applied, counted, reported
    cycle(h, {"a": 1})
    assert "full" not in h.loop.robots and h.loop.stats()["robot_add_failures"] == 1
    assert any(n == "full" and k == "robot_add_failed" for n, k, _ in h.events)
    h.engine.fail_add.clear()
    add(h, "full")  # may be added again once there is room
    cycle(h, {"a": 2, "full": 3})
    assert h.engine.batches[-1] == {"a": 2, "full": 3}
    with pytest.raises(ValueError, match="decode_steps"):
        FleetLoop(h.engine, FleetScheduler(2, decode_steps=STEPS + 1), 33.0, 30.0, on_action=print)


def test_bad_frame_is_rejected_and_counted_for_that_robot_while_the_others_run():
    h = harness()
    out = cycle(h, {"a": 1, "b": frame(2, shape=(8, 8)), "c": 3})
    assert out.outcomes["b"] == BAD_FRAME and out.ran == ("a", "c")
    assert h.engine.batches == [{"a": 1, "c": 3}]
    assert sorted(n for n, _ in h.got) == ["a", "c"]
    b = robot(h, "b")
    assert b["bad_frames"] == 1 and b["frames_run"] == 0 and b["errors"] == 0 and "(H, W, 3)" in b["last_error"]
    assert [(n, d["frame_id"]) for n, k, d in h.events if k == "bad_frame"] == [("b", 2)]
    assert h.loop.stats()["batch_sizes"] == {"2": 1}  # the pass the scheduler learns from is the one that ran


def test_exception_for_one_robot_is_that_robots_error_only():
    h = harness()
    h.engine.fail_robot["b"] = ValueError("vision tokens contain NaN")
    out = cycle(h, {"a": 1, "b": 2, "c": 3})
    assert out.outcomes == {"a": DELIVERED, "b": ERROR, "c": DELIVERED}
    assert sorted(n for n, _ in h.got) == ["a", "c"]
    assert robot(h, "b")["errors"] == 1 and robot(h, "a")["errors"] == robot(h, "c")["errors"] == 0
    errs = [(n, d["whole_batch"]) for n, k, d in h.events if k == "chunk_error"]
    assert errs == [("b", False)] and h.engine.resets == 0
    assert h.loop.stats()["batch_failures"] == 0


def test_result_for_the_wrong_frame_is_never_delivered():
    h = harness(names=("a", "b"))
    h.engine.swap = True
    out = cycle(h, {"a": 1, "b": 2})
    assert out.outcomes == {"a": ERROR, "b": ERROR} and h.got == []
    assert "expected 1" in robot(h, "a")["last_error"]


def test_whole_batch_failure_is_counted_for_every_member_and_the_next_cycle_runs():
    h = harness()
    h.engine.raise_next = RuntimeError("device lost")
    out = cycle(h, {"a": 1, "b": 2, "c": 3})
    assert out.outcomes == {"a": ERROR, "b": ERROR, "c": ERROR} and h.got == []
    s = h.loop.stats()
    assert s["batch_failures"] == 1 and s["totals"]["errors"] == 3 and s["engine_resets"] == 0
    assert all(s["robots"][n]["errors"] == 1 for n in "abc")
    assert s["scheduler"]["cost"]["by_batch_size"] == {}  # a failed pass is no cost sample
    assert [n for n, k, d in h.events if k == "chunk_error" and d["whole_batch"]] == ["a", "b", "c"]
    cycle(h, {"a": 4, "b": 5, "c": 6})
    assert sorted(r.frame_id for _, r in h.got) == [4, 5, 6]


def test_missing_batch_timing_is_counted_and_the_whole_pass_is_learned_as_host():
    h = harness(names=("a", "b"))
    h.engine.bad_timing = True
    cycle(h, {"a": 1, "b": 2})
    s = h.loop.stats()
    assert s["timing_invalid"] == 1 and len(h.got) == 2
    cost = s["scheduler"]["cost"]["by_batch_size"]["2"]
    assert cost["prefill_ema_ms"] == 0.0 and cost["decode_ema_ms_per_step"] == 0.0
    assert cost["host_ema_ms"] == pytest.approx(7.0)  # nothing lost: the estimate still covers the 7 ms
    assert h.sched.cost_model.mean_ms(2, STEPS) == pytest.approx(7.0)
    assert any(k == "batch_timing_invalid" for _, k, _ in h.events)


def test_host_time_from_the_decision_to_the_results_is_learned_apart_from_the_pass_and_admitted_against():
    """What the engine times (its pass) is learned as prefill / decode; everything else between the scheduler's
    decision and the results (here: encoding on the host, a join applied before the plan) as host. The next
    decision adds both: an estimate of the engine's pass alone would admit a batch that then misses."""
    h = harness(names=("a", "b"), deadline_ms=30.0)
    h.engine.encode_ms = 3.0  # 2 robots: 6 ms of host work before the pass
    cycle(h, {"a": 1, "b": 2})  # engine: 5 + 2 = 7 ms, 4 of them decode
    cost = h.loop.stats()["scheduler"]["cost"]["by_batch_size"]["2"]
    assert cost["prefill_ema_ms"] == pytest.approx(3.0) and cost["decode_ema_ms_per_step"] == pytest.approx(0.5)
    assert cost["host_ema_ms"] == pytest.approx(6.0)
    assert h.sched.cost_model.mean_ms(2, STEPS) == pytest.approx(13.0)
    s = h.loop.stats()
    assert s["robots"]["a"]["latency_ms"]["p50"] == pytest.approx(13.0)  # conversion + encode + pass
    assert s["host_ms"]["p50"] == pytest.approx(6.0) and s["last_batch_timing"]["host_ms"] == pytest.approx(6.0)

    # time spent after the decision's clock reading but before the pass starts is host time too
    h.engine.encode_ms = 0.0
    engine_add = h.engine.add_robot

    def slow_add(name):
        h.clock.advance_ms(4.0)  # e.g. allocating a joining robot's KV cache
        engine_add(name)

    h.engine.add_robot = slow_add
    add(h, "c")
    cycle(h, {"a": 3, "b": 4})
    # sample: engine 7 (3 + 4), host 4 -> host EMA 6 + 0.2 * (4 - 6)
    cost = h.loop.stats()["scheduler"]["cost"]["by_batch_size"]["2"]
    assert cost["host_ema_ms"] == pytest.approx(5.6) and cost["prefill_ema_ms"] == pytest.approx(3.0)

    # what the next decision adds up: the engine's pass and the host's part (a pass of 7 ms would fit anything)
    assert h.sched.cost_model.estimate_ms(2, STEPS) >= h.sched.cost_model.mean_ms(2, STEPS) == pytest.approx(12.6)


def test_each_pass_is_profiled_by_stage_with_the_engines_own_split():
    """What the host tail waited for (core/pass_profile.py): the pass's stages on the loop's clock, the engine's
    GPU figures and its launch / sync split copied; a failed pass is not profiled (it is a batch failure)."""
    h = harness(names=("a", "b"))
    h.engine.encode_ms = 3.0
    cycle(h, {"a": 1, "b": 2})
    prof = h.loop.stats()["pass_profile"]
    assert prof["passes"] == 1
    rec = prof["slowest"][0]
    assert rec["size"] == 2 and rec["host_ms"] == pytest.approx(6.0)
    assert rec["stages"]["encode"]["wall_ms"] == pytest.approx(6.0)  # two frames of 3 ms on the fake clock
    assert rec["stages"]["engine"]["wall_ms"] == pytest.approx(7.0)
    assert rec["stages"]["wake"]["wall_ms"] == 0.0 and rec["engine"]["decode_ms"] == DECODE_MS
    assert set(rec["stages"]) == {"wake", "plan", "encode", "engine", "deliver"}
    h.engine.raise_next = RuntimeError("device lost")
    cycle(h, {"a": 3, "b": 4})
    assert h.loop.stats()["pass_profile"]["passes"] == 1


@dataclass
class DeferredFrame:
    """A frame whose camera left the conversion to the taker (ros/fleet_node.py's JPEG / YUV frames)."""
    raw: object
    stamp_ns: int
    frame_id: int
    clock: object = None
    convert_ms: float = 0.0
    converted: int = 0

    def convert(self):
        self.converted += 1
        if self.clock is not None:
            self.clock.advance_ms(self.convert_ms)
        if isinstance(self.raw, Exception):
            raise self.raw
        return self.raw


def test_deferred_frames_are_converted_only_when_admitted_and_a_bad_one_is_that_robots_bad_frame():
    h = harness(max_batch=1)
    frames = {n: DeferredFrame(frame(i).image, i * 33 * MS, i, h.clock, 2.5) for i, n in enumerate("abc", 1)}
    out = cycle(h, frames)
    assert out.ran == ("a",) and [f.converted for f in frames.values()] == [1, 0, 0]  # b, c refused: not decoded
    assert h.got[0][1].frame_id == 1 and h.got[0][1].frame_stamp_ns == 33 * MS
    assert h.loop.stats()["scheduler"]["cost"]["by_batch_size"]["1"]["host_ema_ms"] == pytest.approx(2.5)

    # b's turn (equal deadlines rotate: a was just served): its new frame is malformed
    bad = DeferredFrame(ImageRejected("bad_compressed", "not a decodable JPEG/PNG"), 0, 9)
    out = cycle(h, {"b": bad})
    assert out.outcomes["b"] == BAD_FRAME and bad.converted == 1 and out.ran == ()
    b = robot(h, "b")
    assert b["bad_frames"] == 1 and b["errors"] == 0 and "bad_compressed" in b["last_error"]
    assert [(n, d["frame_id"]) for n, k, d in h.events if k == "bad_frame"] == [("b", 9)]


def test_window_percentiles_from_two_cumulative_histogram_snapshots():
    hist = CumulativeHistogram()
    for ms in [100.0] * 50:  # before the window
        hist.add(ms)
    start = hist.snapshot()
    for ms in [1.0] * 98 + [10.0, 20.0]:
        hist.add(ms)
    w = window_percentiles(hist.snapshot(), start)
    assert w["count"] == 100
    assert 1.0 <= w["p50"] < 1.0 * 1.022 and 10.0 <= w["p99"] < 10.0 * 1.022 and 20.0 <= w["max"] < 20.5
    whole = window_percentiles(hist.snapshot())
    assert whole["count"] == 150 and whole["p99"] >= 100.0  # the run, not the window
    assert window_percentiles(start, start) == {"count": 0, "p50": None, "p99": None, "max": None}
    assert CumulativeHistogram.bucket(0.0) == 0 and window_percentiles({"0": 1})["p50"] == CumulativeHistogram.MIN_MS
    json.dumps(hist.snapshot())


def test_stats_carry_cumulative_histograms_of_the_figures_they_summarise():
    h = harness(names=("a",))
    for k in range(1, 4):
        h.engine.extra_ms = float(k)
        cycle(h, {"a": k})
    s = h.loop.stats()
    lat = window_percentiles(s["robots"]["a"]["latency_hist"])
    assert lat["count"] == 3 and 9.0 <= lat["max"] < 9.0 * 1.022  # 5 + 1 robot + 3 ms
    assert window_percentiles(s["pass_hist"])["count"] == 3 and window_percentiles(s["host_hist"])["count"] == 3


def test_engine_reset_when_a_failed_pass_left_it_bad():
    h = harness()
    cycle(h, {"a": 1, "b": 2})
    h.engine.raise_next, h.engine.poison = RuntimeError("cuMemAlloc failed"), True
    cycle(h, {"a": 3, "b": 4})
    assert h.engine.resets == 1 and h.loop.stats()["engine_resets"] == 1
    assert any(k == "engine_reset" for _, k, _ in h.events)
    cycle(h, {"a": 5, "b": 6})
    assert all(r.salient for _, r in h.got)  # the caches were dropped: every robot's next frame is a new scene


def test_late_batch_is_a_miss_for_every_member_then_refused_for_deadline():
    h = harness()
    h.engine.extra_ms = 30.0  # 5 + 3 + 30 = 38 ms against a 30 ms deadline: 8 ms late, under one period
    out = cycle(h, {"a": 1, "b": 2, "c": 3})
    assert out.missed == ("a", "b", "c")
    assert len(h.got) == 3  # as InferenceLoop: a miss within late_discard_ms is still delivered (and counted)
    for n in "abc":
        r = robot(h, n)
        assert r["deadline_misses"] == 1 and r["late_discarded"] == 0 and r["actions_delivered"] == 1
    assert [n for n, k, _ in h.events if k == "deadline_miss"] == ["a", "b", "c"]

    # the scheduler learned 38 ms for 3 (and, below the smallest measured size, 38 ms for 1): none fits alone
    out = cycle(h, {"a": 4, "b": 5, "c": 6})
    assert out.ran == () and h.got == []
    assert all(robot(h, n)[f"refused_{DEADLINE}"] == 1 and robot(h, n)[f"refused_{CAPACITY}"] == 0
               for n in "abc")
    assert h.loop.stats()["totals"][f"refused_{DEADLINE}"] == 3


def test_far_too_late_result_is_discarded_not_delivered():
    h = harness(names=("a", "b"))
    h.engine.extra_ms = 80.0  # 87 ms: 57 ms past the deadline, more than one period
    out = cycle(h, {"a": 1, "b": 2})
    assert out.outcomes == {"a": LATE, "b": LATE} and h.got == []
    assert all(robot(h, n)["late_discarded"] == 1 and robot(h, n)["deadline_misses"] == 1 for n in "ab")
    assert h.loop.stats()["cycle_overruns"] == 1


def test_refused_frame_is_retried_once_when_no_newer_frame_came():
    h = harness(max_batch=2)
    out = cycle(h, {"a": 1, "b": 2, "c": 3})  # room for two: c (latest name at equal deadlines) waits
    assert out.outcomes["c"] == f"refused:{CAPACITY}"
    out = cycle(h)  # no new frame anywhere: c's refused frame runs now
    assert h.engine.batches[-1] == {"c": 3} and robot(h, "c")["retried"] == 1
    assert robot(h, "c")[f"refused_{CAPACITY}"] == 1 and robot(h, "a")[f"refused_{CAPACITY}"] == 0
    out = cycle(h)
    assert out.ran == () and len(h.engine.batches) == 2  # nothing new, nothing retried twice


def test_frames_written_while_paused_are_dropped_after_resume():
    h = harness(names=("a", "b"))
    h.loop.pause()
    out = cycle(h, {"a": 1, "b": 2})
    assert out.plan is None and h.engine.batches == []
    h.loop.resume()
    out = cycle(h)
    assert out.ran == () and all(robot(h, n)["dropped_while_paused"] == 1 for n in "ab")
    cycle(h, {"a": 3, "b": 4})
    assert h.engine.batches == [{"a": 3, "b": 4}]
    assert h.loop.stats()["cycles_paused"] == 1


def test_warmup_measures_every_batch_size():
    h = harness(names=("a",), max_batch=4)
    figures = h.loop.warmup(3)
    sizes = [len(b) for b in h.engine.batches]
    assert sizes == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    # a KV cache refuses a frame id it already holds: every warm-up robot sees each id once, across the sizes
    for name in {k for b in h.engine.batches for k in b}:
        ids = [b[name] for b in h.engine.batches if name in b]
        assert len(ids) == len(set(ids)), (name, ids)
    cost = h.sched.cost_model
    by_size = h.loop.stats()["scheduler"]["cost"]["by_batch_size"]
    for m in range(1, 5):
        assert by_size[str(m)]["samples"] == 2  # the first pass of each size is left out
        assert cost.estimate_ms(m, STEPS) == pytest.approx(5.0 + m)
        assert figures["by_batch_size"][str(m)]["pass_ms"] == pytest.approx([5.0 + m] * 3)
    assert h.engine.robots == set()  # the synthetic robots are gone ("a" joins at the first cycle)
    cycle(h, {"a": 1})
    assert h.engine.robots == {"a"} and h.engine.batches[-1] == {"a": 1}
    # with a measured size 4, a fleet of 4 with a 12 ms budget fits in one pass (extrapolating from size 1
    # alone would estimate 6 * 4 = 24 ms and refuse)
    assert cost.estimate_ms(4, STEPS) <= 12.0 < 6.0 * 4


def test_warmup_is_refused_while_running():
    h = harness(names=("a",), clock=time.monotonic_ns, period_ms=20.0)
    h.loop.start()
    try:
        with pytest.raises(RuntimeError, match="before start"):
            h.loop.warmup(1)
    finally:
        assert h.loop.stop()


def test_threaded_smoke_two_robots_served_until_stop():
    h = harness(names=("a", "b"), clock=time.monotonic_ns, period_ms=20.0, deadline_ms=18.0)
    stop = threading.Event()

    def camera():
        fid = 0
        while not stop.is_set():
            fid += 1
            for n in "ab":
                h.buffers[n].write(frame(fid))
            time.sleep(0.01)

    writer = threading.Thread(target=camera, daemon=True)
    h.loop.start()
    writer.start()
    time.sleep(0.6)
    stop.set()
    writer.join(1.0)
    assert h.loop.stop(2.0) and not h.loop.running
    s = h.loop.stats()
    assert s["loop_errors"] == 0 and s["cycles"] >= 5
    for n in "ab":
        assert s["robots"][n]["actions_delivered"] >= 3
    assert s["batch_sizes"].get("2", 0) >= 1  # both cameras fresh in the same cycle: one pass for both
    assert s["thread_cpu_s"] > 0.0  # the loop thread's own CPU time, updated every cycle
    kinds = [k for _, k, _ in h.events]
    assert kinds[0] == "started" and kinds[-1] == "stopped"


def test_housekeeping_waits_for_a_gap_between_passes_and_never_returns_inside_one():
    """wait_between_passes: the stats / diagnostics threads get their turn while the loop sleeps between passes,
    with at least min_gap_ms to the next cycle boundary; never while a pass runs (real clock, a 12 ms pass in a
    25 ms cycle)."""
    h = harness(names=("a",), clock=time.monotonic_ns, period_ms=25.0, deadline_ms=24.0)
    h.engine.base_ms, h.engine.per_robot_ms = 11.0, 1.0
    passes: list[tuple[int, int]] = []
    run_batch = h.engine.run_batch

    def timed(requests):
        t0 = time.monotonic_ns()
        try:
            return run_batch(requests)
        finally:
            passes.append((t0, time.monotonic_ns()))

    h.engine.run_batch = timed
    assert h.loop.wait_between_passes(0.0)  # not running: nothing to wait for
    stop = threading.Event()

    def camera():
        fid = 0
        while not stop.is_set():
            fid += 1
            h.buffers["a"].write(frame(fid))
            time.sleep(0.005)

    writer = threading.Thread(target=camera, daemon=True)
    writer.start()
    h.loop.start()
    returns, timeouts = [], 0
    try:
        time.sleep(0.1)
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            if h.loop.wait_between_passes(0.2, min_gap_ms=6.0):
                now = time.monotonic_ns()
                returns.append((now, (h.loop.clock.next_deadline(now) - now) / 1e6))
            else:
                timeouts += 1
            time.sleep(0.002)
    finally:
        stop.set()
        writer.join(1.0)
        assert h.loop.stop(2.0)
    assert timeouts == 0 and len(passes) >= 20 and len(returns) >= 20
    # a return is never inside a pass (the engine's call is most of the pass) and leaves most of its gap
    inside = [t for t, _ in returns for a, b in passes if a <= t <= b]
    assert not inside, f"{len(inside)} of {len(returns)} returns fell inside a pass"
    assert min(gap for _, gap in returns) >= 5.0  # 6 ms asked, less the time to take the reading
