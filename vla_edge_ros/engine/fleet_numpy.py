"""One numpy engine serving a fleet of robots (issue 24): one copy of the weights, one KV cache per robot, and
the chunks due in the same cycle run as ONE batched forward.

Why batch: on an edge device a chunk is memory-bound (decode reads every weight once per token), so the weights
read by one pass should serve every robot whose chunk is due. The dense parts of a layer (RMSNorm, the q/k/v
projections, o_proj, the MLP, the LM head) are row-independent, so they run once on the stacked rows of every
member: prefill as one GEMM over M x tokens_per_frame rows, each decode step as a skinny GEMM with M = members
instead of M GEMVs. What depends on a robot's history runs per robot, with NumpyEngine's own methods on that
robot's NumpyEngine: admission and eviction (``_admit_frame``: its KVManager, its budget and policy, the rotation
offset ``delta``), RoPE at its positions and the K/V writes into its cache (``_store_kv``), attention over its
own context through its own segments / masks (``_context_segment``, ``_attend``), and the result
(``_chunk_result``, chunk layout and H > 1 from engine/geometry.py). So the batch is the oracle's arithmetic:
a member's tokens equal that robot's NumpyEngine run alone (test/test_fleet_numpy.py), and its logits agree to
float32 rounding (a GEMM row's sum order may depend on M).

Memory: the robots' NumpyEngines are built on one shared ``NumpyWeights`` (no copy), so ``memory()`` is the
weights (and RoPE table) once plus each robot's ``cache_bytes()``.

Decode is plain greedy, one token per member per pass, ``decode_steps`` passes. No speculative drafts in the
batched path: a robot accepts a draft of whatever length its own greedy choices allow, so after the first pass
the members would sit at different steps and need passes of different widths; a width-k pass per robot (rows of
idle members padded or dropped) could come later. Greedy is greedy: the tokens are the same either way.
``vla.chunk_decode: parallel`` is one pass of A rows per member (engine/numpy_decode.parallel_pass: the same
inputs, positions and bidirectional slot mask as the single engine). A forced prefix (run_chunk's forced_bins)
is not offered by the batched path: a request carries none.

Errors are per robot where they can be: a member whose vision tokens fail ``check_vision_tokens`` gets its
ValueError in the result and stays out of the pass (its cache untouched); an unknown name gets an
``UnknownRobotError`` (a KeyError); a failure in a member's admission resets that robot's cache (its frame was
admitted but never written) and is counted in ``cache_resets``. A failure inside the batched pass itself resets
the members' caches (counted too) and is raised: it is every member's error (core/fleet_loop.py).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import numpy as np

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.geometry import (check_action_readout, check_decode_tokens, chunk_decode_steps,
                                          chunk_scratch_slots, is_parallel)
from vla_edge_ros.engine.interface import ChunkResult, EngineError, check_vision_tokens
from vla_edge_ros.engine.numpy_backend import CachePart, NumpyEngine, NumpyWeights, _rmsnorm, forward_parts
from vla_edge_ros.engine.numpy_decode import parallel_pass


class BatchRequest(NamedTuple):
    """One robot's chunk in a batch; run_batch accepts any object with these attributes (duck typed)."""
    vision_tokens: np.ndarray  # (tokens_per_frame, hidden) float32, encode_frame's output
    frame_id: int
    salient: bool = False


class UnknownRobotError(KeyError):
    """run_batch was asked for a robot that was never added (or was removed)."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument: keep the message readable
        return str(self.args[0]) if self.args else "unknown robot"


@dataclass
class _Member:
    """One robot's share of a pass: its engine, the chunk's bookkeeping, its rows in the stacked activations."""
    name: str
    eng: NumpyEngine
    req: Any
    x: np.ndarray  # validated vision tokens
    adm: Any = None
    n_ctx: int = 0
    new_slots: Optional[np.ndarray] = None
    r_end: int = 0
    rows: tuple[int, int] = (0, 0)
    place: Any = None  # NumpyEngine._placement of this pass's rows
    segments: list = field(default_factory=list)
    gen: Optional[np.ndarray] = None
    logits: Optional[np.ndarray] = None


class FleetNumpyEngine:
    """N robots, one copy of the weights, batched passes (module docstring). Not thread-safe: one thread owns it.

    ``kv_factory(name)`` (or ``kv_factory()``) returns a fresh core.kv KVManager for a robot joining: each robot
    may have its own budget, policy and window. ``weights``: a checkpoint's tensors (or a QuantizedModel), or a
    NumpyWeights already built for ``cfg`` / ``weight_dtype``.
    """

    name = "numpy"

    def __init__(self, cfg: ModelConfig, weights, kv_factory: Callable[..., Any], instruction: str = "",
                 decode_tokens: int = 8, weight_dtype: str = "bf16", action_readout: str = "argmax"):
        check_decode_tokens(cfg, int(decode_tokens))
        self.action_readout = check_action_readout(action_readout)  # each robot's engine reads out the same way
        self.cfg, self.instruction, self.weight_dtype = cfg, instruction, weight_dtype
        self.decode_tokens = int(decode_tokens)
        self.decode_steps = chunk_decode_steps(cfg, self.decode_tokens)  # S: one checkpoint, the same for all
        self.scratch_slots = chunk_scratch_slots(cfg, self.decode_tokens)  # S, or A parallel slots
        self.weights = weights if isinstance(weights, NumpyWeights) else NumpyWeights(cfg, weights, weight_dtype)
        self._kv_factory = kv_factory
        try:
            inspect.signature(kv_factory).bind("robot")
            self._factory_takes_name = True
        except TypeError:
            self._factory_takes_name = False
        except ValueError:  # no signature to inspect (some builtins): pass the name
            self._factory_takes_name = True
        self.robots: dict[str, NumpyEngine] = {}
        self.last_batch_timing: dict[str, float] = {"prefill_ms": 0.0, "decode_ms": 0.0}
        self.last_batch_size = 0
        self.cache_resets: dict[str, int] = {}  # robot -> caches dropped after a failure (module docstring)
        self.needs_reset = False  # failures repair the caches they touched (module docstring)
        self._peak_bytes = 0
        self._track_peak()

    # ---- membership -----------------------------------------------------------------------------------------
    def add_robot(self, name: str) -> None:
        """Give ``name`` its KV cache (a NumpyEngine on the shared weights, prefix prefilled)."""
        if name in self.robots:
            raise ValueError(f"robot {name!r} is already served by this engine")
        kv = self._kv_factory(name) if self._factory_takes_name else self._kv_factory()
        self.robots[name] = NumpyEngine(self.cfg, self.weights, kv, instruction=self.instruction,
                                        decode_tokens=self.decode_tokens, weight_dtype=self.weight_dtype,
                                        action_readout=self.action_readout)
        self._track_peak()

    def remove_robot(self, name: str) -> None:
        """Free ``name``'s KV cache."""
        eng = self.robots.pop(name, None)
        if eng is None:
            raise UnknownRobotError(f"robot {name!r} is not served by this engine")
        eng.close()

    def robot(self, name: str) -> NumpyEngine:
        """``name``'s own engine: its KVManager (``.kv``), live KV changes (``apply_kv_changes``), diagnostics."""
        try:
            return self.robots[name]
        except KeyError:
            raise UnknownRobotError(f"robot {name!r} is not served by this engine") from None

    # ---- the rest of the contract (core/fleet_loop.FleetEngine) ----------------------------------------------
    @property
    def action_names(self) -> tuple[str, ...]:
        return tuple(self.cfg.action_names)

    @property
    def tokens_per_frame(self) -> int:
        return int(self.cfg.n_patches)

    def encode_frame(self, image: np.ndarray) -> np.ndarray:
        return self.weights.vision(image)

    def reset(self) -> None:
        """Drop every robot's retained frames (the robots and their pinned prefixes stay)."""
        for eng in self.robots.values():
            eng.reset()
        self.needs_reset = False

    def close(self) -> None:
        for name in list(self.robots):
            self.remove_robot(name)

    def memory(self) -> dict:
        """Bytes held: the shared weights once, plus each robot's KV cache and scratch."""
        per_robot = {name: int(eng.cache_bytes()) for name, eng in self.robots.items()}
        weight_bytes = int(self.weights.nbytes())
        cur = weight_bytes + sum(per_robot.values())
        self._peak_bytes = max(self._peak_bytes, cur)
        return {"current_bytes": cur, "peak_bytes": self._peak_bytes, "weight_bytes": weight_bytes,
                "kv_bytes": sum(per_robot.values()), "per_robot_kv_bytes": per_robot,
                "device_weight_bytes": int(self.weights.device_weight_bytes)}

    def _track_peak(self) -> None:
        self.memory()

    # ---- one batched pass -----------------------------------------------------------------------------------
    def run_batch(self, requests: Mapping[str, Any]) -> dict[str, Union[ChunkResult, Exception]]:
        """One chunk for each named robot (``vision_tokens``, ``frame_id``, ``salient``), run as one pass."""
        t0 = time.perf_counter()
        results: dict[str, Union[ChunkResult, Exception]] = {}
        members = [m for m in (self._admit(name, req, results) for name, req in requests.items()) if m is not None]
        prefill_ms = decode_ms = 0.0
        if members:
            t1 = time.perf_counter()
            try:
                self._prefill(members)
                t2 = time.perf_counter()
                self._decode(members)
            except Exception:
                for m in members:  # their frames were admitted but not (fully) written: drop what they hold
                    self._reset_robot(m.name, m.eng)
                raise
            t3 = time.perf_counter()
            prefill_ms, decode_ms = (t2 - t1) * 1e3, (t3 - t2) * 1e3
            for m in members:
                m.eng.last_decode_passes = self.decode_steps
                results[m.name] = m.eng._chunk_result(m.req.frame_id, bool(m.req.salient), m.gen, m.logits, m.adm,
                                                      m.n_ctx, prefill_ms, decode_ms, t0)
        self.last_batch_timing = {"prefill_ms": prefill_ms, "decode_ms": decode_ms}
        self.last_batch_size = len(members)
        self._track_peak()
        return {name: results[name] for name in requests}

    def _admit(self, name: str, req: Any, results: dict) -> Optional[_Member]:
        """Validate a member's tokens and admit its frame into its cache; a failure is that robot's result."""
        eng = self.robots.get(name)
        if eng is None:
            results[name] = UnknownRobotError(f"robot {name!r} was not added to this engine (add_robot first)")
            return None
        try:
            if eng._closed:
                raise EngineError(f"robot {name!r}: its engine was closed")
            x = check_vision_tokens(req.vision_tokens, eng.kv.tokens_per_frame, eng.hidden)
        except Exception as exc:  # nothing touched yet: its cache is as it was
            results[name] = exc
            return None
        m = _Member(name, eng, req, x)
        try:
            m.adm, m.n_ctx, m.new_slots, m.r_end = eng._admit_frame(x, req.frame_id, bool(req.salient))
        except Exception as exc:
            self._reset_robot(name, eng)
            results[name] = exc
            return None
        return m

    def _reset_robot(self, name: str, eng: NumpyEngine) -> None:
        self.cache_resets[name] = self.cache_resets.get(name, 0) + 1
        try:
            eng.reset()
        except Exception:  # cannot even drop its frames: let the caller reset the whole engine
            self.needs_reset = True

    def _prefill(self, members: list[_Member]) -> None:
        """Every member's frame tokens in one stacked pass; gen[0] / logits[0] of each from its last row."""
        tpf, S = self.tokens_per_frame, self.scratch_slots
        for i, m in enumerate(members):
            m.rows = (i * tpf, (i + 1) * tpf)
            m.place = m.eng._placement(m.new_slots, np.arange(m.n_ctx - tpf, m.n_ctx))
            m.segments = [m.eng._context_segment(m.new_slots, m.r_end)]
        lg = self._lm_head(self._forward(members, np.concatenate([m.x for m in members]), last_only=True))
        for i, m in enumerate(members):
            m.logits = np.empty((S + 1, self.cfg.n_action_bins), np.float32)
            m.gen = np.empty(S + 1, np.int64)
            m.logits[0] = lg[i]
            m.gen[0] = int(np.argmax(lg[i])) + self.cfg.action_token_offset

    def _decode(self, members: list[_Member]) -> None:
        """S greedy passes of one token per member (M rows): NumpyEngine._decode with ``speculative = False``;
        parallel: ``_decode_parallel``."""
        if is_parallel(self.cfg):
            return self._decode_parallel(members)
        off = self.cfg.action_token_offset
        for m in members:
            m.eng._bias_base[m.new_slots] = 0.0  # decode tokens see the whole new frame
            ctx_seg = m.eng._context_segment(np.zeros(0, np.int64), m.r_end)
            m.segments = [ctx_seg, None]
        for i in range(1, self.decode_steps + 1):
            for j, m in enumerate(members):
                slot = m.eng.capacity + i - 1  # scratch slot of step i (outside the budget)
                m.rows = (j, j + 1)
                m.place = m.eng._placement(np.array([slot]), np.array([m.n_ctx + i - 1]))
                m.segments[1] = (m.eng.capacity, slot + 1, None, None)  # scratch rows 0..i-1 all visible
            tokens = np.array([m.gen[i - 1] for m in members], np.int64)
            lg = self._lm_head(self._forward(members, self.weights.embed[tokens], last_only=False))
            choice = np.argmax(lg, axis=1) + off
            for j, m in enumerate(members):
                m.logits[i] = lg[j]
                m.gen[i] = choice[j]

    def _decode_parallel(self, members: list[_Member]) -> None:
        """One pass of A action slots per member (M x A rows), each member's from parallel_pass."""
        a, tokens = self.scratch_slots, []
        for j, m in enumerate(members):
            m.eng._bias_base[m.new_slots] = 0.0  # the slots see the whole new frame
            tok, slots, positions, m.segments = parallel_pass(m.eng, m.n_ctx, m.r_end)
            m.rows, m.place = (j * a, (j + 1) * a), m.eng._placement(slots, positions)
            tokens.append(tok)
        lg = self._lm_head(self._forward(members, self.weights.embed[np.concatenate(tokens)], last_only=False))
        for j, m in enumerate(members):
            m.logits[1:] = lg[j * a:(j + 1) * a]
            m.gen[1:] = np.argmax(m.logits[1:], axis=1) + self.cfg.action_token_offset

    def _forward(self, members: list[_Member], x: np.ndarray, last_only: bool) -> np.ndarray:
        """NumpyEngine's decoder over the stacked rows of every member (numpy_backend.forward_parts: the dense
        parts once, the cache parts per member on its rows). Returns the final hidden rows."""
        parts = [CachePart(m.eng, m.rows, m.place, m.segments) for m in members]
        return forward_parts(self.weights.layers, self.cfg, x, parts, last_only)

    def _lm_head(self, h: np.ndarray) -> np.ndarray:
        return _rmsnorm(h, self.weights.final_norm, self.cfg.rms_norm_eps) @ self.weights.head_t
