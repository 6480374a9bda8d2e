"""An accepted action chunk as trajectory_msgs/JointTrajectory (ros/conversions.py ``chunk_to_joint_trajectory``)
and the executor's accept listener that the action node publishes it from.

Why: a controller that interpolates executes exactly these points at header.stamp + time_from_start, so the
stamp, the step times, the names and which steps are left out (those already past, as the executor skips them)
must be right, and must agree with what the executor itself commands. No ROS processes (message objects only).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("rclpy")

from vla_edge_ros.core.executor import ChunkExecutor  # noqa: E402
from vla_edge_ros.ros import conversions  # noqa: E402
from vla_edge_ros.ros.action_node import DEFAULT_ACTION_NAMES  # noqa: E402

H, D = 4, len(DEFAULT_ACTION_NAMES)
DT_NS = 100_000_000
STAMP_NS = 5_000_000_001


def chunk_values(tag: float, horizon: int = H) -> np.ndarray:
    """Step k, dimension j = tag + 10 (k + 1) + j / 100."""
    return tag + 10.0 * (np.arange(horizon)[:, None] + 1) + np.arange(D)[None, :] / 100.0


def times_ns(msg) -> list[int]:
    return [conversions.stamp_to_ns(p.time_from_start) for p in msg.points]


def positions(msg) -> np.ndarray:
    return np.array([list(p.positions) for p in msg.points])


def test_points_start_at_the_step_due_with_times_relative_to_the_frame_stamp():
    chunk = chunk_values(0.5)
    msg = conversions.chunk_to_joint_trajectory(chunk, STAMP_NS, DT_NS, DEFAULT_ACTION_NAMES,
                                                now_ns=STAMP_NS + 2 * DT_NS + 37)  # just over 2 dt late
    assert conversions.stamp_to_ns(msg.header.stamp) == STAMP_NS
    assert list(msg.joint_names) == list(DEFAULT_ACTION_NAMES)
    assert times_ns(msg) == [2 * DT_NS, 3 * DT_NS]  # steps 0 and 1 were already past: left out
    np.testing.assert_array_equal(positions(msg), chunk[2:])
    assert all(len(p.velocities) == 0 and len(p.accelerations) == 0 for p in msg.points)


def test_a_stamp_just_ahead_keeps_every_step_and_long_steps_carry_into_seconds():
    chunk = chunk_values(1.0)
    dt = 1_500_000_000
    msg = conversions.chunk_to_joint_trajectory(chunk, STAMP_NS, dt, DEFAULT_ACTION_NAMES, now_ns=STAMP_NS - 3)
    assert times_ns(msg) == [k * dt for k in range(H)]
    assert (msg.points[3].time_from_start.sec, msg.points[3].time_from_start.nanosec) == (4, 500_000_000)
    np.testing.assert_array_equal(positions(msg), chunk)


def test_a_chunk_accepted_after_its_end_keeps_its_last_step_and_h1_its_only_one():
    late = conversions.chunk_to_joint_trajectory(chunk_values(2.0), STAMP_NS, DT_NS, DEFAULT_ACTION_NAMES,
                                                 now_ns=STAMP_NS + 10 * DT_NS)
    assert times_ns(late) == [(H - 1) * DT_NS]
    np.testing.assert_array_equal(positions(late), chunk_values(2.0)[-1:])
    # H = 1: the stamp is provenance only (the executor plays the step whatever the clock), a flat vector is one step
    single = conversions.chunk_to_joint_trajectory(chunk_values(3.0)[0], STAMP_NS, DT_NS, DEFAULT_ACTION_NAMES,
                                                   now_ns=STAMP_NS + 10 * DT_NS)
    assert times_ns(single) == [0]
    np.testing.assert_array_equal(positions(single), chunk_values(3.0)[:1])


def test_bad_chunks_and_step_periods_are_refused_by_name():
    with pytest.raises(ValueError, match="expected"):
        conversions.chunk_to_joint_trajectory(chunk_values(0.0)[:, :5], STAMP_NS, DT_NS, DEFAULT_ACTION_NAMES, 0)
    with pytest.raises(ValueError, match="dt_ns"):
        conversions.chunk_to_joint_trajectory(chunk_values(0.0), STAMP_NS, 0, DEFAULT_ACTION_NAMES, 0)


@pytest.mark.parametrize("latency_ns", [0, 1, DT_NS - 1, DT_NS, 2 * DT_NS + 5, 3 * DT_NS, 7 * DT_NS])
def test_the_first_point_is_what_the_executor_commands_at_acceptance(latency_ns):
    """The listener gets the plan as stored; its first published point is the executor's fresh tick then."""
    got = []
    ex = ChunkExecutor(D, horizon=H, stale_after_ms=10_000.0)
    ex.on_accept = lambda plan, stamp, dt, now: got.append((plan, stamp, dt, now))
    now = STAMP_NS + latency_ns
    assert ex.offer(chunk_values(4.0), STAMP_NS, DT_NS, now)
    (plan, stamp, dt, accepted_at), = got
    assert (stamp, dt, accepted_at) == (STAMP_NS, DT_NS, now)
    msg = conversions.chunk_to_joint_trajectory(plan, stamp, dt, DEFAULT_ACTION_NAMES, accepted_at)
    tick = ex.tick(now)
    assert tick.kind == "fresh" and times_ns(msg)[0] == tick.step * DT_NS
    np.testing.assert_array_equal(positions(msg)[0], tick.values)
    assert len(msg.points) == H - tick.step


def test_the_listener_hears_accepted_chunks_only_and_gets_blends_rewrite():
    got = []
    ex = ChunkExecutor(D, horizon=H, merge="blend", blend_steps=1, stale_after_ms=10_000.0)
    ex.on_accept = lambda plan, stamp, dt, now: got.append((plan, stamp))
    first, second = chunk_values(0.0), chunk_values(100.0)
    assert ex.offer(first, STAMP_NS, DT_NS, STAMP_NS)
    bad = second.copy()
    bad[1, 2] = np.nan
    assert not ex.offer(bad, STAMP_NS + DT_NS, DT_NS, STAMP_NS + DT_NS)  # non-finite: rejected, not heard
    assert not ex.offer(second[:, :3], STAMP_NS + DT_NS, DT_NS, STAMP_NS + DT_NS)  # bad shape
    # accepted one step after its frame: step 0 is committed from the executing chunk, step 1 blends halfway
    assert ex.offer(second, STAMP_NS + DT_NS, DT_NS, STAMP_NS + 2 * DT_NS)
    assert [s for _, s in got] == [STAMP_NS, STAMP_NS + DT_NS]
    np.testing.assert_array_equal(got[0][0], first)
    plan = got[1][0]
    np.testing.assert_array_equal(plan[0], first[1])
    np.testing.assert_allclose(plan[1], 0.5 * first[2] + 0.5 * second[1])
    np.testing.assert_array_equal(plan[2:], second[2:])
    plan[:] = 0.0  # a copy: the listener cannot change what the executor plays
    assert not np.allclose(ex.tick(STAMP_NS + 2 * DT_NS).values, 0.0)
