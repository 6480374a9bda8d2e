"""The pure half of `vla_eval` (bench/eval.py): settings, the grid, the 95 % interval and one row per setting.

Why apart from the runner: what a setting is, which settings a set of flags expands to, and how episode JSON
lines plus the runtime's ``--stats-out`` figures become a table row decide what the benchmark claims, so they are
tested without ROS (test/test_eval_grid.py). No rclpy, no subprocesses here.

A setting is one runtime + sim pair: a *model* setting runs ``vla_runtime`` (one eviction policy, KV budget,
deadline, injected chunk latency, backend, checkpoint) against ``vla_sim`` with ``sim_policy=external``; the
*expert* and *hold* baselines run ``vla_sim`` alone with ``sim_policy`` expert / hold (the same control timing,
no runtime). The *random-weight* baseline is the first model setting of a task with the embedded default
(``checkpoint`` empty); with no ``--checkpoint`` it IS that grid point, run once and labelled as both.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Mapping, Optional, Sequence

from vla_edge_ros import params as registry
from vla_edge_ros.sim.tasks import task_spec

KINDS = ("model", "expert", "hold")
BASELINES = ("expert", "random", "hold")
SMALL_BUDGET = "small"  # --kv-budgets token: the smallest budget with SMALL_BUDGET_FRAMES frames after the prefix
SMALL_BUDGET_FRAMES = 4  # < 1 s of frames at 5-10 Hz: eviction starts within the first second of an episode
Z95 = 1.959963984540054  # two-sided 95 % normal quantile


@dataclass(frozen=True)
class Setting:
    kind: str  # 'model' | 'expert' | 'hold'
    task: str
    backend: str = "numpy"
    eviction_policy: str = "semantic"
    kv_budget_tokens: int = 0  # 0 = the backend's default (params.KV_BUDGET_BY_BACKEND)
    deadline_ms: float = 33.0
    inject_ms: float = 0.0  # extra chunk latency through VLA_FAULT_INJECT=hang:<ms>@1+ (0 = none)
    checkpoint: str = ""  # empty = the embedded random-weight default
    baseline: str = ""  # '' | 'expert' | 'random' | 'hold': the baseline row(s) this setting stands for

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"setting kind {self.kind!r} is not one of {', '.join(KINDS)}")
        task_spec(self.task)  # ValueError for an unknown task
        if self.baseline and self.baseline not in BASELINES:
            raise ValueError(f"baseline {self.baseline!r} is not one of {', '.join(BASELINES)}")
        if self.kind == "model":
            for name, value in (("backend", self.backend), ("eviction_policy", self.eviction_policy),
                                ("kv_budget_tokens", self.kv_budget_tokens), ("deadline_ms", float(self.deadline_ms))):
                why = registry.validate(name, value)
                if why:
                    raise ValueError(why)
            if not (self.inject_ms >= 0 and math.isfinite(self.inject_ms)):
                raise ValueError(f"injected latency must be >= 0 ms, got {self.inject_ms}")

    @property
    def instruction(self) -> str:
        return task_spec(self.task).instruction

    def key(self) -> tuple:
        """Identity of the run (the baseline label is not part of it: a grid point may also be a baseline)."""
        d = asdict(self)
        d.pop("baseline")
        if self.kind != "model":  # a baseline without a runtime has no runtime parameters
            d = {"kind": self.kind, "task": self.task}
        return tuple(sorted(d.items()))

    def kv_frames(self, tokens_per_frame: int = 32) -> Optional[int]:
        """Frames the KV budget retains after the pinned instruction prefix (model settings; None when the
        budget is the default of backend 'auto', which only the runtime resolves)."""
        if self.kind != "model" or (not self.kv_budget_tokens and self.backend not in registry.KV_BUDGET_BY_BACKEND):
            return None
        budget = registry.resolve_kv_budget(self.kv_budget_tokens, self.backend, tokens_per_frame)
        return (budget - prefix_tokens(self.task)) // tokens_per_frame

    @property
    def label(self) -> str:
        if self.kind == "expert":
            return f"{self.task}: scripted expert (baseline)"
        if self.kind == "hold":
            return f"{self.task}: always hold (baseline)"
        budget = f"kv {self.kv_budget_tokens}" if self.kv_budget_tokens else "kv default"
        model = "random weights" if not self.checkpoint else "checkpoint"
        tag = " (random-weight baseline)" if self.baseline == "random" and self.checkpoint == "" else ""
        return (f"{self.task}: {model}, {self.eviction_policy}, {budget}, deadline {self.deadline_ms:g} ms, "
                f"+{self.inject_ms:g} ms, {self.backend}{tag}")

    @property
    def slug(self) -> str:
        """A file-name-safe name (log directory)."""
        if self.kind != "model":
            return f"{self.task}_{self.kind}"
        s = (f"{self.task}_{'ckpt' if self.checkpoint else 'random'}_{self.eviction_policy}_kv{self.kv_budget_tokens}"
             f"_dl{self.deadline_ms:g}_inj{self.inject_ms:g}_{self.backend}")
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", s)


def prefix_tokens(task: str) -> int:
    """Length of the pinned prefix of the task's instruction (one token per UTF-8 byte, engine/factory.py)."""
    return len(task_spec(task).instruction.encode("utf-8"))


def small_budget(task: str, tokens_per_frame: int = 32, frames: int = SMALL_BUDGET_FRAMES) -> int:
    """The smallest multiple of tokens_per_frame holding the task's prefix plus ``frames`` frames."""
    need = prefix_tokens(task) + frames * tokens_per_frame
    return -(-need // tokens_per_frame) * tokens_per_frame


def parse_budget(text: str, task: str, tokens_per_frame: int = 32) -> int:
    text = text.strip()
    if text == SMALL_BUDGET:
        return small_budget(task, tokens_per_frame)
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"kv budget {text!r} is neither an integer nor {SMALL_BUDGET!r}") from None
    if value:
        reasons = registry.validate_all({"kv_budget_tokens": value, "tokens_per_frame": tokens_per_frame},
                                        prefix_tokens=prefix_tokens(task))
        if reasons:
            raise ValueError(f"kv budget {value} for task {task!r}: {'; '.join(reasons)}")
    return value


def expand_grid(tasks: Sequence[str], policies: Sequence[str], budgets: Sequence[str], deadlines: Sequence[float],
                latencies: Sequence[float], backends: Sequence[str], baselines: Sequence[str] = BASELINES,
                checkpoint: str = "") -> list[Setting]:
    """Every model setting of the cross product (per task: backend x policy x budget x deadline x latency), then
    the baselines of each task. The random-weight baseline is the task's first model setting with no checkpoint
    and no injected latency; equal settings run once (the first one keeps its place, labelled as both)."""
    bad = [b for b in baselines if b not in BASELINES]
    if bad:
        raise ValueError(f"unknown baseline(s) {', '.join(bad)}; choose from {', '.join(BASELINES)}")
    for name, values in (("tasks", tasks), ("policies", policies), ("kv budgets", budgets),
                         ("deadlines", deadlines), ("latencies", latencies), ("backends", backends)):
        if not values:
            raise ValueError(f"no {name} given")
    out: list[Setting] = []
    index: dict[tuple, int] = {}

    def add(s: Setting) -> None:
        k = s.key()
        if k in index:
            i = index[k]
            if s.baseline and not out[i].baseline:
                out[i] = replace(out[i], baseline=s.baseline)
            return
        index[k] = len(out)
        out.append(s)

    for task in tasks:
        first: Optional[Setting] = None
        for backend in backends:
            for policy in policies:
                for budget in budgets:
                    for deadline in deadlines:
                        for inject in latencies:
                            s = Setting("model", task, backend, policy, parse_budget(str(budget), task),
                                        float(deadline), float(inject), checkpoint)
                            first = first or s
                            add(s)
        if "random" in baselines:
            add(replace(first, checkpoint="", inject_ms=0.0, baseline="random"))
        for b in ("expert", "hold"):
            if b in baselines:
                add(Setting(b, task, baseline=b))
    return out


# ---------------------------------------------------------------------------------------------------------------
# figures of one setting
# ---------------------------------------------------------------------------------------------------------------

def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (sane at 0/n and n/n, unlike the normal interval)."""
    if n <= 0:
        raise ValueError("no trials: a success rate needs at least one episode")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in 0..{n}, got {successes}")
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    lo = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the ends (no 0.9999999999999999)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def read_episode_lines(text: str) -> tuple[list[dict], list[str]]:
    """(episode results, problems) from a JSON-lines file's text; a bad line is a problem, never skipped silently."""
    episodes, problems = [], []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"line {i} is not JSON ({exc.msg})")
            continue
        missing = [k for k in ("success", "steps", "seed", "duration_s", "fresh", "repeat", "hold") if k not in rec]
        if missing:
            problems.append(f"line {i} lacks {', '.join(missing)}")
            continue
        episodes.append(rec)
    return episodes, problems


def _get(d: Any, *path: str) -> Any:
    for k in path:
        if not isinstance(d, Mapping) or k not in d:
            return None
        d = d[k]
    return d


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    if num is None or not den:
        return None
    return float(num) / float(den)


def _percentile(values: Sequence[float], q: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def aggregate(setting: Setting, episodes: Sequence[Mapping], runtime_stats: Optional[Mapping], expected: int,
              seed_start: int, failure: Optional[str] = None, problems: Iterable[str] = (),
              logs: str = "", wall_s: Optional[float] = None) -> dict[str, Any]:
    """One table row from the sim's episode results and (model settings) the runtime's final stats.

    The row fails -- kept, with the reason and the log directory -- when the processes failed (``failure``),
    fewer than ``expected`` episodes finished, the seeds are not seed_start, seed_start + 1, ..., a baseline's
    episodes were not driven by that baseline, the episode file had bad lines, or a model setting has no
    runtime stats. Its figures are those of the episodes that did finish."""
    errors = [failure] if failure else []
    errors += list(problems)
    n = len(episodes)
    if n < expected:
        errors.append(f"only {n} of {expected} episodes finished")
    seeds = [int(e["seed"]) for e in episodes]
    if seeds != list(range(seed_start, seed_start + n)):
        errors.append(f"episode seeds {seeds} are not {seed_start}, {seed_start + 1}, ...")
    wrong_task = sorted({str(e.get("task")) for e in episodes if e.get("task") != setting.task})
    if wrong_task:
        errors.append(f"episodes of task(s) {', '.join(wrong_task)}, expected {setting.task}")
    want_policy = "external" if setting.kind == "model" else setting.kind
    driven = [_get(e, "extra", "sim_policy") for e in episodes]
    if any(p != want_policy for p in driven):
        errors.append(f"episodes driven by sim_policy {sorted(set(map(str, driven)))}, expected {want_policy!r} "
                      "(a vla_sim without the sim_policy parameter?)")
    successes = sum(bool(e["success"]) for e in episodes)
    steps = sum(int(e["steps"]) for e in episodes)
    kinds = {k: sum(int(e.get(k, 0)) for e in episodes) for k in ("fresh", "repeat", "hold")}
    sim_hold_by = {}
    for e in episodes:
        for reason, c in (e.get("sim_hold") or {}).items():
            sim_hold_by[reason] = sim_hold_by.get(reason, 0) + int(c)
    kinds["sim_hold"] = sum(sim_hold_by.values())
    for e in episodes:  # every control step applied exactly one kind: a mismatch means a corrupt record
        counted = sum(int(e.get(k, 0)) for k in ("fresh", "repeat", "hold")) + sum((e.get("sim_hold") or {}).values())
        if counted != int(e["steps"]):
            errors.append(f"episode seed {e['seed']}: fresh + repeat + hold + sim-hold = {counted} != "
                          f"{e['steps']} steps")
    durations = [float(e["duration_s"]) for e in episodes]
    ci = wilson_interval(successes, n) if n else None
    row: dict[str, Any] = {
        "label": setting.label, "setting": asdict(setting), "kv_frames": setting.kv_frames(),
        "status": "failed" if errors else "ok", "error": "; ".join(errors) or None, "logs": logs,
        "episodes": n, "expected_episodes": expected, "successes": successes,
        "success_rate": successes / n if n else None, "success_ci95": list(ci) if ci else None,
        "episode_s": {"mean": sum(durations) / n if n else None, "p50": _percentile(durations, 0.5),
                      "max": max(durations) if durations else None},
        "steps_mean": steps / n if n else None,
        "success_steps_mean": (sum(int(e["steps"]) for e in episodes if e["success"]) / successes
                               if successes else None),
        "shares": {k: _ratio(c, steps) for k, c in kinds.items()},
        "sim_hold_by_reason": sim_hold_by,
        "actions_rejected": sum(sum((e.get("rejected") or {}).values()) for e in episodes),
        # steps that applied an action from a newer frame than the step before (sim/episode.py): with a
        # publisher faster than the control steps most applied messages are 'repeat's of a new action
        "new_plan_share": (_ratio(sum(int(e["new_plan"]) for e in episodes), steps)
                           if n and all("new_plan" in e for e in episodes) else None),
        # smoothness (sim/episode.py): mean over episodes of each one's mean squared commanded jerk
        "jerk_sq_mean": (sum(float(e["jerk_sq_mean"]) for e in episodes) / n
                         if n and all("jerk_sq_mean" in e for e in episodes) else None),
        "runtime": None, "wall_s": wall_s,
    }
    if setting.kind == "model":
        if runtime_stats is None:
            errors.append("the runtime wrote no stats")
            row.update(status="failed", error="; ".join(errors))
        else:
            row["runtime"] = runtime_figures(runtime_stats, n)
            state = _get(runtime_stats, "inference", "state")
            if state not in (None, "active"):
                errors.append(f"vla_inference ended in state {state!r}: "
                              f"{_get(runtime_stats, 'inference', 'last_error') or 'no reason given'}")
                row.update(status="failed", error="; ".join(errors))
    return row


def runtime_figures(stats: Mapping, episodes: int) -> dict[str, Any]:
    """Chunk latency, deadline misses, refusals and KV figures from a runtime --stats-out JSON."""
    admitted = int(_get(stats, "chunks", "admitted") or 0)
    refused = int(_get(stats, "chunks", "refused") or 0)
    misses = int(_get(stats, "chunks", "deadline_misses") or 0)
    evictions = _get(stats, "inference", "kv", "evictions")
    return {
        "backend": stats.get("backend"),
        "chunks": {"admitted": admitted, "refused": refused, "deadline_misses": misses},
        "latency_ms": {k: _get(stats, "latency_ms", k) for k in ("p50", "p99")},
        "deadline_miss_rate": _ratio(misses, admitted),
        "refusal_rate": _ratio(refused, admitted + refused),
        "kv": {"budget_tokens": _get(stats, "kv", "budget_tokens"),
               "max_occupancy_tokens": _get(stats, "kv", "max_occupancy_tokens"), "evictions": evictions},
        "evictions_per_episode": _ratio(evictions, episodes),
        "frames": {k: _get(stats, "frames", k) for k in ("received", "dropped", "rejected")},
        "ticks": {k: _get(stats, "ticks", k) for k in ("fresh", "repeat", "hold")},
        # why the publisher repeated (core/executor.py): with chunks, next_step is a planned step, not a re-send
        "repeat_reasons": dict(_get(stats, "action", "arbiter", "repeat_reasons") or {}),
        # a refused frame is retried with the next frame slot (core/inference_loop.py): refused != lost
        "retried": _get(stats, "inference", "loop", "retried"),
    }

