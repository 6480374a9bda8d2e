"""Episodes of the closed loop: the result record, and the controller that applies the newest command.

The controller is the sim side of "the sim never waits for the policy": actions are *offered* whenever they
arrive (validated at once by action_map.parse_command; a bad one is counted by reason and makes the next step a
hold, so it is never applied and an older command is not silently reused in its place); once per control step
the newest command is applied:

- a 'fresh' or 'repeat' action -> mapped to the env action (action_map.ActionMapping.to_env);
- a 'hold' action -> zero motion, the gripper command as last applied (its values are not used: the sim is the
  authority on "unchanged");
- the sim holds by itself (same env action) when nothing was received yet ('no_action'), when the newest
  command is older than ``action_timeout_ms`` on the receive clock ('stale': the publisher died or stalled), or
  when the newest message was rejected ('rejected').

With ``wait_for_action`` the first episode starts (its clock and its steps) at the first accepted action:
before that control_step does nothing, so the time a runtime needs to start does not use up an episode.

Smoothness: every applied env action's x y z is the commanded TCP displacement of that step (env units times
``mapping.metres_per_unit``); the third difference of the positions they add up to (the second of the
displacements) over the steps of an episode is the commanded jerk, and
``EpisodeResult.jerk_sq_mean`` is its mean squared norm in (m/s^3)^2 with the nominal control period
``control_period_s`` (issue 22's smoothness figure: repeating or switching chunks shows up here; holds count as
zero displacement, as the arm sees them).

An episode ends at success (the env's ``info['success']``) or at ``horizon`` steps; its :class:`EpisodeResult`
is returned by the step that ended it and the next episode starts at once from seed ``seed_start + k``.
Pure: the env is any object with ``reset(seed)``, ``step_env(a4) -> success``, ``ee_position()``, ``mapping``,
``horizon``, ``task`` and ``instruction`` (metaworld_env.MetaWorldSim).

Baselines (:class:`BuiltinDriver`, the node's ``sim_policy``): the scripted expert (upper bound) or an
always-hold policy drive the controller from inside the sim, offering their command just before each control
step through the same gate (``offer``), the same 7 -> 4 mapping and the same wall-clock control step as a
received action -- so a baseline's success is measured under the timing the runtime's actions get.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from vla_edge_ros.sim.action_map import (ENV_GRIP_OPEN, KINDS, REJECT_REASONS, RUNTIME_ACTION_NAMES, ActionRejected,
                                         parse_command)

SIM_HOLD_REASONS = ("no_action", "stale", "rejected")
# Who drives the arm (the sim node's sim_policy): received actions, the scripted expert, or always hold.
SIM_POLICIES = ("external", "expert", "hold")


@dataclass
class EpisodeResult:
    task: str
    instruction: str
    seed: int
    episode: int  # 0, 1, ... within this run
    success: bool
    end: str  # 'success' | 'horizon'
    steps: int  # control steps applied (env steps)
    horizon: int
    duration_s: float  # wall-clock time from reset to the end
    fresh: int = 0  # steps that applied a received action of this kind
    repeat: int = 0
    hold: int = 0
    sim_hold: dict[str, int] = field(default_factory=lambda: {r: 0 for r in SIM_HOLD_REASONS})
    received: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})  # accepted messages by kind
    rejected: dict[str, int] = field(default_factory=lambda: {r: 0 for r in REJECT_REASONS})
    reapplied: int = 0  # steps that applied the same message as the step before (publisher slower than control)
    new_plan: int = 0  # fresh / repeat steps whose action came from a newer camera frame than the step before's
    saturated: int = 0  # applied actions that the mapping clipped
    rotation_ignored: int = 0  # applied actions with a non-zero roll / pitch / yaw (MetaWorld cannot rotate)
    frames: int = 0  # camera frames published during the episode (the node counts them)
    ee_start: list[float] = field(default_factory=list)  # end-effector (TCP) position at reset, metres
    ee_end: list[float] = field(default_factory=list)
    jerk_sq_mean: float = 0.0  # mean squared commanded jerk, (m/s^3)^2 (module docstring); 0 below 3 steps
    extra: dict[str, Any] = field(default_factory=dict)  # node figures (control period error, ...)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "EpisodeResult":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class _Command:
    kind: str
    values: np.ndarray
    received_ns: int
    seq: int
    source_ns: int = 0  # stamp of the camera frame the action was computed from (0: not given)


_REJECTED = object()  # the newest message was rejected: hold until a good one arrives


def commanded_jerk_sq_mean(moves: Sequence[Sequence[float]], period_s: float) -> float:
    """Mean squared norm of the jerk of a trajectory given as per-step displacements (metres): velocity is
    move / dt, so jerk is the second difference of the moves over dt^3. 0.0 below 3 moves (no jerk defined)."""
    d = np.asarray(moves, np.float64).reshape(-1, 3) if len(moves) else np.zeros((0, 3))
    if len(d) < 3:
        return 0.0
    jerk = (d[2:] - 2.0 * d[1:-1] + d[:-2]) / period_s ** 3
    return float(np.mean(np.sum(jerk * jerk, axis=1)))


class SimController:
    def __init__(self, sim: Any, seed_start: int = 0, num_episodes: int = 0, action_timeout_ms: float = 500.0,
                 expected_names: Sequence[str] = RUNTIME_ACTION_NAMES,
                 clock_ns: Callable[[], int] = time.monotonic_ns,
                 on_result: Optional[Callable[[EpisodeResult], None]] = None, wait_for_action: bool = False,
                 control_period_s: float = 0.1):
        if num_episodes < 0:
            raise ValueError(f"num_episodes must be >= 0 (0 = forever), got {num_episodes}")
        if not action_timeout_ms > 0:
            raise ValueError(f"action_timeout_ms must be > 0, got {action_timeout_ms}")
        if not control_period_s > 0:
            raise ValueError(f"control_period_s must be > 0, got {control_period_s}")
        self.control_period_s = float(control_period_s)
        self.sim = sim
        self.seed_start = int(seed_start)
        self.num_episodes = int(num_episodes)
        self.timeout_ns = int(action_timeout_ms * 1e6)
        self.expected_names = tuple(expected_names)
        self.clock_ns = clock_ns
        self.on_result = on_result
        self.results: list[EpisodeResult] = []
        self.total_rejected = {r: 0 for r in REJECT_REASONS}
        self.last_rejection = ""
        self._lock = threading.Lock()
        self._seq = 0
        self._newest: Any = None
        self._last_applied_seq = 0
        self._last_source_ns = 0  # newest source frame stamp applied so far (for new_plan)
        self.episode_index = -1
        self.finished = False
        self.started = not wait_for_action
        self._begin(self.seed_start)

    # ---- episodes ------------------------------------------------------------------------------------
    def _begin(self, seed: int) -> None:
        self.episode_index += 1
        self.sim.reset(seed)
        self.env_gripper = ENV_GRIP_OPEN  # MetaWorld resets the hand open
        self._cur = EpisodeResult(task=self.sim.task, instruction=self.sim.instruction, seed=int(seed),
                                  episode=self.episode_index, success=False, end="", steps=0,
                                  horizon=int(self.sim.horizon), duration_s=0.0,
                                  ee_start=[float(v) for v in self.sim.ee_position()])
        self._t0_ns = self.clock_ns()
        self._moves: list[np.ndarray] = []  # commanded TCP displacement per applied step, metres

    @property
    def current(self) -> EpisodeResult:
        """The running episode's counters (read-only use)."""
        return self._cur

    @property
    def seed(self) -> int:
        return self._cur.seed

    # ---- input ---------------------------------------------------------------------------------------
    def offer(self, frame_id: str, values: Sequence[float], names: Sequence[str] = (),
              now_ns: Optional[int] = None, source_ns: int = 0) -> Optional[str]:
        """One received action (``source_ns``: its source frame's stamp, the JointState header's; 0 = unknown).
        Returns None when accepted, else the rejection reason (counted; next step holds)."""
        now_ns = self.clock_ns() if now_ns is None else int(now_ns)
        with self._lock:
            try:
                kind, a = parse_command(frame_id, values, names, self.expected_names)
            except ActionRejected as exc:
                self._cur.rejected[exc.reason] += 1
                self.total_rejected[exc.reason] += 1
                self.last_rejection = str(exc)
                self._newest = _REJECTED
                return exc.reason
            self._seq += 1
            self._cur.received[kind] += 1
            self._newest = _Command(kind, a, now_ns, self._seq, int(source_ns))
            if not self.started:
                self.started, self._t0_ns = True, now_ns
            return None

    def note_frame(self) -> None:
        """A camera frame was published (frames before the first episode started are not counted)."""
        if self.started and not self.finished:
            self._cur.frames += 1

    # ---- one control step ----------------------------------------------------------------------------
    def control_step(self, now_ns: Optional[int] = None) -> Optional[EpisodeResult]:
        """Apply the newest command for one env step; returns the result of an episode that ended here."""
        if self.finished or not self.started:
            return None
        now_ns = self.clock_ns() if now_ns is None else int(now_ns)
        mapping, cur = self.sim.mapping, self._cur
        with self._lock:
            cmd = self._newest
        if cmd is None or cmd is _REJECTED or now_ns - cmd.received_ns > self.timeout_ns:
            reason = "no_action" if cmd is None else "rejected" if cmd is _REJECTED else "stale"
            cur.sim_hold[reason] += 1
            env = mapping.hold_env(self.env_gripper)
        else:
            if cmd.seq == self._last_applied_seq:
                cur.reapplied += 1
            self._last_applied_seq = cmd.seq
            if cmd.kind != "hold" and cmd.source_ns > self._last_source_ns:
                cur.new_plan += 1  # a publisher faster than the control steps sends 'repeat's of a new action
            if cmd.source_ns:
                self._last_source_ns = max(self._last_source_ns, cmd.source_ns)
            setattr(cur, cmd.kind, getattr(cur, cmd.kind) + 1)
            if cmd.kind == "hold":
                env = mapping.hold_env(self.env_gripper)
            else:
                env = mapping.to_env(cmd.values)
                cur.saturated += mapping.saturated(cmd.values)
                cur.rotation_ignored += mapping.rotation_ignored(cmd.values)
        self.env_gripper = float(env[3])
        self._moves.append(np.asarray(env[:3], np.float64) * mapping.metres_per_unit)
        success = bool(self.sim.step_env(env))
        cur.steps += 1
        if not (success or cur.steps >= cur.horizon):
            return None
        return self._finish(success, now_ns)

    def _finish(self, success: bool, now_ns: int) -> EpisodeResult:
        cur = self._cur
        cur.success, cur.end = success, ("success" if success else "horizon")
        cur.duration_s = (now_ns - self._t0_ns) / 1e9
        cur.ee_end = [float(v) for v in self.sim.ee_position()]
        cur.jerk_sq_mean = commanded_jerk_sq_mean(self._moves, self.control_period_s)
        self.results.append(cur)
        if self.on_result is not None:
            self.on_result(cur)
        done = len(self.results)
        if self.num_episodes and done >= self.num_episodes:
            self.finished = True
        else:
            self._begin(self.seed_start + done)
        return cur

    def summary(self) -> dict[str, Any]:
        n = len(self.results)
        ok = sum(r.success for r in self.results)
        return {"episodes": n, "successes": ok, "success_rate": ok / n if n else None,
                "rejected": dict(self.total_rejected), "finished": self.finished}


class BuiltinDriver:
    """A baseline policy inside the sim: ``offer(now_ns)`` before each control step hands the controller the
    baseline's command as if it had just been received ('expert': the scripted expert's 7-dim action for the
    current observation, kind 'fresh'; 'hold': a 'hold' command). 'external' offers nothing (the received
    actions drive). ``expert_action7()`` -> the expert's action for the sim's current state (expert.ScriptedExpert
    .action7; passed in so this module stays free of metaworld)."""

    HOLD_VALUES = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0)  # not applied: a hold keeps the gripper as it was

    def __init__(self, controller: SimController, policy: str,
                 expert_action7: Optional[Callable[[], Sequence[float]]] = None):
        if policy not in SIM_POLICIES:
            raise ValueError(f"sim_policy {policy!r} is not one of {', '.join(SIM_POLICIES)}")
        if policy == "expert" and expert_action7 is None:
            raise ValueError("sim_policy 'expert' needs the expert's action function")
        self.controller, self.policy, self.expert_action7 = controller, policy, expert_action7
        self.offered = 0

    @property
    def drives(self) -> bool:
        """True when the baseline, not the received actions, drives the arm."""
        return self.policy != "external"

    def offer(self, now_ns: Optional[int] = None) -> Optional[str]:
        """Offer this step's command (before control_step); None when accepted (or nothing to offer), else the
        rejection reason -- an expert action that fails the gate is counted like any other, never applied."""
        if self.policy == "external" or self.controller.finished:
            return None
        self.offered += 1
        if self.policy == "expert":
            return self.controller.offer("fresh", self.expert_action7(), RUNTIME_ACTION_NAMES, now_ns=now_ns)
        return self.controller.offer("hold", self.HOLD_VALUES, RUNTIME_ACTION_NAMES, now_ns=now_ns)
