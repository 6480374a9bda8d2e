"""The action node plays an action chunk: a fake H = 4 chunk arrives on the fresh-action topic (the robot side of
a split) and is published step by step at the control rate, each step at its frame stamp + k periods, then its
last step repeated, then hold; malformed, non-finite and future-stamped chunks are rejected, counted (snapshot and
/diagnostics values) and do not disturb the chunk being played. Each accepted chunk, and no rejected one, is also
published once as a JointTrajectory (from the topic, and offered in-process as role all does). In-process rclpy
(no child processes)."""
from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from ros_env import apply_env

rclpy = pytest.importorskip("rclpy")

from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from sensor_msgs.msg import JointState  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from vla_edge_ros.ros import conversions, diagnostics, qos  # noqa: E402
from vla_edge_ros.ros.action_node import DEFAULT_ACTION_NAMES, ActionNode  # noqa: E402

FRESH_TOPIC = "/vla_test/fresh_chunks"
TRAJECTORY_TOPIC = "/vla_test/action_trajectory"
RATE_HZ = 10.0
DT_NS = int(1e9 / RATE_HZ)
STALE_MS = 1000.0
H, D = 4, len(DEFAULT_ACTION_NAMES)


def chunk_values(tag: float) -> np.ndarray:
    """Step k, dimension j = tag + 10 (k + 1) + j / 100: a published value names its chunk and step."""
    return tag + 10.0 * (np.arange(H)[:, None] + 1) + np.arange(D)[None, :] / 100.0


class Probe:
    """Publishes fresh chunks, records the action node's JointState ticks and per-tick statuses."""

    def __init__(self, ctx):
        self.node = rclpy.create_node("vla_chunk_probe", context=ctx)
        self.pub = self.node.create_publisher(JointState, FRESH_TOPIC, qos.reliable_qos())
        self.lock = threading.Lock()
        self.ticks: list[tuple[int, str, int, list[float]]] = []  # (receive ns, kind, stamp ns, positions)
        self.statuses: list[dict[str, str]] = []
        self.trajectories: list[tuple[int, JointTrajectory]] = []  # (receive ns, message)
        self.node.create_subscription(JointState, "/vla/action", self._on_action, qos.reliable_qos(100))
        self.node.create_subscription(DiagnosticStatus, "/vla/action_status", self._on_status, qos.reliable_qos(100))
        self.traj_sub = self.node.create_subscription(JointTrajectory, TRAJECTORY_TOPIC, self._on_trajectory,
                                                      qos.reliable_qos(100))

    def now(self) -> int:
        return self.node.get_clock().now().nanoseconds

    def _on_trajectory(self, msg):
        with self.lock:
            self.trajectories.append((self.now(), msg))

    def trajectories_for(self, stamp_ns: int) -> list[tuple[int, JointTrajectory]]:
        with self.lock:
            return [(r, m) for r, m in self.trajectories if conversions.stamp_to_ns(m.header.stamp) == stamp_ns]

    def _on_action(self, msg):
        with self.lock:
            self.ticks.append((self.now(), msg.header.frame_id, conversions.stamp_to_ns(msg.header.stamp),
                               list(msg.position)))

    def _on_status(self, msg):
        with self.lock:
            self.statuses.append(conversions.status_to_dict(msg))

    def publish_chunk(self, chunk, stamp_ns: int, seq: int) -> None:
        self.pub.publish(conversions.fresh_chunk_to_msg(chunk, stamp_ns, DEFAULT_ACTION_NAMES, seq))


@pytest.fixture
def system(ros_domain, tmp_path):
    apply_env(ros_domain, tmp_path)
    ctx = rclpy.context.Context()
    rclpy.init(context=ctx, args=[])
    action = ActionNode(fresh_action_topic=FRESH_TOPIC, context=ctx, parameter_overrides=[
        Parameter("action_rate_hz", value=RATE_HZ), Parameter("stale_after_ms", value=STALE_MS),
        Parameter("action_trajectory_topic", value=TRAJECTORY_TOPIC)])
    probe = Probe(ctx)
    ex = SingleThreadedExecutor(context=ctx)
    ex.add_node(action)
    ex.add_node(probe.node)
    spin = threading.Thread(target=ex.spin, daemon=True)
    spin.start()
    try:
        yield action, probe
    finally:
        ex.shutdown(timeout_sec=2.0)
        spin.join(5.0)
        action.destroy_node()
        probe.node.destroy_node()
        rclpy.shutdown(context=ctx)


def wait_for(cond, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_a_chunk_is_played_step_by_step_and_bad_chunks_are_counted(system):
    action, probe = system
    assert wait_for(lambda: probe.pub.get_subscription_count() > 0 and len(probe.ticks) >= 2
                    and probe.node.count_publishers(TRAJECTORY_TOPIC) > 0, 20.0)
    good = chunk_values(0.0)
    stamp = probe.now()
    probe.publish_chunk(good, stamp, 1)
    time.sleep(0.15)  # step 1 is playing: bad chunks must not disturb it
    nan = good.copy()
    nan[2, 3] = math.nan
    probe.publish_chunk(nan, probe.now(), 2)  # non-finite
    ragged = conversions.fresh_chunk_to_msg(good, probe.now(), DEFAULT_ACTION_NAMES, 3)
    ragged.position = list(ragged.position)[:-1]  # 27 values: not whole steps of 7
    probe.pub.publish(ragged)
    probe.publish_chunk(good + 0.5, probe.now() + 2_000_000_000, 4)  # 2 s in the future: a clock error
    assert wait_for(lambda: any(k == "hold" and s == stamp for _, k, s, _ in probe.ticks), STALE_MS / 1e3 + 5.0)

    with probe.lock:
        ticks = [t for t in probe.ticks if t[2] == stamp]  # the ticks sourced from the good chunk
        statuses = [s for s in probe.statuses if s["source_stamp_ns"] == str(stamp)]
    played = [t for t in ticks if t[1] != "hold"]
    steps = [int(s["step"]) for s in statuses if s["kind"] != "hold"]
    assert len(steps) == len(played) and played[0][1] == "fresh"
    # every tick commanded exactly the step that was due at its time: floor((tick - stamp) / dt), the tick
    # being at most one period before the probe received it
    for (recv, kind, _, pos), step in zip(played, steps):
        due_at_receipt = min((recv - stamp) // DT_NS, H - 1)
        assert step in (due_at_receipt - 1, due_at_receipt), (step, (recv - stamp) / 1e6)
        np.testing.assert_array_equal(pos, good[step])
    assert steps == sorted(steps) and steps[0] <= 1 and len(set(steps) & {1, 2, 3}) == 3, steps
    reasons = [s["reason"] for s in statuses if s["kind"] != "hold"]
    assert reasons[0] == "new_chunk" and "next_step" in reasons and reasons[-1] == "ran_out", reasons
    # at the control rate: one tick per period while the chunk has steps (scheduling slack of one tick)
    in_chunk = [recv for recv, *_ in played if recv - stamp < H * DT_NS]
    assert H - 1 <= len(in_chunk) <= H + 1, [(r - stamp) / 1e6 for r in in_chunk]
    # then the last step while inputs are live, then hold once the chunk is older than stale_after_ms
    first_hold = next(recv for recv, kind, *_ in ticks if kind == "hold")
    assert STALE_MS * 1e6 - DT_NS <= first_hold - stamp <= STALE_MS * 1e6 + 3 * DT_NS

    snap = action.snapshot()
    assert snap["chunks_rejected_by_reason"] == {"non_finite": 1, "bad_shape": 1, "future_stamp": 1}, snap
    assert snap["chunks_rejected"] == 3 and snap["fresh_msgs_rejected"] == 3 and snap["fresh_msgs_received"] == 4
    ex = snap["arbiter"]
    assert (ex["horizon"], ex["accepted"], ex["horizon_changes"], ex["merge"]) == (H, 1, 1, "latest")
    values = {kv.key: kv.value for kv in diagnostics.action_status(snap).values}
    assert values["chunks_rejected"] == "3" and values["chunks_rejected.future_stamp"] == "1"

    # the accepted chunk was published once as a trajectory, from the step due when it was accepted; the three
    # rejected ones not at all
    assert (snap["trajectories_published"], snap["trajectory_errors"]) == (1, 0), snap
    with probe.lock:
        trajectories = list(probe.trajectories)
    assert len(trajectories) == 1, [conversions.stamp_to_ns(m.header.stamp) for _, m in trajectories]
    recv, traj = trajectories[0]
    assert conversions.stamp_to_ns(traj.header.stamp) == stamp and list(traj.joint_names) == list(DEFAULT_ACTION_NAMES)
    first = H - len(traj.points)
    assert 0 <= first <= (recv - stamp) // DT_NS and first < H, (first, (recv - stamp) / 1e6)
    for k, point in enumerate(traj.points, start=first):
        np.testing.assert_array_equal(point.positions, good[k])
        assert conversions.stamp_to_ns(point.time_from_start) == k * DT_NS

    # the executor went on: a later good chunk is played fresh from its due step
    stamp2 = probe.now()
    probe.publish_chunk(chunk_values(100.0), stamp2, 5)
    assert wait_for(lambda: any(s == stamp2 and k == "fresh" for _, k, s, _ in probe.ticks), 5.0)
    with probe.lock:
        first = next(t for t in probe.ticks if t[2] == stamp2)
    assert first[3][0] in (chunk_values(100.0)[0, 0], chunk_values(100.0)[1, 0])
    assert wait_for(lambda: len(probe.trajectories_for(stamp2)) == 1, 5.0)

    # role all: the inference loop offers into the shared executor directly, not through the topic
    stamp3 = probe.now()
    assert action.arbiter.offer(chunk_values(300.0), stamp3, DT_NS, stamp3)
    assert wait_for(lambda: len(probe.trajectories_for(stamp3)) == 1, 5.0)
    (_, traj3), = probe.trajectories_for(stamp3)
    assert [conversions.stamp_to_ns(p.time_from_start) for p in traj3.points] == [k * DT_NS for k in range(H)]
    np.testing.assert_array_equal([list(p.positions) for p in traj3.points], chunk_values(300.0))
    assert not action.arbiter.offer(chunk_values(400.0)[:, :3], probe.now(), DT_NS, probe.now())  # bad shape
    time.sleep(0.3)
    assert len(probe.trajectories) == 3 and action.snapshot()["trajectories_published"] == 3


def test_fresh_chunk_messages_round_trip_and_h1_is_the_single_action_message():
    chunk = chunk_values(0.25)
    msg = conversions.fresh_chunk_to_msg(chunk, 5_000_000_001, DEFAULT_ACTION_NAMES, 7)
    back, stamp, names = conversions.msg_to_fresh_chunk(msg, D)
    assert stamp == 5_000_000_001 and names == list(DEFAULT_ACTION_NAMES) and msg.header.frame_id == "fresh:7"
    np.testing.assert_array_equal(back, chunk)
    one = conversions.fresh_chunk_to_msg(chunk[:1], 9, DEFAULT_ACTION_NAMES, 1)
    assert one == conversions.fresh_action_to_msg(chunk[0], 9, DEFAULT_ACTION_NAMES, 1)
    msg.name = []  # no names: the receiver's action dims make the steps
    assert conversions.msg_to_fresh_chunk(msg, D)[0].shape == (H, D)
    with pytest.raises(ValueError, match="whole number of steps"):
        conversions.msg_to_fresh_chunk(msg, 5)
    with pytest.raises(ValueError, match="expected"):
        conversions.fresh_chunk_to_msg(chunk[:, :6], 0, DEFAULT_ACTION_NAMES, 1)


def test_the_inference_node_hands_its_chunk_to_the_executor_in_process_and_over_the_topic(system):
    from vla_edge_ros.core.double_buffer import DoubleBuffer
    from vla_edge_ros.core.executor import ChunkExecutor
    from vla_edge_ros.engine.interface import ChunkResult
    from vla_edge_ros.ros.inference_node import InferenceNode

    action, probe = system
    ctx = action.context
    local = ChunkExecutor(D, horizon=H, stale_after_ms=STALE_MS)
    edge = InferenceNode(DoubleBuffer(), arbiter=local, publish_fresh=True, context=ctx,
                         parameter_overrides=[Parameter("fresh_action_topic", value=FRESH_TOPIC)])
    try:
        edge.action_names = DEFAULT_ACTION_NAMES  # what configure takes from the engine
        local.clear_stale("inference_inactive")  # what activate does
        assert wait_for(lambda: edge._fresh_pub.get_subscription_count() > 0, 20.0)
        chunk = chunk_values(200.0)
        result = ChunkResult(1, np.zeros(9, np.int64), np.zeros(7, np.int64), chunk[0].astype(np.float32), 1.0,
                             1.0, 2.0, chunk=chunk.astype(np.float32))
        stamp = probe.now()
        result.frame_stamp_ns = stamp  # set by the inference loop
        edge._on_action(result, None)
        # role all: offered directly, one step per control period of this process (30 Hz default)
        s = local.stats()
        assert (s["accepted"], s["rejected"]) == (1, {}), s
        step_ns = int(round(1e9 / 30.0))
        d = local.tick(stamp + 2 * step_ns + 1)
        assert (d.kind, d.step, d.source_stamp_ns) == ("fresh", 2, stamp)
        np.testing.assert_allclose(d.values, chunk[2], rtol=1e-6)
        # role edge -> robot: the same chunk over fresh_action_topic, played by the robot's executor
        assert wait_for(lambda: any(s == stamp and k == "fresh" for _, k, s, _ in probe.ticks), 5.0)
        with probe.lock:
            played = [pos for _, k, s, pos in probe.ticks if s == stamp and k != "hold"]
        assert played and all(any(np.allclose(p, row, rtol=1e-6) for row in chunk) for p in played)
        assert action.arbiter.stats()["horizon"] == H
    finally:
        edge.destroy_node()


def checkpoint_with(tmp_path, vla):
    """The tiny default checkpoint with ``vla`` merged into its config's vla block."""
    import json
    import shutil

    from vla_edge_ros.engine.tiny_default import ensure_tiny_default

    ckpt = tmp_path / "ckpt"
    shutil.copytree(ensure_tiny_default(), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["vla"].update(vla)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


def test_configure_runs_an_h4_checkpoint_and_the_loop_counts_its_decode_steps(system, tmp_path):
    """Issue 22: H = 4 autoregressive is decoded (4 x 7 bins + an end token: 29 steps, not decode_tokens 8) and
    the admission cost model counts those steps."""
    from vla_edge_ros.core.double_buffer import DoubleBuffer
    from vla_edge_ros.ros.inference_node import InferenceNode

    action, _ = system
    node = InferenceNode(DoubleBuffer(), arbiter=action.arbiter, context=action.context, parameter_overrides=[
        Parameter("checkpoint", value=str(checkpoint_with(tmp_path, {"action_horizon": 4}))),
        Parameter("backend", value="numpy"), Parameter("warmup_chunks", value=1)])
    try:
        assert node.safe_transition("configure"), node.last_error
        assert (node.engine.decode_steps, node.loop.decode_tokens) == (29, 29)
        assert node.action_horizon == 4 and action.arbiter.horizon == 4
    finally:
        if node.engine is not None:
            node.safe_transition("cleanup")  # closes the engine
        node.destroy_node()


def test_configure_runs_a_parallel_checkpoint_with_forcing_on(system, tmp_path):
    """Issue 22: numpy decodes vla.chunk_decode parallel (one pass: the cost model counts 1 decode step);
    force_committed_steps reaches the inference loop, action_readout the engine."""
    from vla_edge_ros.core.double_buffer import DoubleBuffer
    from vla_edge_ros.ros.inference_node import InferenceNode

    action, _ = system
    ckpt = checkpoint_with(tmp_path, {"action_horizon": 4, "chunk_decode": "parallel"})
    node = InferenceNode(DoubleBuffer(), arbiter=action.arbiter, context=action.context, parameter_overrides=[
        Parameter("checkpoint", value=str(ckpt)), Parameter("backend", value="numpy"),
        Parameter("warmup_chunks", value=2), Parameter("force_committed_steps", value=True),
        Parameter("action_readout", value="expectation")])
    try:
        assert node.safe_transition("configure"), node.last_error
        assert node.engine.action_readout == "expectation"
        assert (node.engine.decode_steps, node.engine.scratch_slots, node.loop.decode_tokens) == (1, 28, 1)
        assert node.action_horizon == 4 and node.loop.committed.active
    finally:
        if node.engine is not None:
            node.safe_transition("cleanup")  # closes the engine
        node.destroy_node()


def test_configure_refuses_a_checkpoint_whose_chunks_cannot_be_decoded(system, tmp_path):
    from vla_edge_ros.core.double_buffer import DoubleBuffer
    from vla_edge_ros.ros.inference_node import InferenceNode

    ckpt = checkpoint_with(tmp_path, {"action_horizon": 4, "chunk_decode": "parallel", "action_start": "prefill"})
    action, _ = system
    node = InferenceNode(DoubleBuffer(), arbiter=action.arbiter, context=action.context, parameter_overrides=[
        Parameter("checkpoint", value=str(ckpt)), Parameter("backend", value="numpy"),
        Parameter("warmup_chunks", value=0)])
    try:
        assert not node.safe_transition("configure")
        assert node.current_state_label() == "unconfigured" and node.engine is None
        assert "vla.chunk_decode='parallel' with vla.action_start='prefill'" in node.last_error, node.last_error
        assert action.arbiter.horizon == 1  # the executor was not switched to the refused horizon
    finally:
        node.destroy_node()
