"""When the inference loop starts the next action chunk, and by when that chunk must be in (pure, no clock).

A chunk holds H actions, one per control period ``step`` (the loop's cycle period); the action publisher's
executor (core/executor.py) plays it while the next one is computed. Times are the loop's monotonic ns; the
"executing chunk" is the last one the loop delivered, and its cycle start stands for the time of its frame.

* Start (the controller decides when): the next chunk is started once the executing one has played
  ``execution_horizon_steps`` (e) of its steps, at the first cycle start >= its cycle start + e * step.
  e = 1, always so for H = 1, is every cycle: the single-step loop. e = H is synchronous chunks (a chunk is
  played to its end, then the next one is computed). 0 is the default, ceil(H / 2): the next chunk starts when
  half of the executing one is left (LeRobot's asynchronous inference uses the same 0.5 threshold).
* Deadline: with overlap (e < H) the executing chunk, started e steps before this cycle, still has H - e steps
  after it: the new chunk is in time until the executing one runs out, cycle start + (H - e) * step; never less
  than the single-step deadline, cycle start + ``deadline_ms``. Without overlap (e = H, and always for H = 1)
  nothing but the repeated last step covers the latency: the cycle deadline applies, exactly as in single-step
  mode. The admission controller then compares the chunk's estimate with the time left to that deadline minus
  the safety margin, as before.
* The deadline is that of a chunk on schedule. After a refused or late chunk (or a hold) the executing chunk is
  older and runs out sooner, or has already: the next chunk keeps the whole allowance all the same, because
  refusing it for that would leave the arm without a plan for longer still (and, with nothing executing, no
  chunk slower than ``deadline_ms`` could ever start).
* A frame is stamped at or before its cycle start, and the executor times the steps by that stamp, so the real
  run-out is earlier than modelled here by the frame's age when the cycle started (up to one camera period):
  the safety margin covers it.
"""
from __future__ import annotations

from typing import Any, Optional


def horizon_problem(horizon: Any, execution_horizon_steps: Any) -> Optional[str]:
    """Why (H, e) is not a valid pair (None when it is): H >= 1, 0 <= e <= H, integers."""
    for name, v, lo in (("action_horizon", horizon, 1), ("execution_horizon_steps", execution_horizon_steps, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            return f"{name} must be an integer >= {lo}, got {v!r}"
    if execution_horizon_steps > horizon:
        return (f"execution_horizon_steps={execution_horizon_steps} exceeds the checkpoint's action_horizon "
                f"{horizon}: a chunk has only {horizon} step(s) to execute")
    return None


class ChunkSchedule:
    """Start and deadline of chunks of ``horizon`` steps. Not thread-safe: the loop's own thread uses it."""

    def __init__(self, horizon: int = 1, execution_horizon_steps: int = 0) -> None:
        problem = horizon_problem(horizon, execution_horizon_steps)
        if problem:
            raise ValueError(problem)
        self.horizon = int(horizon)
        self.execution_horizon_steps = int(execution_horizon_steps)

    def set_execution_horizon(self, steps: int) -> None:
        problem = horizon_problem(self.horizon, steps)
        if problem:
            raise ValueError(problem)
        self.execution_horizon_steps = int(steps)

    @property
    def execution_steps(self) -> int:
        """e as used: the parameter, or ceil(H / 2) for 0."""
        return self.execution_horizon_steps or -(-self.horizon // 2)

    @property
    def overlaps(self) -> bool:
        """The next chunk starts while the executing one still has steps left (e < H)."""
        return self.overlap_steps > 0

    def due(self, cycle_start_ns: int, executing_start_ns: Optional[int], step_ns: int) -> bool:
        """Start a chunk in the cycle starting at ``cycle_start_ns``? Always when nothing is executing or e = 1;
        else once e steps of the executing chunk (started at ``executing_start_ns``) have been played. Half a
        step of slack rounds to the nearest cycle: a restarted grid (a new period) does not skip one."""
        if executing_start_ns is None or self.execution_steps == 1:
            return True
        step = int(step_ns)
        return int(cycle_start_ns) >= int(executing_start_ns) + self.execution_steps * step - step // 2

    @property
    def overlap_steps(self) -> int:
        """Steps the executing chunk (on schedule) still has when the next one starts: H - e."""
        return self.horizon - self.execution_steps

    def deadline_ms(self, deadline_ms: float, step_ms: float) -> float:
        """Time from a cycle start to its chunk's deadline, in ms (what ``deadline_ns`` adds)."""
        return max(float(deadline_ms), self.overlap_steps * float(step_ms))

    def deadline_ns(self, cycle_start_ns: int, deadline_ms: float, step_ns: int) -> int:
        """Deadline of a chunk started in the cycle beginning at ``cycle_start_ns`` (module docstring): the
        cycle's ``deadline_ms`` (CycleClock.deadline_ns's formula), or with overlap the run-out of the executing
        chunk on schedule, whichever is later."""
        floor = int(cycle_start_ns) + int(round(float(deadline_ms) * 1e6))
        return max(floor, int(cycle_start_ns) + self.overlap_steps * int(step_ns))

    def stats(self) -> dict[str, Any]:
        return {"action_horizon": self.horizon, "execution_horizon_steps": self.execution_horizon_steps,
                "execution_steps": self.execution_steps, "overlap_steps": self.overlap_steps}
