"""One engine interface, two backends (numpy reference on CPU, PyCUDA kernels on GPU).

Data path of one chunk (one camera frame):

    image (H, W, 3) uint8 ──encode_frame──> vision tokens (tokens_per_frame, hidden) float32
        ──run_chunk──> KV manager admits the frame (evicting by policy), prefill of the 32 tokens against
                       pinned prefix + retained frames, then `decode_tokens` greedy single-token steps over
                       the 256 action rows of the LM head ──> ChunkResult (action bins, un-normalised action)

Token layout of a chunk: the prefill's last logits give gen[0] (an action-start token); decode step i
(i = 1..decode_tokens) feeds gen[i-1] and yields gen[i]. gen[1..7] are the 7 action bins, gen[8] the end token.
Decode tokens live in `decode_tokens` scratch slots outside the KV budget and are not retained.

Action chunks: a checkpoint's ``vla.action_horizon`` H says how many actions (one per control period) a chunk
yields; ``ChunkResult.chunk`` is that (H, action_dims) array and ``ChunkResult.action`` its first row (what a
single-step caller reads). Today both backends decode H = 1 (the chunk is the one action; a result built with
``action`` alone gets ``chunk = action[None]``) and refuse H > 1 or ``chunk_decode: parallel`` at configure
(``Engine.chunk_support_problem``) until they implement them. The inference loop sets ``frame_stamp_ns``: the
executor times the chunk's steps from it.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Optional

import numpy as np


def check_vision_tokens(vision_tokens: np.ndarray, tokens_per_frame: int, hidden: int) -> np.ndarray:
    """Validate a chunk's vision tokens (both backends): (tokens_per_frame, hidden), finite; C-contiguous f32."""
    x = np.asarray(vision_tokens)
    if x.shape != (tokens_per_frame, hidden):
        raise ValueError(f"vision tokens must have shape ({tokens_per_frame}, {hidden}), got {x.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError("vision tokens contain NaN or infinite values")
    return x


class EngineError(RuntimeError):
    """A configuration / checkpoint / device problem with a message an operator can act on."""


@dataclass
class ChunkResult:
    frame_id: int
    token_ids: np.ndarray  # (decode_tokens + 1,) int64: gen[0..decode_tokens], vocabulary ids
    action_bins: np.ndarray  # (action_dims,) int64 in [0, 256)
    action: np.ndarray  # (action_dims,) float32, un-normalised with q01/q99
    prefill_ms: float
    decode_ms: float  # all decode steps together
    total_ms: float
    evicted_frames: list[int] = field(default_factory=list)
    kv_occupancy_tokens: int = 0
    salient: bool = False
    chunk: Optional[np.ndarray] = None  # (H, action_dims) float32; None at construction: action[None] (H = 1)
    frame_stamp_ns: int = 0  # stamp of the camera frame the chunk was computed from (set by the inference loop)

    def __post_init__(self) -> None:
        if self.chunk is None and self.action is not None:
            self.chunk = np.asarray(self.action).reshape(1, -1)

    @property
    def horizon(self) -> int:
        """H: the number of actions in the chunk."""
        return 0 if self.chunk is None else int(np.shape(self.chunk)[0])


class Engine(abc.ABC):
    """Backends implement this. Not thread-safe: one inference thread owns an engine."""

    name: str = "abstract"  # "numpy" | "cuda"
    # Set by a backend when a failed chunk may have left its state (KV cache, device buffers) inconsistent,
    # e.g. after a device out-of-memory error (PyCUDA's is not a Python MemoryError). The inference loop
    # then calls reset() before the next chunk instead of restarting the node.
    needs_reset: bool = False

    @property
    @abc.abstractmethod
    def tokens_per_frame(self) -> int: ...

    @abc.abstractmethod
    def encode_frame(self, image: np.ndarray) -> np.ndarray:
        """(H, W, 3) uint8 RGB -> (tokens_per_frame, hidden) float32 vision tokens (patch embedder)."""

    @abc.abstractmethod
    def run_chunk(self, vision_tokens: np.ndarray, frame_id: int, salient: bool = False) -> ChunkResult:
        """Admit the frame into the KV cache (policy eviction), prefill it, decode greedily, return the action."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop every retained frame (the pinned prefix stays)."""

    @abc.abstractmethod
    def memory(self) -> dict[str, int]:
        """{'current_bytes': ..., 'peak_bytes': ...} of the backend's own allocations (device for cuda)."""

    # ---- the rest of the contract: what the runtime reads and changes, defined once for every backend --------
    # A backend keeps its ModelConfig as ``cfg`` and its core.kv.KVManager as ``kv``.
    @property
    def action_names(self) -> tuple[str, ...]:
        """Names of the action dimensions, in order (the checkpoint's ``vla.action_names``)."""
        return tuple(self.cfg.action_names)

    def chunk_support_problem(self) -> Optional[str]:
        """Why this backend cannot decode the chunks its checkpoint asks for (None: it can). The inference node
        refuses to configure with this reason. The default is today's backends: one action per chunk (H = 1),
        autoregressive; a backend that implements more overrides it."""
        cfg = getattr(self, "cfg", None)
        horizon = int(getattr(cfg, "action_horizon", 1))
        decode = getattr(cfg, "chunk_decode", "autoregressive")
        if decode != "autoregressive":
            return (f"vla.chunk_decode={decode!r}: parallel decoding of an action chunk is not implemented by the "
                    f"{self.name} backend yet (issue 22); use \"autoregressive\"")
        if horizon > 1:
            return (f"vla.action_horizon={horizon}: the {self.name} backend decodes one action per chunk (H = 1) "
                    "for now (issue 22); use a checkpoint with action_horizon 1")
        return None

    @property
    def prefix_tokens(self) -> int:
        """Tokens of the pinned instruction prefix (they count against the KV budget)."""
        return int(self.kv.prefix_tokens)

    KV_CHANGES = ("kv_budget_tokens", "eviction_policy", "window_frames")

    def apply_kv_changes(self, changes: dict) -> list[int]:
        """Apply live KV settings between chunks, on the thread that runs the chunks (the inference loop calls
        this from its cycle, never mid-chunk). ``kv_budget_tokens`` 0 means this backend's default. Returns the
        frame ids a budget shrink evicted. ValueError for an unknown key or a value the KV manager refuses."""
        from vla_edge_ros import params

        unknown = [k for k in changes if k not in self.KV_CHANGES]
        if unknown:
            raise ValueError(f"not a live KV setting: {', '.join(unknown)}")
        evicted: list[int] = []
        if "eviction_policy" in changes:
            self.kv.set_policy(changes["eviction_policy"])
        if "window_frames" in changes:
            self.kv.set_window(changes["window_frames"])
        if "kv_budget_tokens" in changes:
            budget = params.resolve_kv_budget(changes["kv_budget_tokens"], self.name, self.kv.tokens_per_frame)
            evicted = list(self.kv.set_budget(budget) or [])
        return evicted

    def close(self) -> None:
        """Free model and KV memory."""
