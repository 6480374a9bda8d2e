"""What the fleet loop (core/fleet_loop.py) asks of a batched engine, stated once, free of any backend.

Why a contract of its own: the loop is pure core code and must not import an engine, while the engines
(engine/fleet_numpy.py today, a CUDA batch later) implement it; tests drive the loop with a fake one.

Engine contract (``FleetEngine``): ``run_batch({name: BatchRequest}) -> {name: ChunkResult or Exception}`` for
exactly the names asked, and afterwards ``last_batch_timing = {"prefill_ms": .., "decode_ms": ..}`` of that
pass (decode: all ``decode_steps`` steps), timing the pass itself (the CUDA engine: device time). The scheduler is
fed those two and, as host, the rest of the time from its decision to the results (conversion, encode, the
engine's host work, waiting): spent against the deadline too. Timing missing or malformed: counted, the whole
time is host.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, Union

import numpy as np


@dataclass(frozen=True)
class BatchRequest:
    vision_tokens: np.ndarray  # engine.encode_frame's output for this robot's frame
    frame_id: Any
    salient: bool


class FleetEngine(Protocol):
    """A batched engine: one KV cache per robot name; not thread-safe (the fleet loop's thread owns it)."""
    decode_steps: int  # S of every chunk (engine/interface.py); must equal the scheduler's decode_steps
    last_batch_timing: Mapping[str, float]  # {"prefill_ms", "decode_ms"} of the last run_batch pass
    needs_reset: bool  # set when a failure may have left its state inconsistent (or a method returning it)

    @property
    def action_names(self) -> tuple[str, ...]: ...  # the action dimensions (for each robot's action topic)
    def add_robot(self, name: str) -> None: ...  # allocate the robot's KV cache; raises when it cannot
    def remove_robot(self, name: str) -> None: ...  # free it
    def encode_frame(self, image: np.ndarray) -> np.ndarray: ...  # ValueError for a malformed image
    def run_batch(self, requests: Mapping[str, BatchRequest]) -> Mapping[str, Union[Any, Exception]]: ...  # ChunkResult
    def reset(self) -> None: ...  # drop every robot's retained frames (the robots stay added)
