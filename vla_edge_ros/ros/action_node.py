"""`vla_action`: the 30 Hz action publisher.

Every tick (``action_rate_hz``) asks the ChunkExecutor (core/executor.py) which step of which action chunk is
due now and publishes, always:
- sensor_msgs/JointState on ``action_topic``: name = action dimension names, position = values,
  header.stamp = stamp of the source camera frame, header.frame_id = kind ('fresh' | 'repeat' | 'hold');
- diagnostic_msgs/DiagnosticStatus on ``action_status_topic``: kind, source stamp, age_ms, seq, reason, step.

A chunk's step k is due at its frame stamp + k * dt, dt = ``1 / chunk_step_hz`` (the control period the policy was
trained at) or, when that is 0, this node's control period (``1 / action_rate_hz``); chunks
that overlap are merged by ``chunk_merge``. With the checkpoint's action_horizon H = 1 (today's models) the
executor is the former ActionArbiter exactly: fresh, then repeat, then hold after ``stale_after_ms``
(measured on this machine's receive clock, so clock skew between hosts cannot stall it).

For controllers that interpolate, each chunk the executor accepts is also published once, at acceptance, as
trajectory_msgs/JointTrajectory on ``action_trajectory_topic`` (empty = off; ros/conversions.py
``chunk_to_joint_trajectory``): header.stamp = its frame stamp, joint_names = the action names, one point per step
k with time_from_start = k * dt relative to header.stamp. Steps already past at acceptance are NOT included (the
executor skips them: latency compensation): the first point is the step due then, so its time_from_start is the
latency rounded down to a step; a chunk accepted after its last step was due keeps that one step. Positions are
the chunk as the executor stores it: with ``blend`` its committed / blended first steps, with
``temporal_ensemble`` the chunk's own steps (the per-tick average is on ``action_topic``). A rejected chunk is
not published. Role all: the listener runs on the inference thread that offered the chunk (rclpy publishers may
be used from any thread), so the trajectory leaves as soon as the chunk is in, not at the next tick.

Where fresh chunks come from:
- role all: the inference loop in the same process calls ``executor.offer`` directly (shared object; the
  inference node sets the executor's horizon from the checkpoint at configure);
- role robot: this node subscribes ``fresh_action_topic`` (JointState from the edge process, the chunk
  flattened: ros/conversions.py) and offers each message into the executor, whose horizon follows the edge's
  chunks (a change of H is logged and counted).
A rejected chunk (wrong shape, NaN/inf, a stamp from the future, reordered) is counted by reason in the
snapshot and on /diagnostics; the executor goes on with what it had.

Live parameters: ``action_rate_hz`` (the timer is re-created at the next tick) and ``stale_after_ms``.
"""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.node import Node
from sensor_msgs.msg import JointState
from trajectory_msgs.msg import JointTrajectory

from vla_edge_ros import params as registry
from vla_edge_ros.core.executor import ChunkExecutor
from vla_edge_ros.core.metrics import LatencyStats, PeriodTracker, RateCounter
from vla_edge_ros.ros import conversions, qos
from vla_edge_ros.ros.param_bridge import ParamBridge

DEFAULT_ACTION_NAMES = ("x", "y", "z", "roll", "pitch", "yaw", "gripper")


def gripper_index_of(names: Sequence[str]) -> Optional[int]:
    for i, n in enumerate(names):
        if "gripper" in n.lower():
            return i
    return None


class ActionNode(Node):
    NODE_NAME = registry.ACTION

    def __init__(self, arbiter: ChunkExecutor | None = None, action_names: Sequence[str] = DEFAULT_ACTION_NAMES,
                 fresh_action_topic: str | None = None, **node_kwargs):
        super().__init__(self.NODE_NAME, **node_kwargs)
        self.params = ParamBridge(self, registry.ACTION, on_change=self._on_params)
        self.action_names = tuple(action_names)
        # Named ``arbiter`` for the camera / inference nodes and the figures that share it ("arbiter" stats).
        self.arbiter = arbiter if arbiter is not None else ChunkExecutor(
            len(self.action_names), horizon=1, merge=self.params.get("chunk_merge"),
            gripper_index=gripper_index_of(self.action_names), stale_after_ms=self.params.get("stale_after_ms"))
        if arbiter is not None:
            self.arbiter.set_stale_after_ms(self.params.get("stale_after_ms"))
        self._pub = self.create_publisher(JointState, self.params.get("action_topic"), qos.reliable_qos())
        self._status_pub = self.create_publisher(DiagnosticStatus, self.params.get("action_status_topic"),
                                                 qos.reliable_qos())
        self.trajectories_published = 0
        self.trajectory_errors = 0  # accepted chunks whose trajectory could not be built or published
        self._trajectory_pub = None
        if self.params.get("action_trajectory_topic"):
            self._trajectory_pub = self.create_publisher(JointTrajectory, self.params.get("action_trajectory_topic"),
                                                         qos.reliable_qos())
            self.arbiter.on_accept = self._publish_trajectory
        self.period = PeriodTracker(1000.0 / self.params.get("action_rate_hz"))
        self.rates = {k: RateCounter(1.0) for k in ("fresh", "repeat", "hold")}
        self.counts = {"fresh": 0, "repeat": 0, "hold": 0}
        self.missed_ticks = 0  # timer grid points skipped (gaps >= 1.75 periods), see _on_tick
        self.publish_errors = 0
        self.ticks_published = 0
        self._last_tick_mono: Optional[int] = None
        self.publish_ms = LatencyStats(4096)  # cost of the two publish calls of a tick
        self.fresh_msgs = 0
        self.fresh_rejected = 0  # fresh messages refused: malformed (below) or rejected by the executor
        self.fresh_malformed: dict[str, int] = {}  # reason -> messages that could not even be read as a chunk
        self.last_decision = None
        self._pending_rate: Optional[float] = None
        self.on_rate_change = None
        self._timer = self.create_timer(1.0 / self.params.get("action_rate_hz"), self._on_tick)
        self._fresh_sub = None
        if fresh_action_topic:
            self._fresh_sub = self.create_subscription(JointState, fresh_action_topic, self._on_fresh_action,
                                                       qos.reliable_qos())
            self.get_logger().info(f"robot side: taking fresh actions from {fresh_action_topic}")

    @property
    def step_ns(self) -> int:
        """The executor's step period: ``chunk_step_hz`` (the policy's control rate) when set, else this node's
        control period."""
        hz = float(self.params.get("chunk_step_hz"))
        return int(round(1e9 / (hz if hz > 0.0 else float(self.params.get("action_rate_hz")))))

    def offer_chunk(self, chunk: Any, frame_stamp_ns: int) -> bool:
        """Offer a chunk ((H, D), or a flat D vector for H = 1) computed from the frame stamped ``frame_stamp_ns``;
        False when the executor rejected it (counted there by reason)."""
        return self.arbiter.offer(chunk, frame_stamp_ns, self.step_ns, self.get_clock().now().nanoseconds)

    def _publish_trajectory(self, plan: Any, frame_stamp_ns: int, dt_ns: int, now_ns: int) -> None:
        """The executor's accept listener (module docstring): never raises into the offering thread; a failure
        is counted (``trajectory_errors``) and logged."""
        try:
            self._trajectory_pub.publish(conversions.chunk_to_joint_trajectory(plan, frame_stamp_ns, dt_ns,
                                                                               self.action_names, now_ns))
            self.trajectories_published += 1
        except Exception as exc:
            self.trajectory_errors += 1
            self.get_logger().error(f"action trajectory not published: {exc!r}", throttle_duration_sec=1.0)

    # ---- fresh chunks from the edge process (role robot) ----------------------------------------------
    def _malformed(self, reason: str, text: str) -> None:
        self.fresh_rejected += 1
        self.fresh_malformed[reason] = self.fresh_malformed.get(reason, 0) + 1
        self.get_logger().warning(f"fresh chunk rejected: {text}", throttle_duration_sec=1.0)

    def _on_fresh_action(self, msg: JointState) -> None:
        self.fresh_msgs += 1
        try:
            chunk, stamp_ns, names = conversions.msg_to_fresh_chunk(msg, len(self.action_names))
        except ValueError as exc:
            return self._malformed("bad_shape", str(exc))
        if names and tuple(names) != self.action_names:
            if len(names) != len(self.action_names):
                return self._malformed("dims_mismatch", f"{len(names)} dims {names}, expected "
                                                        f"{list(self.action_names)}")
            self.action_names = tuple(names)
        if chunk.shape[0] != self.arbiter.horizon:
            # The edge runs the model: its chunk length is the checkpoint's action_horizon.
            log = self.get_logger().info if not self.arbiter.accepted else self.get_logger().warning
            log(f"fresh chunks have {chunk.shape[0]} steps (executor had {self.arbiter.horizon}): following the "
                "edge's action_horizon")
            self.arbiter.set_horizon(chunk.shape[0])
        if not self.offer_chunk(chunk, stamp_ns):
            self.fresh_rejected += 1
            self.get_logger().warning(f"fresh chunk rejected: {self.arbiter.last_reject_message}",
                                      throttle_duration_sec=1.0)

    # ---- the tick --------------------------------------------------------------------------------------
    def _on_tick(self) -> None:
        mono = time.monotonic_ns()
        if self._pending_rate is not None:
            self._recreate_timer()
            return
        last = self._last_tick_mono
        self._last_tick_mono = mono
        self.period.tick(mono)
        if last is not None:
            # rclpy timers sit on a fixed grid: a late callback is followed by an early one and skips nothing;
            # a grid point is skipped only when the gap reaches ~2 periods. Count gaps >= 1.75 periods.
            gap = (mono - last) / 1e6 / self.period.nominal_ms
            self.missed_ticks += max(0, int(gap + 0.25) - 1)
        try:
            decision = self.arbiter.tick(self.get_clock().now().nanoseconds)
            self.last_decision = decision
            self.counts[decision.kind] += 1
            self.rates[decision.kind].add(mono)
            t_pub = time.perf_counter_ns()
            self._pub.publish(conversions.tick_to_joint_state(decision, self.action_names))
            self.ticks_published += 1
            self._status_pub.publish(conversions.tick_to_status(decision, self.NODE_NAME, self.ticks_published))
            self.publish_ms.add((time.perf_counter_ns() - t_pub) / 1e6)
        except Exception as exc:  # a publish failure must not stop the timer
            self.publish_errors += 1
            self.get_logger().error(f"action tick failed: {exc!r}", throttle_duration_sec=1.0)

    def _recreate_timer(self) -> None:
        rate, self._pending_rate = self._pending_rate, None
        self.destroy_timer(self._timer)
        self.period.set_nominal_ms(1000.0 / rate)
        self._last_tick_mono = None
        self._timer = self.create_timer(1.0 / rate, self._on_tick)
        self.get_logger().info(f"action timer re-created at {rate} Hz")

    # ---- live parameters -------------------------------------------------------------------------------
    def _on_params(self, changes: dict) -> None:
        if "stale_after_ms" in changes:
            self.arbiter.set_stale_after_ms(changes["stale_after_ms"])
        if "action_rate_hz" in changes:
            # Applied at the next tick, from the timer's own callback (never destroy a timer mid-callback
            # from another thread).
            self._pending_rate = float(changes["action_rate_hz"])
            if self.on_rate_change is not None:  # role all: the inference cycle follows the control rate
                self.on_rate_change(self._pending_rate)

    def set_action_names(self, names: Sequence[str]) -> None:
        """Called once the engine knows its action dimensions (role all / after configure)."""
        names = tuple(names)
        if len(names) != self.arbiter.action_dims:
            raise ValueError(f"engine has {len(names)} action dims, executor {self.arbiter.action_dims}")
        self.action_names = names

    # ---- figures ---------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        summ = self.period.summary()
        ex = self.arbiter.stats()
        rejected = dict(ex["rejected"])  # by the executor, and messages that could not be read as a chunk
        for reason, n in self.fresh_malformed.items():
            rejected[reason] = rejected.get(reason, 0) + n
        return {
            "ticks": dict(self.counts),
            "rates_hz": {k: r.rate() for k, r in self.rates.items()},
            "timer_period_error_ms": {"p50": summ["period_error_p50_ms"], "p99": summ["period_error_p99_ms"],
                                      "max": summ["period_error_max_ms"]},
            "longest_gap_ms": summ["longest_gap_ms"],
            "missed_ticks": self.missed_ticks,
            "action_rate_hz": self.params.get("action_rate_hz"),
            "stale_after_ms": self.params.get("stale_after_ms"),
            "publish_errors": self.publish_errors,
            "ticks_published": self.ticks_published,
            "publish_ms": self.publish_ms.summary(),
            "fresh_msgs_received": self.fresh_msgs,
            "fresh_msgs_rejected": self.fresh_rejected,
            "fresh_msgs_malformed": dict(self.fresh_malformed),
            "chunk_merge": self.params.get("chunk_merge"),
            "trajectories_published": self.trajectories_published,
            "trajectory_errors": self.trajectory_errors,
            "arbiter": ex,  # the ChunkExecutor's figures (the key predates it)
            "chunks_rejected": sum(rejected.values()),
            "chunks_rejected_by_reason": rejected,
        }
