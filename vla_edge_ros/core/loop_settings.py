"""The live settings the inference loop takes (``InferenceLoop.update``) and their checks, apart from the loop.

Why a module of its own: the checks are pure (values in, reasons out) while applying a change belongs to the
loop's thread; keeping them here keeps core/inference_loop.py about running chunks. A change is validated when
it is requested (a ValueError naming every reason; the ROS parameter callback refuses with it) and applied by
the loop at the start of its next cycle. Cross checks against the loop's current state (deadline vs safety
margin, the KV budget vs the engine's prefix) stay in ``InferenceLoop.update``, which has that state.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from vla_edge_ros import params
from vla_edge_ros.core.chunk_schedule import horizon_problem

ADMISSION_KEYS = ("deadline_ms", "safety_margin_ms", "ema_alpha", "cost_quantile")
LOOP_KEYS = ("saliency_threshold", "period_ms", "step_ms", "late_discard_ms", "execution_horizon_steps")
KV_KEYS = ("kv_budget_tokens", "eviction_policy", "window_frames")  # applied by engine.apply_kv_changes
LIVE_KEYS = ADMISSION_KEYS + LOOP_KEYS + KV_KEYS  # everything update() takes


def check_loop_values(values: Mapping[str, Any], horizon: int = 1) -> None:
    """ValueError with the reasons when a loop setting is bad (``horizon``: the chunk's action_horizon)."""
    reasons = []
    for k, v in values.items():
        if k == "saliency_threshold":
            r = params.validate(k, v)
            if r:
                reasons.append(r)
        elif k in ("period_ms", "step_ms", "late_discard_ms"):
            try:
                fv = float(v)
            except (TypeError, ValueError):
                fv = math.nan
            if isinstance(v, bool) or not (math.isfinite(fv) and fv > 0.0):
                reasons.append(f"{k} must be a positive number of ms, got {v!r}")
        elif k == "execution_horizon_steps":
            r = horizon_problem(horizon, v)
            if r:
                reasons.append(r)
        elif k == "force_committed_steps" and not isinstance(v, bool):  # read-only: the constructor's
            reasons.append(f"force_committed_steps must be true or false, got {v!r}")
    if reasons:
        raise ValueError("; ".join(reasons))


def check_live_values(values: Mapping[str, Any], horizon: int = 1) -> None:
    """Every per-value check of an ``update``: known keys, the registry's types and ranges, the loop's own."""
    unknown = [k for k in values if k not in LIVE_KEYS]
    if unknown:
        raise ValueError(f"InferenceLoop.update: unknown parameter(s) {', '.join(unknown)}")
    reasons = [r for k, v in values.items() if k in ADMISSION_KEYS + KV_KEYS and (r := params.validate(k, v))]
    if reasons:
        raise ValueError("; ".join(reasons))
    check_loop_values({k: v for k, v in values.items() if k in LOOP_KEYS}, horizon)
