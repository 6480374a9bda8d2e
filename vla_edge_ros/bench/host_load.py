"""The machine's CPU over a benchmark's window: how busy its cores were, whether its CPU quota throttled it, and
how one process's threads waited for a core. Linux /proc and cgroup files only; every figure None elsewhere.

Why: a pass whose host stages take 80 ms of wall time for 4 ms of CPU (core/pass_profile.py) waited for
something. Three suspects look the same from inside the process: a machine whose cores are all busy, a cgroup
CPU quota (cpu.max) that freezes every thread of the container until the next period once it is spent, and
another thread of the process holding the GIL. The first two are measured here (busy share, throttled periods,
run-queue time of the process's threads); what is left of the wait is the third.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

CGROUP_STATS = ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat", "/sys/fs/cgroup/cpu,cpuacct/cpu.stat")


def _read(path: str) -> Optional[str]:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cpu_jiffies() -> Optional[tuple[int, int]]:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat's first line; idle and iowait are not busy)."""
    text = _read("/proc/stat")
    if not text or not text.startswith("cpu "):
        return None
    v = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    total = sum(v[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - v[3] - v[4], total


def _cgroup() -> Optional[dict[str, Any]]:
    """The CPU controller's throttling counters (v2: throttled_usec; v1: throttled_time in ns) and its quota."""
    for path in CGROUP_STATS:
        text = _read(path)
        if text is None:
            continue
        kv = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        out = {"nr_periods": int(kv.get("nr_periods", 0)), "nr_throttled": int(kv.get("nr_throttled", 0))}
        if "throttled_usec" in kv:
            out["throttled_ms"] = int(kv["throttled_usec"]) / 1e3
        elif "throttled_time" in kv:
            out["throttled_ms"] = int(kv["throttled_time"]) / 1e6
        quota = (_read(str(Path(path).with_name("cpu.max"))) or "").split()
        if len(quota) == 2 and quota[0] != "max":
            out["quota_cpus"] = int(quota[0]) / int(quota[1])
        return out
    return None


def _process(pid: int) -> Optional[dict[str, Any]]:
    """Context switches of ``pid``, its threads' summed run-queue time (schedstat, ms), its CPU time and its
    children's (s)."""
    status = _read(f"/proc/{pid}/status")
    if status is None:
        return None
    kv = dict((k.strip(), v.strip()) for k, v in (line.split(":", 1) for line in status.splitlines() if ":" in line))
    out: dict[str, Any] = {"voluntary_switches": int(kv.get("voluntary_ctxt_switches", 0)),
                           "involuntary_switches": int(kv.get("nonvoluntary_ctxt_switches", 0))}
    runq, seen = 0, 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        fields = (_read(f"/proc/{pid}/task/{tid}/schedstat") or "").split()
        if len(fields) >= 2:
            runq, seen = runq + int(fields[1]), seen + 1
    if seen:
        out["runq_ms"] = runq / 1e6
    for key, value in (("cpu_s", proc_cpu_s(pid)), ("children_cpu_s", children_cpu_s(pid))):
        if value is not None:  # a window gives them per second, as the counters above
            out[key] = value
    return out


def _stat_fields(pid: Any) -> Optional[list[str]]:
    """/proc/<pid>/stat's fields after the command name (state, ppid, ...), None once gone or without /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cpu_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def proc_cpu_s(pid: int) -> Optional[float]:
    """CPU time (user + system, s) of process ``pid`` so far, from Linux /proc; None elsewhere or once gone."""
    fields = _stat_fields(pid)
    try:
        return None if fields is None else _cpu_s(fields)
    except (IndexError, ValueError):
        return None


def children_cpu_s(pid: int) -> Optional[float]:
    """CPU time of ``pid``'s child processes alive now (the fleet edge's camera process, its resource tracker),
    from /proc; None where there is no /proc."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    total = 0.0
    for e in entries:
        fields = _stat_fields(e)
        if fields is not None and int(fields[1]) == pid:  # ppid (field 4)
            total += _cpu_s(fields)
    return total


def sample(pid: Optional[int] = None) -> dict[str, Any]:
    """The counters now (cumulative: a window is the difference of two samples, ``window``)."""
    jiffies = _cpu_jiffies()
    load = (_read("/proc/loadavg") or "").split()
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count()
    return {"cpus": cpus, "jiffies": list(jiffies) if jiffies else None,
            "loadavg_1m": float(load[0]) if load else None, "cgroup": _cgroup(),
            "process": _process(pid) if pid is not None else None}


def window(start: dict, end: dict, seconds: float) -> dict[str, Any]:
    """Figures over the window between two samples ``seconds`` apart."""
    out: dict[str, Any] = {"cpus": end.get("cpus"), "loadavg_1m": end.get("loadavg_1m"), "seconds": seconds}
    if start.get("jiffies") and end.get("jiffies"):
        busy, total = (e - s for s, e in zip(start["jiffies"], end["jiffies"]))
        out["busy_share"] = busy / total if total else None
    c0, c1 = start.get("cgroup"), end.get("cgroup")
    if c0 and c1:
        out["cgroup"] = {k: c1[k] - c0.get(k, 0) for k in ("nr_periods", "nr_throttled", "throttled_ms") if k in c1}
        if "quota_cpus" in c1:
            out["cgroup"]["quota_cpus"] = c1["quota_cpus"]
    p0, p1 = start.get("process"), end.get("process")
    if p0 and p1 and seconds > 0:
        out["process"] = {f"{k}_per_s": (p1[k] - p0.get(k, 0)) / seconds for k in p1}
    return out


def describe(w: Optional[dict], who: str = "process") -> str:
    """One line: busy cores, load, throttling, the process's switches and run-queue wait per second."""
    if not w:
        return "- machine CPU: not measured"
    parts = []
    if w.get("busy_share") is not None:
        parts.append(f"cores busy {100 * w['busy_share']:.1f} % of {w.get('cpus')}")
    if w.get("loadavg_1m") is not None:
        parts.append(f"load average {w['loadavg_1m']:.2f}")
    cg = w.get("cgroup")
    if cg is None:
        parts.append("no cgroup CPU counters")
    else:
        parts.append(f"cgroup throttled in {cg.get('nr_throttled', 0)} of {cg.get('nr_periods', 0)} periods "
                     f"({cg.get('throttled_ms', 0.0):.0f} ms)"
                     + (f", quota {cg['quota_cpus']:g} CPUs" if "quota_cpus" in cg else ", no quota"))
    p = w.get("process")
    if p:
        parts.append(f"{who}: {p.get('voluntary_switches_per_s', 0):.0f} voluntary / "
                     f"{p.get('involuntary_switches_per_s', 0):.0f} involuntary switches per s"
                     + (f", its threads waited {p['runq_ms_per_s']:.1f} ms per s for a core"
                        if "runq_ms_per_s" in p else ""))
    return "- machine CPU over the window: " + "; ".join(parts)
