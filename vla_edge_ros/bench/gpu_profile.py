"""Where a chunk's GPU time goes, measured from outside the engine: a recording launcher instead of hooks in it.

The engine enqueues a chunk through whatever launcher it is given (CudaEngine.enqueue_chunk). Here that launcher
is a ``RecordingLauncher`` that passes on only some kernel families (``only`` / ``skip``), or none (``dry``: it
just records the launch order). On top of it:

* ``time_kernels``: each family alone in one graph holding its launches of a whole chunk (its isolated cost);
* ``time_ablations``: a whole chunk's graph minus the same graph without one family (its in-chain cost, PDL
  overlaps kept). Both leave garbage in the activations and the decode scratch rows: reset() the engine after;
* ``timeline``: per kernel of one chunk, when its first block started and when its first / last block passed the
  PDL wait (engine built with ``defines=("VLA_TIMELINE",)``: cuda/common.cuh stamps %globaltimer), plus the last
  prefill attention's per-block phase ends.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from vla_edge_ros.engine.cuda.graphs import CudaGraph
from vla_edge_ros.engine.cuda.kernels import BY_NAME, FAMILIES, KERNEL_FILES
from vla_edge_ros.engine.interface import EngineError


class RecordingLauncher:
    """Wraps a launcher: records every kernel name in order and forwards the launches of the families asked for."""

    def __init__(self, inner, only: Iterable[str] | None = None, skip: Iterable[str] = (), dry: bool = False):
        self.inner = inner
        self.only = None if only is None else set(only)
        self.skip = set(skip)
        self.dry = dry
        self.names: list[str] = []   # every launch asked for, in order
        self.forwarded = 0           # launches passed on to the inner launcher

    def __call__(self, launch, *args, serial: bool = False) -> None:
        self.names.append(launch.kernel)
        family = BY_NAME[launch.kernel].family
        if self.dry or family in self.skip or (self.only is not None and family not in self.only):
            return
        self.forwarded += 1
        self.inner(launch, *args, serial=serial)


def launch_order(eng) -> list[str]:
    """Kernel names of one chunk in launch order (nothing runs)."""
    rec = RecordingLauncher(None, dry=True)
    eng.enqueue_chunk(rec)
    return rec.names


def _chunk_graph(eng, name: str, rec: RecordingLauncher) -> CudaGraph:
    return CudaGraph(name).capture(eng.stream, lambda: eng.enqueue_chunk(rec))


def _time_graph(eng, g: CudaGraph, reps: int) -> float:
    """GPU ms per replay of g (one warm-up replay, then reps between two events); destroys g."""
    ev0, ev1 = eng.ev[0], eng.ev[1]
    try:
        g.launch(eng.stream)
        ev0.record(eng.stream)
        for _ in range(reps):
            g.launch(eng.stream)
        ev1.record(eng.stream)
        ev1.synchronize()
        return ev1.time_since(ev0) / reps
    finally:
        g.destroy()


def time_kernels(eng, reps: int = 20) -> dict[str, float]:
    """GPU ms per chunk of each kernel family alone (families the configuration does not launch are left out)."""
    out: dict[str, float] = {}
    with eng._active():
        for fam in FAMILIES:
            rec = RecordingLauncher(eng.launcher, only={fam})
            g = _chunk_graph(eng, fam, rec)
            if rec.forwarded == 0:
                g.destroy()
                continue
            out[fam] = _time_graph(eng, g, reps)
    return out


def time_ablations(eng, reps: int = 20) -> dict[str, float]:
    """In-chain cost of each family: the whole chunk's graph ("full") minus the graph without the family, ms."""
    with eng._active():
        full = _time_graph(eng, _chunk_graph(eng, "full", RecordingLauncher(eng.launcher)), reps)
        out = {"full": full}
        used = {BY_NAME[n].family for n in launch_order(eng)}
        for fam in (f for f in FAMILIES if f in used):
            out[fam] = full - _time_graph(eng, _chunk_graph(eng, fam, RecordingLauncher(eng.launcher, skip={fam})),
                                          reps)
    return out


def timeline(eng, run_chunk: Callable[[], Any]) -> tuple[list[tuple[str, float, float, float]], np.ndarray | None]:
    """One chunk run by ``run_chunk()`` on an engine built with VLA_TIMELINE and graphs: rows (kernel, first block
    started, first block past its PDL wait, last block past it) in us from the first kernel's start, matched to the
    launches by grid-id order; and the last prefill attention's per-block phase ends ((blocks, 5) us on the same
    clock, NaN where a block did not reach a phase) or None."""
    if "VLA_TIMELINE" not in eng.defines or not eng.use_graphs:
        raise EngineError("timeline needs an engine built with defines=('VLA_TIMELINE',) and graphs on")
    cuda, k, pdl = eng._cuda, eng.kernels, eng.pdl
    names = launch_order(eng)
    stamps, phases = [], []
    with eng._active():
        eng.stream.synchronize()
        for fname in KERNEL_FILES:
            where = k.global_ptr(fname, "vla_tl", pdl)
            if where is not None:
                init = np.zeros((where[1] // 32, 4), np.uint64)
                init[:, 1:3] = np.iinfo(np.uint64).max
                cuda.memcpy_htod(where[0], init)
                stamps.append((where[0], init))
            where = k.global_ptr(fname, "vla_pf_phase", pdl)
            if where is not None:
                cuda.memcpy_htod(where[0], np.zeros(where[1] // 8, np.uint64))
                phases.append(where)
    run_chunk()
    with eng._active():
        eng.stream.synchronize()
        got = []
        for ptr, init in stamps:
            a = np.empty_like(init)
            cuda.memcpy_dtoh(a, ptr)
            got.append(a[a[:, 0] != 0])
        rows = np.concatenate(got)
        rows = rows[np.argsort(rows[:, 0])][-len(names):]
        if len(rows) != len(names):
            raise EngineError(f"timeline: {len(rows)} stamped grids for {len(names)} launches")
        t0 = int(rows[:, 1].min())
        pf = None
        for ptr, size in phases:  # one module has the prefill attention's stamps
            a = np.empty(size // 8, np.uint64)
            cuda.memcpy_dtoh(a, ptr)
            a = a.reshape(-1, 5)
            a = a[:int(np.max(np.nonzero(a.any(axis=1))[0], initial=-1)) + 1]
            if len(a):
                pf = np.where(a == 0, np.nan, (a.astype(np.float64) - t0) / 1e3)
    us = lambda v: (int(v) - t0) / 1e3  # noqa: E731
    return [(n, us(r[1]), us(r[2]), us(r[3])) for n, r in zip(names, rows)], pf
