"""bench/demo.py's report, without ROS: the per-second line and the summary say what the robot got and why
(kind shares, hold reasons, refusals, the admission estimate vs budget), and warn when the model does not fit."""
import argparse
import math

from vla_edge_ros.bench import demo


def _stats(fresh=900, repeat=60, hold=40, estimate=24.0, budget=31.0, p99=1.2):
    return {
        "backend": "numpy", "duration_s": 21.4,
        "ticks": {"fresh": fresh, "repeat": repeat, "hold": hold},
        "chunks": {"admitted": 950, "refused": 30, "deadline_misses": 0},
        "latency_ms": {"p50": 18.0, "p95": 22.0, "p99": 26.0},
        "timer_period_error_ms": {"p50": 0.3, "p99": p99},
        "frames": {"received": 1200, "dropped": 300, "rejected": 0},
        "kv": {"policy": "semantic", "budget_tokens": 1024, "max_occupancy_tokens": 1010},
        "memory": {"peak_rss_mb": 170.0, "peak_vram_mb": 0.0},
        "action": {"arbiter": {"hold_reasons": {"no_action_yet": hold}}, "missed_ticks": 0},
        "inference": {"loop": {"admission": {"refused_for_cost": 25, "refused_no_time": 5, "spread_ms": 6.0,
                                             "cost_quantile": 0.99},
                               "deadline_fit": {"estimate_ms": estimate, "budget_ms": budget, "fits": True}}},
    }


ARGS = argparse.Namespace(policy="semantic", backend="auto", checkpoint="", param=[])


def test_result_keeps_runtime_and_window_durations_apart_and_counts_refusal_reasons():
    res = demo.build_result(_stats(), {"fresh": 580, "repeat": 10, "hold": 10}, ARGS, window_s=20.0,
                            ticks_seen={"reasons": {"hold: no_action_yet": 10}, "lost": 2})
    assert res["duration_s"] == 20.0 and res["runtime_active_s"] == 21.4
    assert math.isclose(res["fresh_fraction"], 0.9)
    assert res["chunks"]["refused_for_cost"] == 25 and res["chunks"]["refused_no_time"] == 5
    assert res["hold_reasons"] == {"no_action_yet": 40}
    assert res["subscriber_lost_ticks"] == 2
    assert res["admission"]["spread_ms"] == 6.0
    assert res["warnings"] == []
    table = demo.summary_table(res)
    assert "20.0 / 21.40" in table and "2 lost in transport" in table and "no_action_yet 40" in table


def test_a_model_too_slow_for_the_machine_is_said_in_the_summary():
    msgs = {"active": 3, "chunk estimate 37.6 ms > 31.0 ms (deadline_ms - safety_margin_ms): chunks refused": 17}
    res = demo.build_result(_stats(fresh=30, hold=900, estimate=37.6, p99=4.5), {}, ARGS, 20.0,
                            inference_messages=msgs)
    text = "\n".join(res["warnings"])
    assert "too slow for this machine during 17 of the run's seconds" in text
    assert "only 3% of the ticks were fresh" in text
    assert "timer period error p99 4.5 ms" in text
    assert demo.summary_table(res).count("WARNING:") == 3


def test_live_line_shows_shares_reasons_and_the_inference_verdict():
    diag = {"vla_inference: engine": {"chunks_admitted": "5", "chunk_estimate_ms": "33.1", "chunk_budget_ms": "31.0",
                                      "_message": "chunk estimate 33.1 ms > 31.0 ms", "state": "active"}}
    line = demo.live_line(3.0, {"fresh": 10, "repeat": 5, "hold": 45}, {"fresh": 10, "repeat": 3, "hold": 17},
                          diag, {"hold: action_stale": 28, "repeat: no_new_action": 2})
    assert "fresh  0 repeat  2 hold 28" in line and "(  0% fresh)" in line
    assert "hold: action_stale 28" in line
    assert "est 33.1/31.0 ms | chunk estimate 33.1 ms > 31.0 ms" in line
    assert not line.rstrip().endswith("| active")


def test_reason_deltas_are_per_interval():
    assert demo._delta({"a": 5, "b": 2}, {"a": 3, "b": 2}) == {"a": 2}


def test_recovery_after_a_camera_silence_is_reported():
    args = argparse.Namespace(**vars(ARGS), camera_stall_after_s=10.0, camera_stall_for_s=3.0)
    res = demo.build_result(_stats(), {}, args, 20.0, ticks_seen={"reasons": {}, "lost": 0,
                                                                  "longest_without_fresh_s": 3.25})
    assert res["longest_without_fresh_s"] == 3.25
    assert "camera silent 3 s: recovery 0.25 s" in demo.summary_table(res)


def test_steady_state_misses_leave_out_the_first_seconds_and_warn():
    stats = _stats()
    stats["chunks"]["deadline_misses"] = total = 5
    warm = demo.build_result(stats, {}, ARGS, 20.0, misses_before_steady=total)  # every miss in the warm-up
    assert warm["deadline_misses_steady"] == 0 and not any("steady" in w for w in warm["warnings"])
    late = demo.build_result(stats, {}, ARGS, 20.0, misses_before_steady=max(0, total - 3))
    assert late["deadline_misses_steady"] == 3
    assert "deadline misses after the first 2 s (steady state)" in demo.summary_table(late)
    assert any("3 admitted chunks missed their deadline after the first 2 s" in w for w in late["warnings"])
    assert demo.build_result(stats, {}, ARGS, 20.0)["deadline_misses_steady"] is None  # not measured: said so
