"""The input-staleness state that both deciders of a tick share (core/action_arbiter.py for single actions,
core/executor.py for action chunks): the ``stale_after_ms`` threshold, the explicit stale marks (camera
liveliness lost, frozen camera, inference inactive) and the count of rejected offers by reason.

A mixin, not a component: the deciders keep one lock for all of their state, so these methods use the owner's
``_lock`` and its ``_stale_after_ns``, ``_stale_reasons``, ``rejected`` and ``last_reject_message`` attributes,
which the owner creates (under that lock's protection) before first use.
"""
from __future__ import annotations

from vla_edge_ros import params


class StaleInputs:
    # ---- configuration ----------------------------------------------------------------------------------
    def set_stale_after_ms(self, stale_after_ms: float) -> None:
        reason = params.validate("stale_after_ms", stale_after_ms)
        if reason:
            raise ValueError(reason)
        with self._lock:
            self._stale_after_ns = int(round(float(stale_after_ms) * 1e6))

    @property
    def stale_after_ms(self) -> float:
        return self._stale_after_ns / 1e6

    # ---- inputs -----------------------------------------------------------------------------------------
    def _reject(self, reason: str, message: str) -> bool:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.last_reject_message = message
        return False

    def mark_inputs_stale(self, reason: str) -> None:
        """Force hold until ``clear_stale(reason)`` (several reasons may be active at once)."""
        with self._lock:
            self._stale_reasons[reason] = self._stale_reasons.get(reason, 0) + 1

    def clear_stale(self, reason: str) -> None:
        with self._lock:
            self._stale_reasons.pop(reason, None)

    @property
    def stale_reasons(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._stale_reasons)
