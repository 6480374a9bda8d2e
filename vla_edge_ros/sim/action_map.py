"""The explicit mapping between the runtime's 7-dim action and MetaWorld's 4-dim action, and the action gate.

The runtime (engine/config.py DEFAULT_ACTION_NAMES) commands ``x y z roll pitch yaw gripper`` per control step:
an end-effector position delta in metres, a rotation delta, and the gripper with the Open X-Embodiment
convention of data/mappings.py (1 = open, 0 = closed). MetaWorld's Sawyer takes ``[dx, dy, dz, grab]`` in
[-1, 1]: each position unit moves the mocap target by ``action_scale`` metres (0.01 m in MetaWorld 3.1.1) in one
env step, and ``grab`` = +1 closes the fingers, -1 opens them. So, per control step:

    env[0:3] = clip(a[x y z] / action_scale, -1, 1)          metres -> env units (saturates at 1 cm per step)
    env[3]   = clip(1 - 2 * a[gripper], -1, 1)                open 1 -> -1 (open), closed 0 -> +1 (close)
    roll pitch yaw: not applied (MetaWorld keeps the hand's orientation fixed); a non-zero value is counted
    hold   = zero position delta, the gripper command left as it was last applied

The inverse (``from_env``) turns an expert's env action into the runtime naming, so demonstrations are recorded
exactly as the runtime will command them: it clips first (the env clips anyway), so env -> 7 -> env returns the
action the env really applied.

The gate (:func:`parse_command`) turns one received action into a command or an :class:`ActionRejected` with a
reason code -- wrong length, NaN/inf, names that are not the runtime's, an unknown kind -- so a bad action is
counted and diagnosed, never applied. Pure numpy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from vla_edge_ros.engine.config import DEFAULT_ACTION_NAMES

RUNTIME_ACTION_NAMES: tuple[str, ...] = tuple(DEFAULT_ACTION_NAMES)
X, Y, Z, ROLL, PITCH, YAW, GRIPPER = (RUNTIME_ACTION_NAMES.index(n)
                                      for n in ("x", "y", "z", "roll", "pitch", "yaw", "gripper"))
ENV_ACTION_DIMS = 4
METAWORLD_ACTION_SCALE_M = 0.01  # SawyerXYZEnv's default action_scale; the wrapper passes the env's own value
GRIPPER_OPEN = 1.0  # runtime convention (data/mappings.py): 1 = open, 0 = closed
ENV_GRIP_OPEN = -1.0  # MetaWorld: -1 opens, +1 closes

KINDS = ("fresh", "repeat", "hold")
REJECT_REASONS = ("wrong_length", "non_finite", "names_mismatch", "unknown_kind", "not_numeric")


@dataclass(frozen=True)
class ActionMapping:
    metres_per_unit: float = METAWORLD_ACTION_SCALE_M

    def __post_init__(self) -> None:
        if not (self.metres_per_unit > 0 and math.isfinite(self.metres_per_unit)):
            raise ValueError(f"metres_per_unit must be a positive number, got {self.metres_per_unit}")

    def to_env(self, action7: Sequence[float]) -> np.ndarray:
        """7-dim runtime action -> 4-dim MetaWorld action (float64, inside [-1, 1])."""
        a = _as_vector(action7, len(RUNTIME_ACTION_NAMES))
        env = np.empty(ENV_ACTION_DIMS, np.float64)
        env[:3] = a[[X, Y, Z]] / self.metres_per_unit
        env[3] = 1.0 - 2.0 * a[GRIPPER]
        return np.clip(env, -1.0, 1.0)

    def from_env(self, env4: Sequence[float]) -> np.ndarray:
        """4-dim MetaWorld action (an expert's) -> 7-dim runtime action; roll pitch yaw are 0."""
        e = np.clip(_as_vector(env4, ENV_ACTION_DIMS), -1.0, 1.0)
        a = np.zeros(len(RUNTIME_ACTION_NAMES), np.float64)
        a[[X, Y, Z]] = e[:3] * self.metres_per_unit
        a[GRIPPER] = (1.0 - e[3]) / 2.0
        return a

    @staticmethod
    def hold_env(env_gripper: float) -> np.ndarray:
        """The env action of a hold: no motion, the gripper command unchanged."""
        return np.array([0.0, 0.0, 0.0, float(env_gripper)], np.float64)

    def saturated(self, action7: Sequence[float]) -> bool:
        """True when to_env clips this action (more than one env unit per step, or a gripper outside [0, 1])."""
        a = _as_vector(action7, len(RUNTIME_ACTION_NAMES))
        raw = np.append(a[[X, Y, Z]] / self.metres_per_unit, 1.0 - 2.0 * a[GRIPPER])
        return bool(np.any(np.abs(raw) > 1.0 + 1e-9))

    @staticmethod
    def rotation_ignored(action7: Sequence[float]) -> bool:
        """True when the action asks for a rotation, which MetaWorld cannot apply."""
        a = _as_vector(action7, len(RUNTIME_ACTION_NAMES))
        return bool(np.any(np.abs(a[[ROLL, PITCH, YAW]]) > 1e-9))


def _as_vector(values: Sequence[float], n: int) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64).reshape(-1)
    if a.shape[0] != n:
        raise ValueError(f"expected {n} action values, got {a.shape[0]}")
    return a


class ActionRejected(ValueError):
    """A received action that must not be applied; ``reason`` is one of REJECT_REASONS (counted by reason)."""

    def __init__(self, reason: str, detail: str):
        assert reason in REJECT_REASONS, reason
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


def kind_of(frame_id: str) -> str:
    """The action kind carried in header.frame_id: 'fresh' | 'repeat' | 'hold' (also 'fresh:<seq>', the layout
    of the edge -> robot fresh-action topic). Raises ActionRejected('unknown_kind')."""
    kind = str(frame_id).split(":", 1)[0].strip()
    if kind not in KINDS:
        raise ActionRejected("unknown_kind", f"header.frame_id {frame_id!r} is not one of {', '.join(KINDS)}")
    return kind


def parse_command(frame_id: str, values: Sequence[float], names: Sequence[str],
                  expected_names: Sequence[str] = RUNTIME_ACTION_NAMES) -> tuple[str, np.ndarray]:
    """(kind, values float64) of one received action, or ActionRejected.

    ``names`` must equal ``expected_names`` in order; an empty ``names`` is taken positionally (as
    ros/conversions.msg_to_fresh_action does). No reordering by name: a publisher with another layout is a
    configuration error to be seen, not guessed around."""
    kind = kind_of(frame_id)
    try:
        a = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ActionRejected("not_numeric", f"values are not numbers ({exc})") from None
    expected = tuple(expected_names)
    if a.shape[0] != len(expected):
        raise ActionRejected("wrong_length", f"{a.shape[0]} values, expected {len(expected)} ({' '.join(expected)})")
    names = tuple(names)
    if names and names != expected:
        raise ActionRejected("names_mismatch", f"names {list(names)} != {list(expected)}")
    if not np.all(np.isfinite(a)):
        raise ActionRejected("non_finite", f"NaN/inf in {a.tolist()}")
    return kind, a
