"""Which robots' chunks one edge GPU runs together this cycle: deadline admission for a fleet (pure, no clock).

One engine serves N robots and batches the chunks that are due in the same cycle into one forward pass: the
weights are read once per pass, so a batch of M costs far less than M single passes, but it still costs more
than one, and every member of the batch waits for the whole pass. Per cycle the caller passes the robots with a
fresh frame and each one's own deadline (absolute monotonic ns); ``FleetScheduler.plan`` answers with the batch
and, for every other ready robot, why it was refused (its action publisher repeats / holds, as for a refused
single-robot chunk in core/admission.py):

* ``deadline``: the robot's chunk cannot finish before its own deadline minus the safety margin even alone (or
  the deadline has passed). It is refused alone, at once, and never shortens the batch of the others.
* ``capacity``: it would have fitted alone, but the batch is full (``max_batch``) or one more member would
  make the pass finish after some member's deadline. Earliest deadline first decides who is in.
* ``bad_deadline`` / ``unknown_robot``: the caller's input was wrong for that robot; counted, never a crash,
  so one bad entry does not stop the fleet's cycle.

Starvation: EDF alone lets a robot whose deadline is always the latest lose every cycle. A robot refused for
capacity ``starvation_limit`` times since its last admission is placed first (longest-starved first) next
cycle; the batch check still protects every member's deadline, so a promotion displaces, it never causes a
miss. Deadline refusals and silent cycles neither add to nor reset that count: they are not the scheduler's
choice. Equal deadlines -- the fleet loop gives every robot of a cycle the same one -- go to the robot admitted
least recently (then by name): round robin. Ordered by name alone, the first names took every pass (the 8-robot
H200 replay with passes of three, session 24: r1 98 % of its ticks fresh, r2 50 %, the others the 25 % that
promotion gave them). Robots are state by name only: joining, leaving or going silent (simply absent from
``ready``) touches no other robot's counters, and a robot's outcome depends on the others only through the
shared batch.

The cost of a batch, ``BatchCostModel``: per batch size M, EMAs of three parts of what lies between the decision
and the members' results, plus a spread (the ``cost_quantile`` quantile of recent overruns of their sum), as
AdmissionController does for one robot:

* ``prefill`` and ``decode`` (per step): the pass as the engine times it (``last_batch_timing``; the CUDA engine's
  events: device time), what the engine's speed decides;
* ``host``: the rest, measured by the caller (core/fleet_loop.py) from the decision to the results: frame
  conversion and encoding, the engine's host work (KV bookkeeping, uploads, results), waiting for a core or the
  GIL. Kept apart so that the figures say which one grew; the estimate adds all three, so admission still covers
  everything until a member's result exists.

A size never measured is estimated from the measured ones, conservatively (``_components``).
Liveness: refused chunks yield no cost sample, so an estimate that got too high would refuse the fleet forever.
Every cycle in which nobody was admitted although some robot had time left relaxes the one-robot estimate
(``BatchCostModel.relax``: AdmissionController's rule, so a burst of slow passes expires after about as many
refused cycles while a lasting rise of the cost or of its noise keeps refusing), and after
``probe_after_cycles`` such cycles the earliest such robot runs alone as a probe to re-measure
(AdmissionController's probe, fleet-wide).

``cost_quantile`` (the same parameter as the single robot's, default 0.5): a pass admitted with the least slack
(estimate = the time left) misses when its overrun exceeds the spread, i.e. with probability up to 1 - q; EDF
packs every batch until the next member would not fit, so with many robots ready the admitted passes sit near
that margin and the bound is approached (at q = 0.5 the 8-robot H200 replay missed 4-8 %). Issue 24's <= 0.1 %
then needs q >= 0.999 (the largest of the last 256 overruns) or slack. What a higher q costs: one robot fewer
in a pass of several (it waits a cycle; starvation promotion bounds how many), but when even one robot's pass
only just fits a cycle every robot is refused every cycle (no fresh actions but probes) for as long as the noise
lasts (relaxing expires bursts only), as for the single robot on a CPU (docs/FIGURES.md). So the default stays
0.5 and a fleet whose one-robot pass fits with room to spare may set a higher q (``-p cost_quantile:=0.95``;
tools/h200_fleet_replay.sh ``EDGE_PARAMS``).
"""
from __future__ import annotations

import math
import numbers
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from vla_edge_ros import params
from vla_edge_ros.core.admission import (RECENT_SAMPLES, RELAX_PER_REFUSAL, SPREAD_MIN_SAMPLES, SPREAD_WINDOW,
                                         median, robust_upper_quantile, upper_quantile)

DEADLINE, CAPACITY, BAD_DEADLINE, UNKNOWN = "deadline", "capacity", "bad_deadline", "unknown_robot"
UNKNOWN_NAMES_KEPT = 8  # recent unknown names shown in stats (bounded: a caller bug must not grow memory)


def _finite_nonneg(name: str, value: Any) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name} must be a finite, non-negative number of ms, got {value!r}")
    return value


def _int_at_least(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def _ns_or_none(value: Any) -> Optional[int]:
    """A time in ns as an int, None when it is not a finite real number (floats round down: earlier is safer)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return int(math.floor(value))


def _ms_to_ns(ms: float) -> int:
    return int(math.ceil(ms * 1e6))  # rounded up: an estimate never shrinks in conversion


class _SizeCost:
    """Cost figures of one measured batch size."""
    __slots__ = ("prefill_ms", "decode_ms_per_step", "host_ms", "overruns", "samples", "spread", "recent")

    def __init__(self, prefill_ms: float, decode_ms_per_step: float, host_ms: float) -> None:
        self.prefill_ms, self.decode_ms_per_step, self.host_ms = prefill_ms, decode_ms_per_step, host_ms
        self.overruns: deque[float] = deque(maxlen=SPREAD_WINDOW)  # real - mean estimate, ms
        self.samples = 1
        # real (prefill, decode per step, host) samples: the medians ``relax`` moves the EMAs toward
        self.recent: deque[tuple[float, float, float]] = deque([(prefill_ms, decode_ms_per_step, host_ms)],
                                                               maxlen=RECENT_SAMPLES)
        self.spread: Optional[float] = None  # the quantile of ``overruns``, cached until the next record


class BatchCostModel:
    """Thread-safe: record from the inference thread, estimates from the scheduler, stats from diagnostics."""

    def __init__(self, ema_alpha: float = params.BY_NAME["ema_alpha"].default,
                 cost_quantile: float = params.BY_NAME["cost_quantile"].default,
                 outlier_factor: float = 3.0) -> None:
        """``outlier_factor``: an EMA sample is clipped at this multiple of the current EMA (one hung pass must
        not refuse the fleet for seconds; core/admission.py measured why)."""
        reasons = [r for k, v in (("ema_alpha", ema_alpha), ("cost_quantile", cost_quantile))
                   if (r := params.validate(k, v))]
        if not (isinstance(outlier_factor, numbers.Real) and math.isfinite(outlier_factor) and outlier_factor >= 1):
            reasons.append(f"outlier_factor must be >= 1, got {outlier_factor!r}")
        if reasons:
            raise ValueError("; ".join(reasons))
        self.ema_alpha, self.cost_quantile = float(ema_alpha), float(cost_quantile)
        self.outlier_factor = float(outlier_factor)
        self._lock = threading.Lock()
        self._sizes: dict[int, _SizeCost] = {}
        self.clipped_samples = 0
        self.relaxations = 0

    def record(self, batch_size: int, prefill_ms: float, decode_ms_total: float, decode_steps: int,
               host_ms: float = 0.0) -> None:
        """Feed back one real pass of ``batch_size`` robots: the engine's ``prefill_ms`` and ``decode_ms_total``
        (its own timing of the pass) and ``host_ms``, the rest of the time from the decision to the results
        (module docstring). The three add up to what the estimate must cover."""
        m = _int_at_least("batch_size", batch_size, 1)
        p = _finite_nonneg("prefill_ms", prefill_ms)
        d_total = _finite_nonneg("decode_ms_total", decode_ms_total)
        steps = _int_at_least("decode_steps", decode_steps, 1)
        h = _finite_nonneg("host_ms", host_ms)
        d = d_total / steps
        with self._lock:
            s = self._sizes.get(m)
            if s is None:
                self._sizes[m] = _SizeCost(p, d, h)
                return
            mean = s.prefill_ms + steps * s.decode_ms_per_step + s.host_ms  # the estimate this pass ran against
            s.overruns.append(min(p + d_total + h - mean, (self.outlier_factor - 1.0) * mean))
            s.spread = None
            a, f = self.ema_alpha, self.outlier_factor
            clipped = [f * old if new > f * old > 0.0 else new
                       for new, old in ((p, s.prefill_ms), (d, s.decode_ms_per_step), (h, s.host_ms))]
            self.clipped_samples += clipped != [p, d, h]
            s.prefill_ms += a * (clipped[0] - s.prefill_ms)
            s.decode_ms_per_step += a * (clipped[1] - s.decode_ms_per_step)
            s.host_ms += a * (clipped[2] - s.host_ms)
            s.recent.append((p, d, h))
            s.samples += 1

    def relax(self, batch_size: int) -> bool:
        """A cycle refused for the cost of ``batch_size`` although time was left: refused passes are not measured,
        so a slow spell would stay in the estimate for good. AdmissionController's rule per refused chunk (its
        ``_relax_locked`` says why): the largest overrun leaves the spread's window while the spread is above what
        the bulk of the window predicts (median + z * MAD; with fewer than SPREAD_MIN_SAMPLES overruns, always),
        and each EMA moves RELAX_PER_REFUSAL of the way to the median of its recent real samples when that is
        lower. True when something moved."""
        m = _int_at_least("batch_size", batch_size, 1)
        with self._lock:
            s = self._sizes.get(m)
            if s is None:
                return False
            moved = False
            if s.overruns and self.cost_quantile > 0.0 and (len(s.overruns) < SPREAD_MIN_SAMPLES or
                                                            self._spread_locked(s) > self._robust_spread_locked(s)):
                s.overruns.remove(max(s.overruns))
                s.spread = None
                moved = True
            for i, attr in enumerate(("prefill_ms", "decode_ms_per_step", "host_ms")):
                target, current = median([r[i] for r in s.recent]), getattr(s, attr)
                if target < current:
                    setattr(s, attr, current + RELAX_PER_REFUSAL * (target - current))
                    moved = True
            self.relaxations += moved
            return moved

    def _robust_spread_locked(self, s: _SizeCost) -> float:
        return robust_upper_quantile(s.overruns, self.cost_quantile)

    def _spread_locked(self, s: _SizeCost) -> float:
        if not s.overruns or self.cost_quantile <= 0.0:
            return 0.0
        if s.spread is None:  # sorted once per record, not once per estimate (the scheduler asks every cycle)
            q = self.cost_quantile if len(s.overruns) >= SPREAD_MIN_SAMPLES else 1.0
            s.spread = max(0.0, upper_quantile(s.overruns, q))
        return s.spread

    def _components(self, m: int) -> Optional[tuple[float, float, float, float]]:
        """(prefill ms, decode ms per step, host ms, spread ms) for a batch of ``m``; None before any record.

        A size never measured: between two measured sizes, each part is interpolated linearly (exact for an
        affine cost, weights once + work per robot; an over-estimate for a roofline cost, flat while memory-bound
        then linear, which is convex), with the larger neighbour spread. Above the largest measured size L it is
        L's cost scaled by m / L: batching does not raise the cost per robot, so this is an upper bound and never
        below L's estimate (warm up at the sizes you mean to use, or the fleet batches less than it could).
        Below the smallest measured size: that size's cost (a smaller batch is not slower)."""
        if m in self._sizes:
            s = self._sizes[m]
            return s.prefill_ms, s.decode_ms_per_step, s.host_ms, self._spread_locked(s)
        below = max((k for k in self._sizes if k < m), default=None)
        above = min((k for k in self._sizes if k > m), default=None)
        if below is None and above is None:
            return None
        if below is None or above is None:
            k = above if below is None else below
            scale = 1.0 if below is None else m / k
            s = self._sizes[k]
            return (s.prefill_ms * scale, s.decode_ms_per_step * scale, s.host_ms * scale,
                    self._spread_locked(s) * scale)
        lo, hi, t = self._sizes[below], self._sizes[above], (m - below) / (above - below)
        return (lo.prefill_ms + t * (hi.prefill_ms - lo.prefill_ms),
                lo.decode_ms_per_step + t * (hi.decode_ms_per_step - lo.decode_ms_per_step),
                lo.host_ms + t * (hi.host_ms - lo.host_ms),
                max(self._spread_locked(lo), self._spread_locked(hi)))

    def mean_ms(self, batch_size: int, decode_steps: int) -> float:
        """Mean time from decision to results for ``batch_size`` robots (the engine's pass + the host's part);
        0.0 before any record (the first pass runs to learn it)."""
        m, steps = _int_at_least("batch_size", batch_size, 1), _int_at_least("decode_steps", decode_steps, 0)
        with self._lock:
            c = self._components(m)
        return 0.0 if c is None else c[0] + steps * c[1] + c[2]

    def estimate_ms(self, batch_size: int, decode_steps: int) -> float:
        """Conservative pass time: mean + spread, and never below the estimate of a smaller measured size (a
        noisy EMA must not make a larger batch look faster). 0.0 before any record."""
        m, steps = _int_at_least("batch_size", batch_size, 1), _int_at_least("decode_steps", decode_steps, 0)
        with self._lock:
            out = 0.0
            for k in [k for k in self._sizes if k < m] + [m]:
                c = self._components(k)
                if c is not None:
                    out = max(out, c[0] + steps * c[1] + c[2] + c[3])
        return out

    def stats(self) -> dict:
        with self._lock:
            sizes = {str(k): {"prefill_ema_ms": s.prefill_ms, "decode_ema_ms_per_step": s.decode_ms_per_step,
                              "host_ema_ms": s.host_ms, "spread_ms": self._spread_locked(s), "samples": s.samples}
                     for k, s in sorted(self._sizes.items())}
            return {"ema_alpha": self.ema_alpha, "cost_quantile": self.cost_quantile,
                    "clipped_samples": self.clipped_samples, "relaxations": self.relaxations,
                    "by_batch_size": sizes}


@dataclass
class _Robot:
    admitted: int = 0
    refused_deadline: int = 0
    refused_capacity: int = 0
    bad_deadline: int = 0
    probes: int = 0
    starvation_promotions: int = 0
    refusal_streak: int = 0  # ready cycles refused in a row, any reason (how long its arm has held)
    longest_refusal_streak: int = 0
    capacity_streak: int = 0  # capacity refusals since its last admission (the starvation count)
    last_admission: int = -1  # the fleet's admission number of its last admission (ties of equal deadlines)

    def counters(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "last_admission"}  # counts only


@dataclass(frozen=True)
class BatchPlan:
    now_ns: int
    batch: tuple[str, ...]  # admitted robots, in admission order (promoted first, then EDF)
    estimate_ms: float  # conservative estimate of the batch's pass (0.0 for an empty batch)
    refused: dict[Any, str]  # every other ready name -> DEADLINE / CAPACITY / BAD_DEADLINE / UNKNOWN
    promoted: tuple[str, ...] = ()  # admitted ahead of EDF order for starvation
    probe: bool = False  # the batch is a probe: admitted although the estimate did not fit
    counters: dict[str, dict] = field(default_factory=dict)  # every joined robot's counters after this plan


class FleetScheduler:
    """Thread-safe: join / leave from discovery callbacks, plan / record from the inference thread."""

    def __init__(self, max_batch: int, safety_margin_ms: float = 2.0, starvation_limit: int = 3,
                 cost_model: Optional[BatchCostModel] = None, decode_steps: int = 8,
                 probe_after_cycles: int = 90) -> None:
        """``starvation_limit``: 0 disables promotion. ``probe_after_cycles``: 0 disables probing."""
        self.max_batch = _int_at_least("max_batch", max_batch, 1)
        self.safety_margin_ms = _finite_nonneg("safety_margin_ms", safety_margin_ms)
        self.starvation_limit = _int_at_least("starvation_limit", starvation_limit, 0)
        self.decode_steps = _int_at_least("decode_steps", decode_steps, 1)
        self.probe_after_cycles = _int_at_least("probe_after_cycles", probe_after_cycles, 0)
        self.cost_model = BatchCostModel() if cost_model is None else cost_model
        self._lock = threading.Lock()
        self._robots: dict[str, _Robot] = {}
        self._empty_cycles = 0  # cycles in a row with nobody admitted although some robot had time left
        self.cycles = self.left = self.unknown_robot = self.probes = 0
        self._unknown_recent: deque[str] = deque(maxlen=UNKNOWN_NAMES_KEPT)
        self.batch_sizes: dict[int, int] = {}
        # fleet totals since start: they keep the counts of robots that have left
        self.totals = dict.fromkeys(("admitted", "refused_deadline", "refused_capacity", "bad_deadline",
                                     "starvation_promotions"), 0)

    def join(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"robot name must be a non-empty string, got {name!r}")
        with self._lock:
            if name in self._robots:
                raise ValueError(f"robot {name!r} has already joined")
            self._robots[name] = _Robot()

    def leave(self, name: str) -> None:
        with self._lock:
            if self._robots.pop(name, None) is None:
                raise ValueError(f"robot {name!r} has not joined")
            self.left += 1

    @property
    def robots(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._robots)

    def record(self, batch_size: int, prefill_ms: float, decode_ms_total: float, decode_steps: int,
               host_ms: float = 0.0) -> None:
        """The real cost of a pass the plan admitted (BatchCostModel.record)."""
        self.cost_model.record(batch_size, prefill_ms, decode_ms_total, decode_steps, host_ms)

    def plan(self, now_ns: int, ready: Mapping[Any, Any]) -> BatchPlan:
        """The batch for this cycle from ``ready``: robot name -> its chunk's deadline (absolute ns)."""
        now = _ns_or_none(now_ns)
        if now is None or not isinstance(ready, Mapping):
            raise ValueError(f"plan needs a finite now_ns and a mapping name -> deadline_ns, got "
                             f"{now_ns!r}, {type(ready).__name__}")
        margin_ns = _ms_to_ns(self.safety_margin_ms)
        steps = self.decode_steps
        estimates = [0.0] + [self.cost_model.estimate_ms(m, steps) for m in range(1, self.max_batch + 1)]
        refused: dict[Any, str] = {}
        candidates: list[tuple[int, str]] = []  # (latest finish ns, name) of robots that fit alone
        short_of_time: list[tuple[int, str]] = []  # refused for cost alone although time was left (probe pool)
        with self._lock:
            for name, deadline in ready.items():
                if not isinstance(name, str) or name not in self._robots:
                    refused[name] = UNKNOWN
                    self.unknown_robot += 1
                    self._unknown_recent.append(repr(name)[:64])
                    continue
                deadline = _ns_or_none(deadline)
                if deadline is None:
                    refused[name] = BAD_DEADLINE
                    continue
                latest_finish = deadline - margin_ns
                if latest_finish > now and now + _ms_to_ns(estimates[1]) <= latest_finish:
                    candidates.append((latest_finish, name))
                else:
                    refused[name] = DEADLINE
                    if latest_finish > now:
                        short_of_time.append((latest_finish, name))
            limit = self.starvation_limit
            starving = {n for _, n in candidates if limit and self._robots[n].capacity_streak >= limit}
            # equal deadlines (the fleet loop gives every robot the cycle's): the least recently admitted first
            order = (sorted((c for c in candidates if c[1] in starving),
                            key=lambda c: (-self._robots[c[1]].capacity_streak, c))
                     + sorted((c for c in candidates if c[1] not in starving),
                              key=lambda c: (c[0], self._robots[c[1]].last_admission, c[1])))
            batch: list[str] = []
            earliest: Optional[int] = None
            for latest_finish, name in order:
                tighter = latest_finish if earliest is None else min(earliest, latest_finish)
                if len(batch) < self.max_batch and now + _ms_to_ns(estimates[len(batch) + 1]) <= tighter:
                    batch.append(name)
                    earliest = tighter
                else:
                    refused[name] = CAPACITY
            probe = False
            if batch or not short_of_time:
                self._empty_cycles = 0
            else:
                self._empty_cycles += 1
                self.cost_model.relax(1)  # the estimate that refused them: a robot alone (module docstring)
                if self.probe_after_cycles and self._empty_cycles >= self.probe_after_cycles:
                    name = min(short_of_time)[1]
                    del refused[name]
                    batch, probe, self._empty_cycles = [name], True, 0
                    self.probes += 1
            self._count_locked(batch, refused, starving, probe)
            return BatchPlan(now_ns=now, batch=tuple(batch),
                             estimate_ms=estimates[len(batch)], refused=refused,
                             promoted=tuple(n for n in batch if n in starving), probe=probe,
                             counters={n: r.counters() for n, r in self._robots.items()})

    def _count_locked(self, batch: list[str], refused: dict[Any, str], starving: set[str], probe: bool) -> None:
        self.cycles += 1
        if batch:
            self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
        for i, name in enumerate(batch):
            r = self._robots[name]
            r.admitted += 1
            r.probes += probe
            r.starvation_promotions += name in starving
            r.refusal_streak = r.capacity_streak = 0
            r.last_admission = self.totals["admitted"] + i  # numbered in the batch's order: FIFO rotation
        self.totals["admitted"] += len(batch)
        self.totals["starvation_promotions"] += sum(n in starving for n in batch)
        for name, reason in refused.items():
            r = self._robots.get(name) if reason != UNKNOWN else None
            if r is None:
                continue
            r.refused_deadline += reason == DEADLINE
            r.refused_capacity += reason == CAPACITY
            r.bad_deadline += reason == BAD_DEADLINE
            r.capacity_streak += reason == CAPACITY
            r.refusal_streak += 1
            r.longest_refusal_streak = max(r.longest_refusal_streak, r.refusal_streak)
            self.totals[{DEADLINE: "refused_deadline", CAPACITY: "refused_capacity",
                         BAD_DEADLINE: "bad_deadline"}[reason]] += 1

    def stats(self) -> dict:
        """Per robot counters and fleet totals, JSON-able (for /diagnostics)."""
        with self._lock:
            robots = {n: r.counters() for n, r in self._robots.items()}
            fleet = dict(self.totals)
            fleet.update(robots=len(robots), left=self.left, cycles=self.cycles, probes=self.probes,
                         unknown_robot=self.unknown_robot, unknown_recent=list(self._unknown_recent),
                         longest_refusal_streak=max((c["longest_refusal_streak"] for c in robots.values()),
                                                    default=0),  # of the robots present
                         batch_sizes={str(k): v for k, v in sorted(self.batch_sizes.items())},
                         max_batch=self.max_batch, decode_steps=self.decode_steps,
                         safety_margin_ms=self.safety_margin_ms,
                         starvation_limit=self.starvation_limit)
        return {"robots": robots, "fleet": fleet, "cost": self.cost_model.stats()}
