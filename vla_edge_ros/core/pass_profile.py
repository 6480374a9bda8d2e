"""Where a pass's time went, stage by stage: the fleet loop's host tail, kept per pass for the slowest ones.

Why: the fleet's cost model learns a pass's host part as one number (decision to results minus the engine's own
GPU time), and on the H200 with 8 robots its p99 (38 ms) was eight times its median (4.7 ms) while an aggregate
profile (py-spy over 60 s) showed the loop thread working only ~9 % of the time in the host stages: a mean cannot
say what ONE slow pass waited for. So every pass is split at marks the loop sets (the cycle boundary, the
decision, the end of encoding, the end of the engine call, the end of delivery), each stage with its wall time
AND the loop thread's CPU time over it: a stage whose wall time far exceeds its CPU time waited (for a core, the
GIL, the device), one whose CPU time is as large worked; where the kernel keeps schedstat, the time the thread
sat runnable on a run queue says how much of a wait was for a core. The engine may add its own split of the call
(``last_batch_timing``: ``launch_ms``, ``sync_ms`` next to the GPU's ``prefill_ms`` / ``decode_ms``).

Cheap to keep and to read, because reading happens on other threads of the same process (/diagnostics, the stats
file) several times a second while the loop may be waiting for the GIL: each stage's times go into cumulative
histograms (core/metrics.py; a window's percentiles are the difference of two snapshots, ``window``), and the
``keep`` passes with the largest host part are kept per ``bucket_s`` of time (a window is a time range; ``at_s``
says when each pass began), for the last ``buckets`` buckets. The first version kept a ring of 4096 passes and
computed percentiles over it on every read: that read became the GIL's largest holder in the 8-robot replay
(py-spy --gil, session 21). Pure, no ROS; one writer (the loop thread), any reader.
"""
from __future__ import annotations

import heapq
import os
import threading
import time
from typing import Any, Callable, Mapping, Optional

from vla_edge_ros.core.metrics import CumulativeHistogram, window_percentiles

# the stages in order: each ends at the mark of its name ("wake" starts at the cycle boundary)
STAGES = ("wake", "plan", "encode", "engine", "deliver")
# engine timing keys copied into a pass's record when the engine gives them (ms)
ENGINE_KEYS = ("prefill_ms", "decode_ms", "launch_ms", "sync_ms")
KINDS = ("wall_ms", "cpu_ms", "runq_ms")
RUNQ_PROBE_PASSES = 256  # passes after which a run-queue time that never moved is no longer read


class _ThreadSchedstat:
    """The calling thread's schedstat file, open while the thread lives: closed when its thread-local goes with
    the thread (a loop restarted by lifecycle transitions must not leak one descriptor per thread)."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def __del__(self) -> None:
        os.close(self.fd)


_schedstat = threading.local()  # per thread: its own _ThreadSchedstat, opened once (one pread per reading)


def thread_runq_ns() -> Optional[int]:
    """Nanoseconds the calling thread has spent runnable but waiting for a core (Linux schedstat), None where
    that is not readable. One pread on a file kept open per thread: open + read + close on every stage mark was
    11 % of the fleet loop's samples in a sandboxed kernel's replay (py-spy, session 22)."""
    try:
        f = getattr(_schedstat, "file", None)
        if f is None:
            f = _schedstat.file = _ThreadSchedstat()
        return int(os.pread(f.fd, 128, 0).split()[1])
    except (OSError, IndexError, ValueError):
        return None


def schedstat_counts() -> bool:
    """Whether this kernel keeps schedstat (some sandboxes give the file with zeros, "0 0 1")."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[0]) > 0
    except (OSError, IndexError, ValueError):
        return False


def _no_runq() -> None:
    return None


class PassProfile:
    def __init__(self, keep: int = 3, bucket_s: float = 10.0, buckets: int = 20,
                 clock_ns: Callable[[], int] = time.monotonic_ns, cpu_ns: Callable[[], int] = time.thread_time_ns,
                 runq_ns: Optional[Callable[[], Optional[int]]] = None) -> None:
        """``runq_ns``: the thread's run-queue time (default: schedstat where the kernel keeps it, else none)."""
        if keep < 1 or buckets < 1 or not bucket_s > 0:
            raise ValueError(f"keep and buckets must be >= 1 and bucket_s > 0, got {keep}, {buckets}, {bucket_s}")
        self.keep, self.bucket_s, self.buckets = int(keep), float(bucket_s), int(buckets)
        self._clock_ns, self._cpu_ns = clock_ns, cpu_ns
        self._runq_ns = runq_ns if runq_ns is not None else (thread_runq_ns if schedstat_counts() else _no_runq)
        self._runq_auto = runq_ns is None  # the default reader: dropped if it never moves (below)
        self._t0 = clock_ns()
        self._hists: dict[str, CumulativeHistogram] = {}
        self._slowest: dict[int, list] = {}  # time bucket -> min-heap of (host_ms, seq, record), at most ``keep``
        self._lock = threading.Lock()
        self._marks: list[tuple[str, int, Optional[int], Optional[int]]] = []
        self.passes = 0

    def begin(self, cycle_start_ns: int, decided_ns: int) -> None:
        """A pass starts: its cycle began at ``cycle_start_ns``, the loop woke and decided at ``decided_ns``."""
        self._marks = [("cycle", int(cycle_start_ns), None, None),
                       ("wake", int(decided_ns), self._cpu_ns(), self._runq_ns())]

    def mark(self, stage: str) -> None:
        """The stage ``stage`` (one of STAGES after "wake") ends now."""
        if stage not in STAGES[1:]:
            raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGES[1:])}")
        if self._marks:
            self._marks.append((stage, self._clock_ns(), self._cpu_ns(), self._runq_ns()))

    def discard(self) -> None:
        """The pass begun is not one to keep (it ran no member, or it failed)."""
        self._marks = []

    def end(self, size: int, host_ms: float, engine_timing: Optional[Mapping[str, Any]] = None) -> Optional[dict]:
        """Close the pass (``size`` members, ``host_ms`` as the cost model learned it); returns its record, None
        when ``begin`` was not called. Stages never marked are absent from the record."""
        marks, self._marks = self._marks, []
        if len(marks) < 2:
            return None
        stages: dict[str, dict[str, float]] = {}
        for (_, t_prev, c_prev, q_prev), (name, t, c, q) in zip(marks, marks[1:]):
            stage = {"wall_ms": (t - t_prev) / 1e6}
            if c is not None and c_prev is not None:
                stage["cpu_ms"] = (c - c_prev) / 1e6
            if q is not None and q_prev is not None:
                stage["runq_ms"] = (q - q_prev) / 1e6
            stages[name] = stage
        engine = {}
        for key in ENGINE_KEYS:
            try:
                engine[key] = float((engine_timing or {})[key])
            except (KeyError, TypeError, ValueError):
                continue
        at_s = (marks[0][1] - self._t0) / 1e9
        record = {"at_s": at_s, "size": int(size), "host_ms": float(host_ms), "stages": stages, "engine": engine}
        samples = [(f"{name}.{kind}", ms) for name, st in stages.items() for kind, ms in st.items()]
        samples += [(f"timing.{key}", ms) for key, ms in engine.items()]  # not "engine.": that is a stage
        with self._lock:
            for key, ms in samples:
                hist = self._hists.get(key)
                if hist is None:
                    hist = self._hists[key] = CumulativeHistogram()
                hist.add(ms)
            self.passes += 1
            if self._runq_auto and self.passes == RUNQ_PROBE_PASSES and not any(
                    set(h.snapshot()) - {"0"} for k, h in self._hists.items() if k.endswith(".runq_ms")):
                self._runq_ns = _no_runq  # a kernel that gives schedstat's file but never counts the wait
            heap = self._slowest.setdefault(int(at_s // self.bucket_s), [])
            item = (record["host_ms"], self.passes, record)
            if len(heap) < self.keep:
                heapq.heappush(heap, item)
            elif item[0] > heap[0][0]:
                heapq.heapreplace(heap, item)
            while len(self._slowest) > self.buckets:
                del self._slowest[min(self._slowest)]
        return record

    def snapshot(self) -> dict[str, Any]:
        """JSON-able and cheap: ``now_s`` (this profile's clock: a later window starts there), ``passes``, the
        histograms (``hists``: "stage.kind" / "timing.key" -> CumulativeHistogram snapshot) and the slowest
        records kept in every retained time bucket (``slowest``, largest host part first)."""
        with self._lock:
            hists = {key: h.snapshot() for key, h in self._hists.items()}
            kept = [item for heap in self._slowest.values() for item in heap]
            passes = self.passes
        kept.sort(key=lambda item: (-item[0], item[1]))
        return {"now_s": (self._clock_ns() - self._t0) / 1e9, "passes": passes, "hists": hists,
                "slowest": [item[2] for item in kept]}


def window(end: Mapping[str, Any], start: Optional[Mapping[str, Any]] = None, keep: int = 12) -> dict[str, Any]:
    """The passes between two snapshots (``start`` None: since the profile began): their count, per stage and
    kind (and per engine key) the p50 / p99 / max (core/metrics.window_percentiles: bucket upper edges), and the
    ``keep`` slowest that began inside."""
    start = start or {}
    since = start.get("now_s")
    out: dict[str, Any] = {"passes": int(end.get("passes", 0) or 0) - int(start.get("passes", 0) or 0),
                           "since_s": since, "stages": {}, "engine": {}}
    before = start.get("hists") or {}
    for key, hist in (end.get("hists") or {}).items():
        head, _, kind = key.partition(".")
        w = window_percentiles(hist, before.get(key))
        if not w["count"]:
            continue
        figures = {"p50": w["p50"], "p99": w["p99"], "max": w["max"]}
        if head == "timing":
            out["engine"][kind] = figures
        else:
            out["stages"].setdefault(head, {})[kind] = figures
    out["slowest"] = [r for r in end.get("slowest") or [] if since is None or r.get("at_s", 0.0) >= since][:keep]
    return out


def describe(w: Mapping[str, Any], top: int = 5) -> list[str]:
    """Lines a person reads from a ``window``: each stage's wall p50 / p99 (CPU and run queue beside), the
    engine's figures, then the slowest passes' stages (wall / CPU / run queue)."""
    if not w.get("passes"):
        return ["- pass stages: no pass in the window"]
    parts = []
    for name in STAGES:
        s = w.get("stages", {}).get(name)
        if not s or "wall_ms" not in s:
            continue
        inner = [f"{label} {s[kind]['p50']:.1f}/{s[kind]['p99']:.1f}" for kind, label in
                 (("cpu_ms", "cpu"), ("runq_ms", "runq")) if kind in s]
        parts.append(f"{name} {s['wall_ms']['p50']:.1f}/{s['wall_ms']['p99']:.1f}"
                     + (f" ({', '.join(inner)})" if inner else ""))
    eng = w.get("engine") or {}
    parts += [f"{k[:-3]} {eng[k]['p50']:.1f}/{eng[k]['p99']:.1f}" for k in ENGINE_KEYS if k in eng]
    lines = [f"- pass stages over {w['passes']} passes, wall p50/p99 ms: " + "; ".join(parts)]
    for r in list(w.get("slowest") or [])[:top]:
        st = r.get("stages") or {}
        cells = ["/".join([f"{name} {st[name]['wall_ms']:.1f}"]
                          + [f"{st[name][kind]:.1f}" for kind in KINDS[1:] if kind in st[name]])
                 for name in STAGES if name in st]
        cells += [f"{k[:-3]} {v:.1f}" for k, v in (r.get("engine") or {}).items()]
        lines.append(f"  - host {r['host_ms']:.1f} ms at {r['at_s']:.1f} s, {r['size']} robot(s): wall/cpu/runq "
                     + ", ".join(cells))
    return lines
