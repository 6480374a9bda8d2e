"""1 Hz ``/diagnostics`` (diagnostic_msgs/DiagnosticArray) aggregating the figures of every node in the process.

One DiagnosticStatus per concern, so ``rqt_robot_monitor`` / ``ros2 topic echo /diagnostics`` show:
- ``vla_camera: ingest``     frames received / accepted / dropped (overwritten unread) / rejected by reason,
                             frame rate, QoS deadline misses, liveliness, frozen flag, callback cost p99;
- ``vla_inference: engine``  lifecycle state, backend, chunks admitted / refused / deadline misses, latency
                             p50/p95/p99, fresh rate, KV occupancy / budget / policy, VRAM, last error (and its
                             age), chunk in-flight time, loop errors / engine resets / late-discarded chunks.
                             Level: see ``inference_health`` (ERROR for ERROR_HOLD_S after a chunk fault, then
                             WARN "recovered" until RECOVERED_WARN_S, then OK; a failed transition stays ERROR;
                             a chunk in flight past deadline_ms WARN, past HUNG_CHUNK_MS ERROR);
- ``vla_action: publisher``  fresh / repeat(fallback) / hold rates and counts, timer period error, missed ticks;
- ``vla_runtime: memory``    RSS now and peak.
The fleet edge (ros/fleet_node.py) publishes ``vla_inference: engine`` for the fleet (``fleet_status``) and, per
robot ``<ns>``, ``vla_camera: ingest [<ns>]`` and ``vla_inference: robot [<ns>]`` (``fleet_robot_status``).
The building of statuses is separate from the timer (pure functions of the snapshot dicts) so tests can check
levels and keys without spinning anything.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.node import Node

from vla_edge_ros.core.metrics import current_rss_mb, peak_rss_mb
from vla_edge_ros.ros import conversions, qos

OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR
HUNG_CHUNK_MS = 1000.0  # a chunk in flight this long is reported as hung


def _status(name: str, level: int, message: str, values: dict[str, Any]) -> DiagnosticStatus:
    st = DiagnosticStatus()
    st.level = level
    st.name = name
    st.message = message
    st.hardware_id = "vla_edge_ros"
    st.values = conversions.key_values(values)
    return st


def _fmt(x: Any) -> Any:
    return "nan" if isinstance(x, float) and math.isnan(x) else x


def camera_status(s: dict[str, Any]) -> DiagnosticStatus:
    """WARN while the camera is stalled or frozen, has sent nothing, or had frames rejected / frozen within the
    recent window (``window_s``, kept by core.camera_health): it returns to OK by itself once the window is
    clean; the all-time counts (``frames_rejected``, ``rejected.<reason>``, ``frozen_events``) stay in the
    values. A snapshot without the window figures (an older producer) is judged on the all-time count."""
    window_s = s.get("window_s")
    recent = s.get("rejected_recent", s["rejected"])
    recent_by_reason = s.get("rejected_recent_by_reason", s["rejected_by_reason"])
    values = {
        "frames_received": s["received"], "frames_accepted": s["accepted"], "frames_dropped": s["dropped"],
        "frames_rejected": s["rejected"], "frame_rate_hz": s["rate_hz"],
        "qos_deadline_missed": s["deadline_missed"], "liveliness_lost": s["liveliness_lost"],
        "stalled": s["stalled"], "frozen": s["frozen"], "qos_mode": s["qos_mode"],
        "callback_ms_p99": _fmt(s["callback_ms"]["p99"]),
    }
    for reason, n in sorted(s["rejected_by_reason"].items()):
        values[f"rejected.{reason}"] = n
    if window_s is not None:
        age = s.get("last_rejection_age_s")
        values.update({"window_s": window_s, "frames_rejected_recent": recent,
                       "rejection_rate_hz": round(float(s.get("rejection_rate_hz", 0.0)), 3),
                       "last_rejection_age_s": "" if age is None else round(float(age), 1),
                       "last_rejection": s.get("last_rejection", "")})
        for key in ("frozen_events", "frozen_frames_recent", "frozen_unchanged_s", "typical_hold_ms",
                    "duplicate_frames"):
            if key in s:
                values[key] = "" if s[key] is None else s[key]
    problems = [w for w, bad in (("stalled", s["stalled"]), ("no frames", s["received"] == 0)) if bad]
    if s["frozen"]:
        unchanged = s.get("frozen_unchanged_s")
        problems.append("frozen" + (f" (picture unchanged for {unchanged:.1f} s)" if unchanged else ""))
    elif s.get("frozen_frames_recent"):
        problems.append(f"was frozen within the last {window_s:g} s")
    if recent:
        top = ", ".join(f"{r} {n}" for r, n in sorted(recent_by_reason.items(), key=lambda kv: -kv[1])[:3])
        if window_s is None:
            problems.append(f"{recent} frames rejected ({top})")
        else:
            problems.append(f"{recent} frames rejected in the last {window_s:g} s "
                            f"({float(s.get('rejection_rate_hz', 0.0)):.1f}/s: {top})")
    return _status("vla_camera: ingest", WARN if problems else OK, ", ".join(problems) or "ok", values)


# A chunk fault (exception, out-of-memory, KV change refused) keeps the inference status at ERROR for
# ERROR_HOLD_S after the last one, then WARN "recovered; last error: ..." until RECOVERED_WARN_S after it, then OK
# again (the error text and the counters stay in the values). A failed lifecycle transition is "sticky": ERROR
# until the next successful transition (a configure also clears chunk faults: new engine), because the node is
# then not doing what was asked of it.
ERROR_HOLD_S = 5.0
RECOVERED_WARN_S = 60.0


def inference_health(state: str, last_error: str = "", last_error_age_s: Optional[float] = None,
                     error_sticky: bool = True, in_flight_ms: float = 0.0, deadline_ms: float = math.nan,
                     error_hold_s: float = ERROR_HOLD_S, recovered_warn_s: float = RECOVERED_WARN_S,
                     hung_chunk_ms: float = HUNG_CHUNK_MS, estimate_ms: Optional[float] = None,
                     budget_ms: Optional[float] = None) -> tuple[int, str]:
    """(level, message) of the inference status; a pure function of the node's figures so it is unit-tested.

    Order: a chunk in flight longer than ``hung_chunk_ms`` (ERROR: Python cannot pre-empt it, but it can say so);
    a sticky (transition) error or a chunk error younger than ``error_hold_s`` (ERROR); a chunk in flight longer
    than ``deadline_ms`` (WARN: it will miss its deadline, maybe hung); a chunk error younger than
    ``recovered_warn_s`` (WARN "recovered; last error: ..."); the node active with an admission estimate above
    ``budget_ms`` (deadline_ms - safety_margin_ms, the most time a chunk can get: WARN, every chunk is refused and
    the robot repeats / holds until the estimate comes down); the node not active (WARN); else OK.
    ``last_error_age_s`` None with an error text is treated as sticky (no time known: do not downgrade)."""
    in_flight_ms = float(in_flight_ms or 0.0)
    if in_flight_ms > hung_chunk_ms:
        return ERROR, f"chunk running for {in_flight_ms:.0f} ms (hung?)"
    recent = recovered = False
    if last_error:
        if error_sticky or last_error_age_s is None or last_error_age_s < error_hold_s:
            recent = True
        elif last_error_age_s < recovered_warn_s:
            recovered = True
    if recent:
        return ERROR, last_error
    if math.isfinite(deadline_ms) and in_flight_ms > deadline_ms:
        return WARN, f"chunk in flight for {in_flight_ms:.0f} ms, past deadline_ms={deadline_ms:g}"
    if recovered:
        return WARN, f"recovered {last_error_age_s:.0f} s ago; last error: {last_error}"
    if (state == "active" and estimate_ms is not None and budget_ms is not None and math.isfinite(budget_ms)
            and estimate_ms > budget_ms):
        return WARN, (f"chunk estimate {estimate_ms:.1f} ms > {budget_ms:.1f} ms (deadline_ms - safety_margin_ms): "
                      "chunks refused, the robot repeats / holds")
    if state != "active":
        return WARN, f"inference {state}"
    return OK, "active"


def inference_status(s: dict[str, Any]) -> DiagnosticStatus:
    lat = s.get("latency_ms", {})
    kv = s.get("kv", {})
    loop = s.get("loop") or {}
    values = {
        "state": s.get("state", "?"), "backend": s.get("backend", "?"),
        "chunks_admitted": s.get("admitted", 0), "chunks_refused": s.get("refused", 0),
        "deadline_misses": s.get("deadline_misses", 0), "fresh_rate_hz": s.get("fresh_rate_hz", 0.0),
        "latency_ms_p50": _fmt(lat.get("p50", math.nan)), "latency_ms_p95": _fmt(lat.get("p95", math.nan)),
        "latency_ms_p99": _fmt(lat.get("p99", math.nan)),
        "kv_policy": kv.get("policy", "?"), "kv_budget_tokens": kv.get("budget_tokens", 0),
        "kv_occupancy_tokens": kv.get("occupancy_tokens", 0),
        "kv_max_occupancy_tokens": kv.get("max_occupancy_tokens", 0),
        "vram_mb": _fmt(s.get("vram_mb", math.nan)), "peak_vram_mb": _fmt(s.get("peak_vram_mb", math.nan)),
        "last_error": s.get("last_error", ""),
    }
    age = s.get("last_error_age_s")
    values["last_error_age_s"] = "" if age is None else float(age)
    # The loop's own counters: a hung chunk is visible while it runs (in-flight time), faults after it.
    in_flight = float(loop.get("in_flight_ms", 0.0) or 0.0)
    deadline_ms = s.get("deadline_ms")
    if deadline_ms is None:
        deadline_ms = (loop.get("admission") or {}).get("deadline_ms", math.nan)
    deadline_ms = math.nan if deadline_ms is None else float(deadline_ms)
    values["chunk_in_flight_ms"] = in_flight
    values["deadline_ms"] = _fmt(deadline_ms)
    values["loop_errors"] = loop.get("errors", 0)
    values["engine_resets"] = loop.get("engine_resets", 0)
    values["late_discarded"] = loop.get("late_discarded", 0)
    fit = loop.get("deadline_fit") or {}
    values["chunk_estimate_ms"] = _fmt(fit["estimate_ms"] if fit.get("estimate_ms") is not None else math.nan)
    values["chunk_budget_ms"] = _fmt(fit.get("budget_ms", math.nan))
    level, msg = inference_health(s.get("state", "?"), s.get("last_error", ""), age,
                                  bool(s.get("last_error_sticky", True)), in_flight, deadline_ms,
                                  estimate_ms=fit.get("estimate_ms"), budget_ms=fit.get("budget_ms"))
    return _status("vla_inference: engine", level, msg, values)


def action_status(s: dict[str, Any]) -> DiagnosticStatus:
    r = s["rates_hz"]
    values = {
        "fresh_rate_hz": r["fresh"], "fallback_rate_hz": r["repeat"], "hold_rate_hz": r["hold"],
        "ticks_fresh": s["ticks"]["fresh"], "ticks_repeat": s["ticks"]["repeat"], "ticks_hold": s["ticks"]["hold"],
        "timer_period_error_ms_p50": _fmt(s["timer_period_error_ms"]["p50"]),
        "timer_period_error_ms_p99": _fmt(s["timer_period_error_ms"]["p99"]),
        "missed_ticks": s["missed_ticks"], "action_rate_hz": s["action_rate_hz"],
        "stale_after_ms": s["stale_after_ms"],
        "stale_reasons": ",".join(s["arbiter"]["stale_reasons"]),
        "chunks_rejected": s.get("chunks_rejected", 0),  # bad shape, NaN/inf, future stamp, reordered, by reason:
        **{f"chunks_rejected.{k}": n for k, n in sorted(s.get("chunks_rejected_by_reason", {}).items())},
    }
    holding = r["hold"] > 0.0 and r["fresh"] == 0.0
    return _status("vla_action: publisher", WARN if holding else OK, "holding" if holding else "ok", values)


def robot_camera_status(ns: str, s: dict[str, Any]) -> DiagnosticStatus:
    """A fleet robot's camera (ros/fleet_node.py): ``camera_status`` named after the robot."""
    st = camera_status(s)
    st.name = f"vla_camera: ingest [{ns}]"
    proc = s.get("process")  # the cameras' own process (ros/fleet_cameras.py): down means no frames at all
    if proc:
        st.values += conversions.key_values({f"camera_process_{k}": "" if v is None else v for k, v in proc.items()})
        if not proc.get("alive"):
            st.level = ERROR
            st.message = (f"camera process not running ({proc.get('last_exit') or 'not started'}; restarts "
                          f"{proc.get('restarts', 0)})")
    return st


def fleet_status(s: dict[str, Any]) -> DiagnosticStatus:
    """The fleet edge as a whole (FleetNode.snapshot), under the single engine's name and level rules
    (``inference_health``), with the batch figures: passes, sizes, refusals by reason, starvation promotions."""
    loop = s.get("loop") or {}
    totals = loop.get("totals") or {}
    sched = (loop.get("scheduler") or {}).get("fleet") or {}
    pass_ms = loop.get("pass_ms") or {}
    fit = s.get("deadline_fit") or {}
    deadline_ms = float(s.get("deadline_ms", math.nan))
    robots, served = s.get("robot_namespaces", []), len(loop.get("robots") or {})
    values = {
        "state": s.get("state", "?"), "backend": s.get("backend", "?"), "robots": ",".join(robots),
        "robots_served": served, "chunks_admitted": s.get("admitted", 0), "chunks_refused": s.get("refused", 0),
        "refused_deadline": totals.get("refused_deadline", 0), "refused_capacity": totals.get("refused_capacity", 0),
        "starvation_promotions": sched.get("starvation_promotions", 0),
        "longest_refusal_streak": sched.get("longest_refusal_streak", 0),
        "deadline_misses": s.get("deadline_misses", 0), "late_discarded": totals.get("late_discarded", 0),
        "fresh_rate_hz": s.get("fresh_rate_hz", 0.0), "batches": loop.get("batches", 0),
        "batch_sizes": " ".join(f"{k}:{n}" for k, n in (loop.get("batch_sizes") or {}).items()),
        "pass_ms_p50": _fmt(pass_ms.get("p50", math.nan)), "pass_ms_p99": _fmt(pass_ms.get("p99", math.nan)),
        "batch_failures": loop.get("batch_failures", 0), "cycle_overruns": loop.get("cycle_overruns", 0),
        "engine_resets": loop.get("engine_resets", 0), "loop_errors": loop.get("loop_errors", 0),
        "chunk_in_flight_ms": float(s.get("in_flight_ms", 0.0) or 0.0), "deadline_ms": _fmt(deadline_ms),
        "chunk_estimate_ms": _fmt(fit["estimate_ms"] if fit.get("estimate_ms") is not None else math.nan),
        "chunk_budget_ms": _fmt(fit.get("budget_ms", math.nan)),
        "kv_budget_tokens": (s.get("kv") or {}).get("budget_tokens", 0), "last_error": s.get("last_error", ""),
    }
    age = s.get("last_error_age_s")
    values["last_error_age_s"] = "" if age is None else float(age)
    level, msg = inference_health(s.get("state", "?"), s.get("last_error", ""), age,
                                  bool(s.get("last_error_sticky", True)), values["chunk_in_flight_ms"], deadline_ms,
                                  estimate_ms=fit.get("estimate_ms"), budget_ms=fit.get("budget_ms"))
    if level == OK:
        msg = f"active: {served}/{len(robots)} robots served"
    return _status("vla_inference: engine", level, msg, values)


def fleet_robot_status(ns: str, r: dict[str, Any], state: str) -> DiagnosticStatus:
    """One robot of the fleet edge (FleetNode.robot_snapshot). ERROR: not served while the fleet is active (its
    KV cache could not be allocated) or a fault of its own within ERROR_HOLD_S; WARN: the fleet not active, no
    fresh action for it within the last second (with the cause: its camera stalled or silent, its chunks
    refused), or recovered from a fault within RECOVERED_WARN_S; else OK with its fresh rate. Only its own
    figures decide: another robot's trouble never changes this status."""
    loop, sch, cam = r.get("loop") or {}, r.get("scheduler") or {}, r.get("camera") or {}
    lat, f2a = loop.get("latency_ms") or {}, r.get("frame_to_action_ms") or {}
    values = {
        "robot": ns, "served": r.get("served", False), "fresh_actions": r.get("fresh_actions", 0),
        "fresh_rate_hz": r.get("fresh_rate_hz", 0.0), "fresh_action_topic": r["topics"]["fresh_action_topic"],
        "camera_topic": r["topics"]["camera_topic"], "camera_rate_hz": cam.get("rate_hz", 0.0),
        "camera_stalled": cam.get("stalled", False),
        **{k: loop.get(k, 0) for k in ("frames_taken", "admitted", "deadline_misses", "late_discarded", "errors",
                                         "bad_frames", "refused_deadline", "refused_capacity")},
        **{k: sch.get(k, 0) for k in ("starvation_promotions", "refusal_streak", "longest_refusal_streak")},
        "latency_ms_p50": _fmt(lat.get("p50", math.nan)), "latency_ms_p99": _fmt(lat.get("p99", math.nan)),
        "frame_to_action_ms_p99": _fmt(f2a.get("p99", math.nan)),
        "kv_occupancy_tokens": (r.get("kv") or {}).get("occupancy_tokens", 0),
        "kv_budget_tokens": (r.get("kv") or {}).get("budget_tokens", 0), "last_error": r.get("last_error", ""),
    }
    age = r.get("last_error_age_s")
    values["last_error_age_s"] = "" if age is None else float(age)
    streak = int(sch.get("refusal_streak", 0) or 0)
    if state == "active" and not r.get("served"):
        level, msg = ERROR, f"not served: {r.get('last_error') or 'not added'}"
    elif r.get("last_error") and (age is None or age < ERROR_HOLD_S):
        level, msg = ERROR, r["last_error"]
    elif state != "active":
        level, msg = WARN, f"inference {state}"
    elif not r.get("fresh_rate_hz"):  # nothing delivered within the last second: say why, its robot holds
        why = ("camera stalled" if cam.get("stalled") else "no camera frames" if not cam.get("rate_hz")
               else f"refused {streak} cycles in a row" if streak else "no chunk delivered")
        level, msg = WARN, f"no fresh actions: {why}"
    elif r.get("last_error") and age < RECOVERED_WARN_S:
        level, msg = WARN, f"recovered {age:.0f} s ago; last error: {r['last_error']}"
    else:
        level, msg = OK, f"fresh {float(r.get('fresh_rate_hz', 0.0)):.1f} Hz"
    return _status(f"vla_inference: robot [{ns}]", level, msg, values)


def memory_status(extra: Optional[dict[str, Any]] = None) -> DiagnosticStatus:
    values = {"rss_mb": current_rss_mb(), "peak_rss_mb": peak_rss_mb(), **(extra or {})}
    return _status("vla_runtime: memory", OK, "ok", values)


class DiagnosticsPublisher:
    """Publishes the aggregate at ``period_s`` from a timer on ``node`` (whose executor is otherwise idle)."""

    def __init__(self, node: Node, sources: list[Callable[[], DiagnosticStatus]], period_s: float = 1.0,
                 topic: str = "/diagnostics", before_build: Optional[Callable[[], Any]] = None):
        """``before_build``: called first every period (the fleet edge waits there for a gap between passes)."""
        self.node = node
        self.sources = list(sources)
        self.before_build = before_build
        self.errors = 0
        self._pub = node.create_publisher(DiagnosticArray, topic, qos.reliable_qos())
        self._timer = node.create_timer(period_s, self.publish_now)

    def build(self) -> DiagnosticArray:
        arr = DiagnosticArray()
        arr.header.stamp = self.node.get_clock().now().to_msg()
        for src in self.sources:
            try:
                arr.status.append(src())
            except Exception as exc:  # one broken figure must not hide the others
                self.errors += 1
                arr.status.append(_status(f"vla_runtime: diagnostics ({getattr(src, '__name__', src)})", ERROR,
                                          f"collecting failed: {exc!r}", {}))
        return arr

    def publish_now(self) -> None:
        if self.before_build is not None:
            self.before_build()
        self._pub.publish(self.build())

    def destroy(self) -> None:
        self.node.destroy_timer(self._timer)
        self.node.destroy_publisher(self._pub)
