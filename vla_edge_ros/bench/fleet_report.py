"""The fleet replay's figures (bench/fleet_replay.py runs the processes): per robot and edge figures over the
measured window from the stats files the processes write, the verdict against issue 24's acceptance, and the
markdown table. Pure functions of dicts, tested without ROS (test/test_fleet_replay.py)."""
from __future__ import annotations

from typing import Any, Optional

from vla_edge_ros.bench import host_load
from vla_edge_ros.bench.sweep import _get, _rate
from vla_edge_ros.core.metrics import window_percentiles
from vla_edge_ros.core.pass_profile import describe as describe_passes, window as profile_window

MISS_LIMIT = 0.001  # the acceptance: every robot's deadline-miss rate <= 0.1 %
TICK_KINDS = ("fresh", "repeat", "hold")


def edge_robot(edge: dict, ns: str) -> dict[str, Any]:
    """One robot's counters in the edge's stats (ros/runtime.py ``robots`` + the fleet loop's per-robot entry)."""
    top = _get(edge, "robots", ns, default={}) or {}
    loop = _get(edge, "inference", "robots", ns, "loop", default={}) or {}
    refused = sum(int(v or 0) for k, v in loop.items() if k.startswith("refused_")) if loop else \
        int(top.get("refused_deadline", 0) or 0) + int(top.get("refused_capacity", 0) or 0)
    return {"admitted": int(loop.get("admitted", top.get("admitted", 0)) or 0), "refused": refused,
            "deadline_misses": int(loop.get("deadline_misses", top.get("deadline_misses", 0)) or 0),
            "late_discarded": int(loop.get("late_discarded", 0) or 0), "errors": int(loop.get("errors", 0) or 0),
            "fresh_actions": int(top.get("fresh_actions", 0) or 0),
            "frames_received": int(top.get("frames_received", 0) or 0)}


def counter_delta(end: dict, start: Optional[dict]) -> dict:
    return {k: v - int((start or {}).get(k, 0) or 0) for k, v in end.items()}


def _window_count(end: Any, start: Any) -> Optional[int]:
    """``end - start`` of a counter (start absent: 0), None when the end is unknown."""
    return None if end is None else int(end) - int(start or 0)


def _ticks(robot_stats: Optional[dict]) -> dict[str, int]:
    t = (robot_stats or {}).get("ticks") or {}
    return {k: int(t.get(k, 0) or 0) for k in TICK_KINDS}


def _window_ms(end: Optional[dict], start: Optional[dict], hist: str, ring: str) -> dict[str, Any]:
    """p50 / p99 / max (and the sample count) of the window from the edge's cumulative histogram ``hist``
    (core/metrics.window_percentiles); an edge without it: its ring ``ring`` of recent samples, marked
    ``"whole_run": True``."""
    if isinstance((end or {}).get(hist), dict):
        return {**window_percentiles(end[hist], (start or {}).get(hist)), "whole_run": False}
    r = (end or {}).get(ring) or {}
    return {"count": r.get("count"), "p50": r.get("p50"), "p99": r.get("p99"), "max": r.get("max"), "whole_run": True}


def _batch_sizes(end: Optional[dict], start: Optional[dict]) -> dict[str, int]:
    got = counter_delta({k: int(v or 0) for k, v in ((end or {}).get("batch_sizes") or {}).items()},
                 (start or {}).get("batch_sizes"))
    return {k: v for k, v in sorted(got.items(), key=lambda kv: int(kv[0])) if v}


def _cost_model(edge: dict, steps: Optional[int]) -> dict[str, Any]:
    """The cost model's parts per batch size as the window ended (core/fleet_scheduler.BatchCostModel)."""
    sizes = _get(edge, "inference", "loop", "scheduler", "cost", "by_batch_size", default={}) or {}
    out = {}
    for k, c in sizes.items():
        parts = {"prefill_ms": c.get("prefill_ema_ms"), "decode_ms_per_step": c.get("decode_ema_ms_per_step"),
                 "host_ms": c.get("host_ema_ms"), "spread_ms": c.get("spread_ms"), "samples": c.get("samples")}
        if steps and None not in (parts["prefill_ms"], parts["decode_ms_per_step"], parts["spread_ms"]):
            parts["estimate_ms"] = (parts["prefill_ms"] + steps * parts["decode_ms_per_step"]
                                    + (parts["host_ms"] or 0.0) + parts["spread_ms"])
        out[k] = parts
    return out


def summarise(ns: list[str], edge_start: dict, edge_end: dict, robots_start: dict, robots_end: dict,
              replays: Optional[dict] = None, kv_peak: Optional[dict] = None, edge_final: Optional[dict] = None,
              edge_cpu: Optional[dict] = None) -> dict[str, Any]:
    """Per robot and edge figures over the window. ``edge_start`` / ``edge_end``: the edge's stats as the window
    opened / closed: counters are ``end - start``, latencies and pass times the window's percentiles (from the
    edge's cumulative histograms). ``edge_final``: its last stats, after it stopped (memory figures, whole-run
    totals; default ``edge_end``). ``robots_*``: ns -> the robot process's stats at the window's start / end;
    ``replays``: ns -> the replay's stats; ``kv_peak``: ns -> the largest KV bytes sampled; ``edge_cpu``: the edge
    process's CPU time over the window (``cpu_s``, ``window_s``)."""
    final = edge_final if edge_final else edge_end
    mem = _get(final, "inference", "engine_memory", default={}) or {}
    per_kv = mem.get("per_robot_kv_bytes") or {}
    backend = final.get("backend") or edge_end.get("backend")
    robots = {}
    for name in ns:
        c = counter_delta(edge_robot(edge_end, name), edge_robot(edge_start, name))
        t = counter_delta(_ticks(robots_end.get(name)), _ticks(robots_start.get(name)))
        n_ticks = sum(t.values())
        loop_path = ("inference", "robots", name, "loop")
        lat = _window_ms(_get(edge_end, *loop_path, default={}), _get(edge_start, *loop_path, default={}),
                         "latency_hist", "latency_ms")
        kv = [x for x in ((kv_peak or {}).get(name), per_kv.get(name)) if x is not None]
        missed_end = _get(robots_end.get(name), "action", "missed_ticks")
        robots[name] = {**c, "miss_rate": _rate(c["deadline_misses"], c["admitted"]),
                        "latency_ms": lat, "ticks": t,
                        "fresh_share": _rate(t["fresh"], n_ticks),
                        # the action timer's skipped grid points: in the window, and since the robot started
                        "missed_ticks": _window_count(missed_end, _get(robots_start.get(name), "action",
                                                                       "missed_ticks")),
                        "missed_ticks_total": missed_end,
                        "frames_published": _get((replays or {}).get(name), "camera_ticks"),  # whole replay
                        "frames_received_total": edge_robot(final, name)["frames_received"],  # whole run
                        "kv_bytes": max(kv) if kv else None, "kv_max_occupancy_tokens":
                            _get(final, "inference", "robots", name, "kv", "max_occupancy_tokens")}
    loop = _get(edge_end, "inference", "loop", default={}) or {}
    loop0 = _get(edge_start, "inference", "loop", default={}) or {}
    cpu = dict(edge_cpu) if edge_cpu else {}
    if cpu.get("window_s"):
        cpu["cpu_s_per_s"] = cpu["cpu_s"] / cpu["window_s"]
        if cpu.get("children_cpu_s") is not None:
            cpu["children_cpu_s_per_s"] = cpu["children_cpu_s"] / cpu["window_s"]
    wall = (edge_end.get("wall_s") or 0.0) - (edge_start.get("wall_s") or 0.0)
    if "thread_cpu_s" in loop and wall > 0:  # the loop thread's own share (the rest: executors, DDS, main)
        cpu["loop_thread_cpu_s_per_s"] = (loop["thread_cpu_s"] - (loop0.get("thread_cpu_s") or 0.0)) / wall
    steps = _get(edge_end, "inference", "loop", "scheduler", "fleet", "decode_steps")
    edge = {"backend": backend,
            "memory_kind": "VRAM" if backend == "cuda" else f"host memory ({backend or '?'} backend, no VRAM)",
            "weight_bytes": mem.get("weight_bytes"), "engine_peak_bytes": mem.get("peak_bytes"),
            "kv_bytes": mem.get("kv_bytes"), "peak_vram_mb": _get(final, "memory", "peak_vram_mb"),
            "peak_rss_mb": _get(final, "memory", "peak_rss_mb"), "batch_sizes": _batch_sizes(loop, loop0),
            "pass_ms": _window_ms(loop, loop0, "pass_hist", "pass_ms"),
            "host_ms": _window_ms(loop, loop0, "host_hist", "host_ms"),
            "cycle_overruns": counter_delta({"n": int(loop.get("cycle_overruns") or 0)},
                                     {"n": loop0.get("cycle_overruns")})["n"],
            "batch_failures": counter_delta({"n": int(loop.get("batch_failures") or 0)},
                                     {"n": loop0.get("batch_failures")})["n"],
            "cost_model": _cost_model(edge_end, steps),
            "pass_profile": _pass_profile(loop, loop0),
            "cpu": cpu or None,
            "kv_budget_tokens": _get(final, "kv", "budget_tokens"),
            "deadline_ms": _get(final, "inference", "deadline_ms"),
            "missing": [k for k in ("per_robot_kv_bytes", "weight_bytes", "peak_bytes") if k not in mem]}
    return {"robots": robots, "edge": edge, "verdict": verdict(robots)}


def settle_figures(ns: list[str], before: dict, after: dict, seconds: float) -> dict[str, Any]:
    """What the edge counted in the settle period before the window (``--settle-s``: frames already flowing while
    the replays' own processes start up), per robot and in all: admitted chunks and deadline misses. Reported
    beside the window's table, never dropped."""
    robots = {}
    for name in ns:
        c = counter_delta(edge_robot(after, name), edge_robot(before, name))
        robots[name] = {"admitted": c["admitted"], "deadline_misses": c["deadline_misses"]}
    return {"s": float(seconds), "robots": robots,
            "admitted": sum(r["admitted"] for r in robots.values()),
            "deadline_misses": sum(r["deadline_misses"] for r in robots.values())}


def _pass_profile(loop: dict, loop0: dict) -> Optional[dict]:
    """The edge's per-pass stages (core/pass_profile.py) over the window: the difference of its snapshots at the
    window's start and end, the slowest passes those that began inside."""
    prof = loop.get("pass_profile")
    if not isinstance(prof, dict):
        return None
    return profile_window(prof, loop0.get("pass_profile"))


def verdict(robots: dict[str, dict]) -> dict[str, Any]:
    """Met when every robot had chunks admitted, missed <= 0.1 % of them and got fresh actions (ticks)."""
    why = []
    for ns, r in robots.items():
        if not r["admitted"]:
            why.append(f"{ns}: no chunk admitted")
        elif r["miss_rate"] is not None and r["miss_rate"] > MISS_LIMIT:
            why.append(f"{ns}: miss rate {100 * r['miss_rate']:.2f} % > {100 * MISS_LIMIT:g} %")
        if not r["ticks"]["fresh"]:
            why.append(f"{ns}: no fresh actions")
    return {"met": not why and bool(robots), "reasons": why or ([] if robots else ["no robots"])}


def _f(x, fmt="{:.1f}", none="n/a") -> str:
    return none if x is None else fmt.format(x)


def _mib(b) -> str:
    return _f(None if b is None else b / 2**20, "{:.2f} MiB")


def table(result: dict[str, Any]) -> str:
    """The run as Markdown: per robot table, edge lines, verdict line."""
    e, m = result["edge"], result.get("meta", {})
    lines = [f"# Fleet replay: {len(result['robots'])} robots, one edge", ""]
    if m:
        extra = m.get("extra_params") or []
        lines += [f"{m.get('duration_s', 0):g} s at {m.get('camera_hz', 0):g} Hz per camera"
                  f"{' (compressed)' if m.get('image_transport') == 'compressed' else ''}, backend "
                  f"{e['backend']}, deadline {_f(e['deadline_ms'], '{:g}')} ms, KV budget "
                  f"{_f(e['kv_budget_tokens'], '{:d}')} tokens per robot"
                  f"{'; edge ' + ' '.join('-p ' + x for x in extra) if extra else ''}; "
                  f"bag: {m.get('bag_description', '?')}", ""]
    kind = "VRAM" if e["memory_kind"] == "VRAM" else "KV (host)"
    lines += [f"| robot | frames pub / recv | admitted | refused | misses | miss rate | chunk p50 / p99 ms | "
              f"ticks fresh / repeat / hold | fresh share | {kind} |", "|" + "---|" * 10]
    for ns, r in result["robots"].items():
        t, lat = r["ticks"], r["latency_ms"]
        lines.append(f"| {ns} | {_f(r['frames_published'], '{:d}')} / {r['frames_received_total']} | "
                     f"{r['admitted']} | "
                     f"{r['refused']} | {r['deadline_misses']} | {_f(r['miss_rate'], '{:.3%}')} | "
                     f"{_f(lat['p50'])} / {_f(lat['p99'])} | {t['fresh']} / {t['repeat']} / {t['hold']} | "
                     f"{_f(r['fresh_share'], '{:.1%}')} | {_mib(r['kv_bytes'])} |")
    pm, hm = e["pass_ms"], e.get("host_ms") or {}
    whole = any(r["latency_ms"].get("whole_run") for r in result["robots"].values()) or pm.get("whole_run")
    lines += ["", "- frames pub / recv: the whole replay; everything else: the measured window"
              + (" (chunk latency and pass time: the edge's last samples, it has no histograms)" if whole else "")
              + "; chunk latency: conversion + encode + pass of the batches the robot was in",
              f"- edge {e['memory_kind']}: weights {_mib(e['weight_bytes'])}, engine peak "
              f"{_mib(e['engine_peak_bytes'])}, KV per robot = the last column; peak VRAM "
              f"{_f(e['peak_vram_mb'])} MB, peak RSS {_f(e['peak_rss_mb'])} MB",
              f"- batches by size: {e['batch_sizes']}; pass p50 / p99 / max {_f(pm['p50'])} / {_f(pm['p99'])} / "
              f"{_f(pm['max'])} ms; host part of decision-to-results p50 / p99 {_f(hm.get('p50'))} / "
              f"{_f(hm.get('p99'))} ms; cycle overruns {e['cycle_overruns']}, batch failures {e['batch_failures']}"]
    missed = {ns: r.get("missed_ticks") for ns, r in result["robots"].items()}
    if any(v is not None for v in missed.values()):
        lines.append("- robots' action timers, grid points skipped in the window (a tick with no message): "
                     + ", ".join(f"{ns} {_f(v, '{:d}')}" for ns, v in missed.items())
                     + " (since start: " + ", ".join(f"{_f(r.get('missed_ticks_total'), '{:d}')}"
                                                     for r in result["robots"].values()) + ")")
    cpu = e.get("cpu") or {}
    if cpu.get("cpu_s_per_s") is not None:
        lines.append(f"- edge process CPU {cpu['cpu_s_per_s']:.3f} s per s over the window"
                     + (f" (the fleet loop's thread {cpu['loop_thread_cpu_s_per_s']:.3f}; the rest: camera "
                        f"executors, DDS, main)" if cpu.get("loop_thread_cpu_s_per_s") is not None else "")
                     + (f"; its child processes (the fleet's camera process) {cpu['children_cpu_s_per_s']:.3f}"
                        if cpu.get("children_cpu_s_per_s") is not None else ""))
    for size, c in sorted((e.get("cost_model") or {}).items(), key=lambda kv: int(kv[0])):
        if c.get("estimate_ms") is not None:
            lines.append(f"- cost model, batch of {size} at the window's end: prefill {_f(c['prefill_ms'])} + "
                         f"decode {_f(c['decode_ms_per_step'], '{:.2f}')} per step + host {_f(c['host_ms'])} + "
                         f"spread {_f(c['spread_ms'])} = estimate {_f(c['estimate_ms'])} ms ({c['samples']} samples)")
    if "machine_cpu" in e:
        lines.append(host_load.describe(e["machine_cpu"], "edge process"))
    if e.get("pass_profile"):
        lines += describe_passes(e["pass_profile"])
    if e["missing"]:
        lines.append(f"- not in the edge's engine memory figures: {', '.join(e['missing'])}")
    st = result.get("settle")
    if st and st.get("s"):
        lines.append(f"- before the window, {st['s']:g} s of settling (frames flowing, the replays' processes "
                     f"starting up; not in the table or the verdict): {st['deadline_misses']} of {st['admitted']} "
                     f"chunks late; per robot " + ", ".join(f"{ns} {r['deadline_misses']} / {r['admitted']}"
                                                            for ns, r in st["robots"].items()))
    v = result["verdict"]
    lines += ["", f"VERDICT: {'MET' if v['met'] else 'NOT MET'} (every robot's miss rate <= {100 * MISS_LIMIT:g} % "
              f"and fresh actions for every robot)" + ("" if v["met"] else ": " + "; ".join(v["reasons"]))]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------------
