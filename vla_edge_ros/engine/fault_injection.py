"""Fault injection for reliability tests: ``FaultInjectingEngine(engine, spec)`` wraps any Engine.

Enabled in a running system by the environment variable ``VLA_FAULT_INJECT=<spec>``, which
``engine.factory.make_engine`` reads (it logs loudly that faults are being injected). Never set it on a robot.

Spec: comma-separated items, each ``kind[:arg]`` followed by a trigger.

    kind     raise        the chunk raises InjectedFault (a RuntimeError: "an exception inside a chunk")
             oom          the chunk raises InjectedDeviceOOM, like PyCUDA's device out-of-memory error (NOT a
                          Python MemoryError), and sets ``needs_reset`` so the inference loop resets the engine
             memerror     the chunk raises a Python MemoryError (the numpy backend's out-of-memory)
             hang:MS      the chunk sleeps MS milliseconds, then runs normally (a hung chunk that overruns its
                          deadline; Python cannot pre-empt it, so the loop sees it finish late)
    trigger  @N           live chunk number N (1-based)
             @N-M         every live chunk from N to M inclusive
             @N+          every live chunk from N on
             :p=P         each live chunk with probability P (seeded: add an item ``seed=S``, default 0)

Examples: ``raise@5,oom@9,hang:200@12``; ``raise:p=0.05,seed=3``; ``hang:50@100-120``.
Chunk numbers count *live* chunks only: warm-up chunks (negative frame ids, run at configure time) are never
faulted, so a fault spec cannot make configuration fail. When several items match one chunk the first listed
wins. Each injected fault is counted (``injected``) and logged.
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from vla_edge_ros.engine.interface import ChunkResult, Engine

ENV_VAR = "VLA_FAULT_INJECT"
KINDS = ("raise", "oom", "memerror", "hang")


class InjectedFault(RuntimeError):
    """An exception raised inside a chunk on purpose."""


class InjectedDeviceOOM(RuntimeError):
    """Stands in for a device out-of-memory error (pycuda._driver.MemoryError is not a Python MemoryError)."""


@dataclass(frozen=True)
class FaultRule:
    kind: str
    hang_ms: float = 0.0
    first: Optional[int] = None  # chunk number range [first, last]; last None = open-ended
    last: Optional[int] = None
    probability: Optional[float] = None

    def matches(self, chunk_no: int, rng: random.Random) -> bool:
        if self.probability is not None:
            return rng.random() < self.probability
        if chunk_no < self.first:
            return False
        return self.last is None or chunk_no <= self.last

    def describe(self) -> str:
        kind = f"hang:{self.hang_ms:g}" if self.kind == "hang" else self.kind
        if self.probability is not None:
            return f"{kind}:p={self.probability:g}"
        if self.last == self.first:
            return f"{kind}@{self.first}"
        return f"{kind}@{self.first}{'+' if self.last is None else f'-{self.last}'}"


_ITEM = re.compile(r"^(?P<kind>[a-z]+)(?::(?P<arg>[0-9.]+))?"
                   r"(?:@(?P<first>\d+)(?:(?P<plus>\+)|-(?P<last>\d+))?|:p=(?P<p>[0-9.eE+-]+))$")


def parse_spec(spec: str) -> tuple[list[FaultRule], int]:
    """(rules, seed) from a spec string; ValueError naming the bad item otherwise."""
    rules: list[FaultRule] = []
    seed = 0
    items = [s.strip() for s in (spec or "").split(",") if s.strip()]
    if not items:
        raise ValueError(f"{ENV_VAR}: empty fault spec")
    for item in items:
        if item.startswith("seed="):
            try:
                seed = int(item[5:])
            except ValueError:
                raise ValueError(f"{ENV_VAR}: bad seed in {item!r}") from None
            continue
        m = _ITEM.match(item)
        if m is None:
            raise ValueError(f"{ENV_VAR}: cannot parse {item!r}: expected kind[:ms]@N, @N-M, @N+ or :p=P "
                             f"(kinds: {', '.join(KINDS)})")
        kind, arg = m["kind"], m["arg"]
        if kind not in KINDS:
            raise ValueError(f"{ENV_VAR}: unknown fault kind {kind!r} in {item!r} (one of {', '.join(KINDS)})")
        if kind == "hang":
            if arg is None or float(arg) <= 0:
                raise ValueError(f"{ENV_VAR}: hang needs a positive duration in ms, e.g. hang:200@12 ({item!r})")
            hang_ms = float(arg)
        else:
            if arg is not None:
                raise ValueError(f"{ENV_VAR}: {kind} takes no argument ({item!r})")
            hang_ms = 0.0
        if m["p"] is not None:
            try:
                p = float(m["p"])
            except ValueError:
                raise ValueError(f"{ENV_VAR}: bad probability in {item!r}") from None
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{ENV_VAR}: probability {p} outside [0, 1] in {item!r}")
            rules.append(FaultRule(kind, hang_ms, probability=p))
        else:
            first = int(m["first"])
            last = None if m["plus"] else int(m["last"]) if m["last"] else first
            if first < 1 or (last is not None and last < first):
                raise ValueError(f"{ENV_VAR}: bad chunk range in {item!r} (chunks count from 1)")
            rules.append(FaultRule(kind, hang_ms, first=first, last=last))
    if not rules:
        raise ValueError(f"{ENV_VAR}: spec {spec!r} names no fault")
    return rules, seed


class FaultInjectingEngine(Engine):
    """Delegates everything to ``engine`` and injects the faults of ``spec`` into live ``run_chunk`` calls."""

    def __init__(self, engine: Engine, spec: str, log: Callable[[str], None] = print,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._engine = engine
        self.spec = spec
        self.rules, seed = parse_spec(spec)
        self._rng = random.Random(seed)
        self._log = log
        self._sleep = sleep
        self.name = getattr(engine, "name", "?")  # Engine.name is a class attribute: forward it explicitly
        self.needs_reset = False
        self.live_chunks = 0
        self.injected = {k: 0 for k in KINDS}
        self.resets = 0
        self.events: list[tuple[int, str]] = []  # (live chunk number, fault) in order, for tests

    def __getattr__(self, name: str) -> Any:  # cfg, kv, config, update_kv, ... of the wrapped engine
        if name == "_engine":
            raise AttributeError(name)
        return getattr(self._engine, name)

    @property
    def tokens_per_frame(self) -> int:
        return self._engine.tokens_per_frame

    @property
    def decode_steps(self) -> int:  # the inference loop's cost model counts the wrapped engine's real steps
        return self._engine.decode_steps

    def chunk_support_problem(self) -> Optional[str]:  # Engine defines it: __getattr__ would not forward it
        return self._engine.chunk_support_problem()

    def encode_frame(self, image: np.ndarray) -> np.ndarray:
        return self._engine.encode_frame(image)

    def _rule_for(self, chunk_no: int) -> Optional[FaultRule]:
        hit = None
        for rule in self.rules:  # every probabilistic rule draws once per chunk: reproducible sequences
            if rule.matches(chunk_no, self._rng) and hit is None:
                hit = rule
        return hit

    def run_chunk(self, vision_tokens: np.ndarray, frame_id: int, salient: bool = False,
                  forced_bins: Optional[np.ndarray] = None) -> ChunkResult:
        # forced_bins goes through as given (only when given: a wrapped engine may predate the argument)
        kw = {} if forced_bins is None else {"forced_bins": forced_bins}
        if frame_id is not None and frame_id < 0:  # warm-up chunk: never faulted
            return self._engine.run_chunk(vision_tokens, frame_id, salient, **kw)
        self.live_chunks += 1
        n = self.live_chunks
        rule = self._rule_for(n)
        if rule is None:
            return self._engine.run_chunk(vision_tokens, frame_id, salient, **kw)
        self.injected[rule.kind] += 1
        self.events.append((n, rule.describe()))
        self._log(f"FAULT INJECTION: {rule.describe()} in live chunk {n} (frame {frame_id})")
        if rule.kind == "raise":
            raise InjectedFault(f"injected exception in chunk {n} (frame {frame_id})")
        if rule.kind == "oom":
            self.needs_reset = True
            raise InjectedDeviceOOM(f"injected device out of memory in chunk {n} (frame {frame_id}): "
                                    "cuMemAlloc failed: out of memory")
        if rule.kind == "memerror":
            raise MemoryError(f"injected MemoryError in chunk {n} (frame {frame_id})")
        self._sleep(rule.hang_ms / 1e3)  # hang
        return self._engine.run_chunk(vision_tokens, frame_id, salient, **kw)

    def reset(self) -> None:
        self._engine.reset()
        self.needs_reset = False
        self.resets += 1

    def memory(self) -> dict[str, int]:
        return self._engine.memory()

    def close(self) -> None:
        self._engine.close()

    def stats(self) -> dict[str, Any]:
        return {"spec": self.spec, "live_chunks": self.live_chunks, "injected": dict(self.injected),
                "resets": self.resets, "needs_reset": self.needs_reset}


def wrap_from_env(engine: Engine, log: Callable[[str], None] = print, environ: Optional[dict] = None) -> Engine:
    """``engine`` unchanged unless ``VLA_FAULT_INJECT`` is set (non-empty); then wrapped, with a loud log line.
    A malformed spec raises ValueError: silently running without the requested faults would void a test."""
    import os
    import sys

    spec = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not spec:
        return engine
    wrapped = FaultInjectingEngine(engine, spec, log=log)
    banner = (f"!!! FAULT INJECTION ENABLED ({ENV_VAR}={spec!r}): rules "
              f"{', '.join(r.describe() for r in wrapped.rules)}. Test use only, never on a robot !!!")
    log(banner)
    if log is not print:
        print(banner, file=sys.stderr, flush=True)
    return wrapped
