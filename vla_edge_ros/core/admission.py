"""Deadline admission control for inference chunks, and the fixed control-cycle grid.

Before each chunk the inference loop asks: does the estimated chunk time fit in the time left to this cycle's
deadline minus a safety margin? The estimate has two parts:

- the mean, ``prefill_ema + decode_tokens * decode_per_token_ema``: two separate exponential moving averages,
  because prefill cost scales with context (KV occupancy) while decode cost scales with the number of
  generated tokens;
- the spread: the ``cost_quantile`` quantile of the recent overruns of real chunks over the mean estimate that
  was made for them (last ``SPREAD_WINDOW`` chunks). The EMA is a mean: a chunk whose mean fits just inside the
  budget is late about half the time (measured on a noisy 2-core CPU: 17 % of admitted chunks missed in a
  20-minute soak with the mean alone). Adding a high quantile of the overruns makes admission refuse what it
  cannot *reliably* finish; on a quiet GPU the spread is a fraction of a millisecond.

A refused chunk is a *fallback* (the action publisher repeats / holds); an admitted chunk's real duration is
recorded and fed back into the EMAs and the overrun window.

Warm-up chunks (run at configure time, outside the control loop) only *seed* the EMAs: they are not counted in
admitted / refused / deadline-miss figures nor in the recorded chunk durations.
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from vla_edge_ros import params
from vla_edge_ros.core.metrics import LatencyStats

RECENT_SAMPLES = 32  # real chunk costs whose median is the relaxation target
RELAX_PER_REFUSAL = 0.1  # fraction of the gap to that median closed per refused cycle (7 refusals, ~0.25 s at 30 Hz, halve it)
# Overruns whose quantile is the spread: 256 chunks are ~8.5 s at 30 Hz, long enough that the 0.99 quantile is
# the 3rd-largest overrun (one stray spike does not move it), short enough to follow a change of load.
SPREAD_WINDOW = 256
_NORMAL = statistics.NormalDist()
SPREAD_MIN_SAMPLES = 8  # below this the spread is the largest overrun seen so far (too few for a quantile)


def upper_quantile(values, q: float) -> float:
    """The ``q`` quantile of ``values`` by the nearest-rank rule (the smallest value with at least a ``q``
    share of the values at or below it): never interpolated below an observed value."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def median(values) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def robust_upper_quantile(values, q: float) -> float:
    """The ``q`` quantile that the median and the median absolute deviation of ``values`` predict for a normal
    spread: a few large outliers barely move it, a uniformly wider noise does (the relaxation's yardstick, here and
    in core/fleet_scheduler.py)."""
    med = median(values)
    mad = median([abs(x - med) for x in values])
    return max(0.0, med + _NORMAL.inv_cdf(min(q, 0.9999)) * 1.4826 * mad)


@dataclass(frozen=True)
class Decision:
    admit: bool
    estimate_ms: float
    budget_ms: float  # time left to the deadline minus the safety margin
    probe: bool = False  # admitted although the estimate did not fit (see ``probe_after_refusals``)


SETTINGS = ("deadline_ms", "safety_margin_ms", "ema_alpha", "cost_quantile")  # what update() may change


def _finite_nonneg(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name} must be a finite, non-negative number of ms, got {value!r}")
    return value


class AdmissionController:
    """Thread-safe: decide/record from the inference thread, update from a parameter callback, stats anywhere."""

    def __init__(self, deadline_ms: float = 33.0, safety_margin_ms: float = 2.0, ema_alpha: float = 0.2,
                 history: int = 4096, probe_after_refusals: int = 90, outlier_factor: float = 3.0,
                 cost_quantile: float = params.BY_NAME["cost_quantile"].default) -> None:
        """``probe_after_refusals``: refused chunks only update the EMAs when they run, so an estimate that got
        too high (a slow spell, a pessimistic seed) would refuse forever. After this many consecutive refusals
        one chunk is admitted anyway as a probe to re-measure the cost (0 disables probing).

        ``outlier_factor``: a sample fed to an EMA is clipped at this multiple of the current EMA. One hung
        chunk (a 900 ms stall measured in the fault test) otherwise lifted the estimate so far above the deadline
        that every chunk was refused and the robot held for ~40 s, recovering one probe per 90 refusals; clipped,
        it raises the estimate by at most alpha * (factor - 1) (+40 %), while a real, lasting cost increase still
        converges geometrically. The real duration is still recorded in ``chunk_ms`` and as a deadline miss.

        ``cost_quantile``: the quantile of recent overruns added to the mean estimate (0 = the mean alone).
        Overruns are clipped like EMA samples, at ``(outlier_factor - 1)`` times the mean estimate."""
        self._lock = threading.Lock()
        self.deadline_ms = 0.0
        self.safety_margin_ms = 0.0
        self.ema_alpha = 0.0
        self.cost_quantile = 0.0
        self._apply({"deadline_ms": deadline_ms, "safety_margin_ms": safety_margin_ms, "ema_alpha": ema_alpha,
                     "cost_quantile": cost_quantile})
        self.prefill_ema_ms: Optional[float] = None
        self.decode_ema_ms_per_token: Optional[float] = None
        self.seeded_with: Optional[tuple[float, float]] = None
        self.admitted = 0
        self.refused = 0
        self.refused_for_cost = 0  # the estimate exceeded the time left minus the margin
        self.refused_no_time = 0  # not even the margin was left (the frame came too late in its cycle)
        self.probes = 0
        self.probe_after_refusals = int(probe_after_refusals)
        self._consecutive_refusals = 0
        self.recorded = 0
        self.deadline_misses = 0
        self.chunk_ms = LatencyStats(history)  # real durations of admitted chunks (live only)
        if not (math.isfinite(outlier_factor) and outlier_factor >= 1.0):
            raise ValueError(f"outlier_factor must be >= 1, got {outlier_factor!r}")
        self.outlier_factor = float(outlier_factor)
        self.clipped_samples = 0
        # Relaxation while refusing: a refused chunk yields no measurement, so after a slow spell (CPU contention,
        # a long context that has since been evicted) the EMAs would stay high and refuse for seconds (measured in
        # the CPU demo: 0 fresh actions for 6 s with chunk p50 20 ms against a 31 ms budget). Each refusal moves
        # each EMA RELAX_PER_REFUSAL of the way toward the median of its recent real samples when that median is
        # lower, so a transient spike expires while a lasting cost increase (median above budget) keeps refusing.
        self._recent_prefill: deque[float] = deque(maxlen=RECENT_SAMPLES)
        self._recent_decode: deque[float] = deque(maxlen=RECENT_SAMPLES)
        self.relaxations = 0
        self._overruns: deque[float] = deque(maxlen=SPREAD_WINDOW)  # real - mean estimate, ms (may be < 0)

    # ---- configuration ----------------------------------------------------------------------------------
    def _apply(self, values: dict) -> None:
        """Validate every value with the parameter registry (and the cross check), then apply all or nothing."""
        unknown = [k for k in values if k not in SETTINGS]
        if unknown:
            raise ValueError(f"AdmissionController.update: unknown setting(s) {', '.join(unknown)}")
        reasons = [r for k, v in values.items() if (r := params.validate(k, v))]
        if reasons:
            raise ValueError("; ".join(reasons))
        with self._lock:  # merge, cross-check and apply as one step against concurrent updates
            merged = {**{k: getattr(self, k) for k in SETTINGS}, **{k: float(v) for k, v in values.items()}}
            reasons = params.validate_combination(
                {"deadline_ms": merged["deadline_ms"], "safety_margin_ms": merged["safety_margin_ms"]})
            if reasons:
                raise ValueError("; ".join(reasons))
            self.deadline_ms = merged["deadline_ms"]
            self.safety_margin_ms = merged["safety_margin_ms"]
            self.ema_alpha = merged["ema_alpha"]
            self.cost_quantile = merged["cost_quantile"]

    def update(self, **values: float) -> None:
        """Live change of deadline_ms / safety_margin_ms / ema_alpha / cost_quantile; ValueError with the reasons."""
        if values:
            self._apply(values)

    def seed(self, prefill_ms: float, decode_ms_per_token: float) -> None:
        """Set both EMAs from warm-up measurements (replaces any previous estimate; live figures untouched)."""
        p = _finite_nonneg("prefill_ms", prefill_ms)
        d = _finite_nonneg("decode_ms_per_token", decode_ms_per_token)
        with self._lock:
            self.prefill_ema_ms = p
            self.decode_ema_ms_per_token = d
            self.seeded_with = (p, d)

    @property
    def seeded(self) -> bool:
        return self.prefill_ema_ms is not None

    # ---- per chunk --------------------------------------------------------------------------------------
    def mean_estimate_ms(self, decode_tokens: int) -> float:
        """The EMAs' mean chunk time; 0.0 before any seed or record."""
        if decode_tokens < 0:
            raise ValueError(f"decode_tokens must be >= 0, got {decode_tokens}")
        with self._lock:
            return self._mean_locked(decode_tokens)

    def _mean_locked(self, decode_tokens: int) -> float:
        p, d = self.prefill_ema_ms, self.decode_ema_ms_per_token
        if p is None or d is None:
            return 0.0
        return p + decode_tokens * d

    def spread_ms(self) -> float:
        """The ``cost_quantile`` quantile of recent overruns (never negative; 0.0 with no samples or q = 0)."""
        with self._lock:
            return self._spread_locked()

    def _spread_locked(self) -> float:
        if not self._overruns or self.cost_quantile <= 0.0:
            return 0.0
        q = self.cost_quantile if len(self._overruns) >= SPREAD_MIN_SAMPLES else 1.0
        return max(0.0, upper_quantile(self._overruns, q))

    def _robust_spread_locked(self) -> float:
        return robust_upper_quantile(self._overruns, self.cost_quantile)

    def estimate_ms(self, decode_tokens: int) -> float:
        """Estimated chunk time: mean + spread; 0.0 before any seed or record (the first chunk is admitted to
        learn its cost)."""
        if decode_tokens < 0:
            raise ValueError(f"decode_tokens must be >= 0, got {decode_tokens}")
        with self._lock:
            if self.prefill_ema_ms is None:
                return 0.0
            return self._mean_locked(decode_tokens) + self._spread_locked()

    def decide(self, time_left_ms: float, decode_tokens: int) -> Decision:
        time_left_ms = float(time_left_ms)
        if math.isnan(time_left_ms):
            raise ValueError("time_left_ms is NaN")
        estimate = self.estimate_ms(decode_tokens)
        with self._lock:
            budget = time_left_ms - self.safety_margin_ms
            admit = estimate <= budget and budget > 0.0
            probe = (not admit and budget > 0.0 and self.probe_after_refusals > 0
                     and self._consecutive_refusals >= self.probe_after_refusals)
            if admit or probe:
                self.admitted += 1
                self.probes += probe
                self._consecutive_refusals = 0
            else:
                self.refused += 1
                self._consecutive_refusals += 1
                if budget <= 0.0:
                    self.refused_no_time += 1
                if estimate > budget:
                    self.refused_for_cost += 1
                    self._relax_locked()
        return Decision(admit=admit or probe, estimate_ms=estimate, budget_ms=budget, probe=probe)

    def _relax_locked(self) -> None:
        """A refusal for cost: a refused chunk gives no sample, so both parts of the estimate would keep a slow
        spell forever. Each EMA moves toward its recent median (below), and the largest overrun leaves the
        spread's window while the spread is above what the bulk of the window says (``_robust_spread_locked``): a
        burst of k slow chunks expires after k refusals (~k cycles), a lasting rise of the noise does not (its
        quantile is what the median and MAD predict), and a lasting rise of the mean keeps refusing. With fewer
        than SPREAD_MIN_SAMPLES overruns there is no bulk to judge by (the spread is their maximum): one slow
        first chunk must not stop a slow camera's stream, so the largest leaves at each such refusal."""
        moved = False
        if self._overruns and self.cost_quantile > 0.0 and (len(self._overruns) < SPREAD_MIN_SAMPLES
                                                            or self._spread_locked() > self._robust_spread_locked()):
            self._overruns.remove(max(self._overruns))
            moved = True
        if self._recent_prefill and self.prefill_ema_ms is not None:
            target = median(self._recent_prefill)
            if target < self.prefill_ema_ms:
                self.prefill_ema_ms += RELAX_PER_REFUSAL * (target - self.prefill_ema_ms)
                moved = True
        if self._recent_decode and self.decode_ema_ms_per_token is not None:
            target = median(self._recent_decode)
            if target < self.decode_ema_ms_per_token:
                self.decode_ema_ms_per_token += RELAX_PER_REFUSAL * (target - self.decode_ema_ms_per_token)
                moved = True
        self.relaxations += moved

    def record(self, prefill_ms: float, decode_ms_total: float, decode_tokens: int, missed_deadline: bool) -> None:
        """Feed back an admitted chunk's real cost (prefill = everything that is not decode, encode included)."""
        p = _finite_nonneg("prefill_ms", prefill_ms)
        d_total = _finite_nonneg("decode_ms_total", decode_ms_total)
        if decode_tokens < 1:
            raise ValueError(f"decode_tokens must be >= 1, got {decode_tokens}")
        d = d_total / decode_tokens
        with self._lock:
            if self.prefill_ema_ms is not None:  # the overrun against the estimate this chunk was admitted with
                mean = self._mean_locked(decode_tokens)
                self._overruns.append(min(p + d_total - mean, (self.outlier_factor - 1.0) * mean))
            a, f = self.ema_alpha, self.outlier_factor
            p_ema, d_ema = p, d
            if self.prefill_ema_ms is not None and p > f * self.prefill_ema_ms > 0.0:
                p_ema = f * self.prefill_ema_ms
            if self.decode_ema_ms_per_token is not None and d > f * self.decode_ema_ms_per_token > 0.0:
                d_ema = f * self.decode_ema_ms_per_token
            self.clipped_samples += (p_ema, d_ema) != (p, d)
            self.prefill_ema_ms = p if self.prefill_ema_ms is None else (1 - a) * self.prefill_ema_ms + a * p_ema
            self.decode_ema_ms_per_token = (d if self.decode_ema_ms_per_token is None
                                            else (1 - a) * self.decode_ema_ms_per_token + a * d_ema)
            self._recent_prefill.append(p)
            self._recent_decode.append(d)
            self.recorded += 1
            if missed_deadline:
                self.deadline_misses += 1
        self.chunk_ms.add(p + d_total)

    def count_miss(self) -> None:
        """A chunk that failed or was abandoned after overrunning its deadline (no cost sample to record)."""
        with self._lock:
            self.deadline_misses += 1

    def stats(self) -> dict:
        with self._lock:
            out = {
                "deadline_ms": self.deadline_ms,
                "safety_margin_ms": self.safety_margin_ms,
                "ema_alpha": self.ema_alpha,
                "cost_quantile": self.cost_quantile,
                "spread_ms": self._spread_locked(),
                "overrun_samples": len(self._overruns),
                "prefill_ema_ms": self.prefill_ema_ms,
                "decode_ema_ms_per_token": self.decode_ema_ms_per_token,
                "seeded_with": self.seeded_with,
                "admitted": self.admitted,
                "refused": self.refused,
                "refused_for_cost": self.refused_for_cost,
                "refused_no_time": self.refused_no_time,
                "probes": self.probes,
                "recorded": self.recorded,
                "clipped_samples": self.clipped_samples,
                "relaxations": self.relaxations,
                "deadline_misses": self.deadline_misses,
            }
        out["chunk_ms"] = self.chunk_ms.summary()
        return out


class CycleClock:
    """Control cycles on a fixed grid ``start_ns + k * period``; times are monotonic nanoseconds.

    The grid never drifts with processing time: a chunk that runs long does not shift later cycles, it just
    leaves less time (or none) to the cycle it lands in.
    """

    def __init__(self, period_ms: float, start_ns: Optional[int] = None) -> None:
        self._period_ns = 0
        self.set_period_ms(period_ms, start_ns)

    @property
    def period_ms(self) -> float:
        return self._period_ns / 1e6

    @property
    def start_ns(self) -> int:
        return self._start_ns

    def set_period_ms(self, period_ms: float, start_ns: Optional[int] = None) -> None:
        """(Re)start the grid with a new period; the new grid starts at ``start_ns`` (default: now)."""
        period_ms = float(period_ms)
        if not (math.isfinite(period_ms) and period_ms > 0.0):
            raise ValueError(f"period_ms must be a positive number, got {period_ms!r}")
        self._period_ns = max(1, int(round(period_ms * 1e6)))
        self._start_ns = time.monotonic_ns() if start_ns is None else int(start_ns)

    def cycle_index(self, now_ns: int) -> int:
        return (int(now_ns) - self._start_ns) // self._period_ns

    def cycle_start(self, now_ns: int) -> int:
        """Start (ns) of the cycle containing ``now_ns``."""
        return self._start_ns + self.cycle_index(now_ns) * self._period_ns

    def next_deadline(self, now_ns: int) -> int:
        """End (ns) of the cycle containing ``now_ns``, i.e. the start of the next one."""
        return self.cycle_start(now_ns) + self._period_ns

    def deadline_ns(self, now_ns: int, deadline_ms: float) -> int:
        """This cycle's deadline: cycle start + ``deadline_ms``."""
        return self.cycle_start(now_ns) + int(round(float(deadline_ms) * 1e6))

    def time_left_ms(self, now_ns: int, deadline_ms: float) -> float:
        """Milliseconds from ``now_ns`` to this cycle's deadline (negative once it has passed)."""
        return (self.deadline_ns(now_ns, deadline_ms) - int(now_ns)) / 1e6
