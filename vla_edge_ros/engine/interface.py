"""One engine interface, two backends (numpy reference on CPU, PyCUDA kernels on GPU).

Data path of one chunk (one camera frame):

    image (H, W, 3) uint8 ──encode_frame──> vision tokens (tokens_per_frame, hidden) float32
        ──run_chunk──> KV manager admits the frame (evicting by policy), prefill of the 32 tokens against
                       pinned prefix + retained frames, then S greedy single-token decode steps over the 256
                       action rows of the LM head ──> ChunkResult (action bins, un-normalised actions)

Token layout of a chunk (one rule for every backend and the reference; the arithmetic is engine/geometry.py's
``chunk_decode_steps`` / ``action_token_slice`` / ``chunk_bins``). A checkpoint's ``vla.action_horizon`` H says
how many actions (one per control period) a chunk yields; its A = H * action_dims action tokens are time-major
(step 0's 7 bins, then step 1's, ...). The prefill's last logits give gen[0]; decode step i (i = 1..S) feeds
gen[i-1] and yields gen[i]. ``vla.action_start`` says what gen[0] is:
- "token" (the seed shape): an action-start token; the bins are gen[1..A]. S = decode_tokens when H = 1 (8: the 7
  bins and the end token, unchanged; larger values decode further), S = max(decode_tokens, A + 1) when H > 1
  (the A bins and the end token: the training targets are [START, bins of steps t..t+H-1, END]).
- "prefill": gen[0] is bin 1 itself; S = A - 1; the bins are gen[0..A-1].
S, the "effective decode steps" (``engine.decode_steps`` on both backends), not the ``decode_tokens`` parameter,
sizes everything: the decode tokens live in S scratch slots outside the KV budget (not retained), the logits /
token buffers hold S + 1 rows, and every position (kv budget + S) must stay below max_position_embeddings.

``vla.chunk_decode: parallel`` (OpenVLA-OFT style; action_start "token" only, refused by name otherwise): after
the prefill (gen[0], the start token, as above) ONE pass over the A action slots. Every slot's input is
``geometry.parallel_slot_token`` (bin 0's id, the training's START token), slot j sits at position n_ctx + j and
sees the whole context and ALL A slots (bidirectional among the slots, no causal mask); slot j's argmax is
gen[1 + j], the bins are gen[1..A] as above. It takes A scratch slots (``geometry.chunk_scratch_slots``, which
sizes the buffers and the position check) and ``decode_steps`` = 1: the admission cost model counts decode
passes, and a width-A pass costs about one decode pass (it reads the weights and the context once).

Forced prefix (issue 22, RTC-like blending; ``run_chunk(..., forced_bins=(d, action_dims) ints)``, 0 <= d <= H):
the first d chunk steps take the given bins instead of the decode's argmax. Autoregressively they are teacher-
forced: fed as the next steps' inputs, so the rest of the chunk is the greedy decode conditioned on them. In a
parallel pass no slot reads another's choice, so they simply replace the first d steps' choices. The logits stay
the model's own. ``ChunkResult.chunk_bins[:d]`` is ``forced_bins`` and ``forced_steps`` d. Bad ``forced_bins``
are a ValueError with the reason (``geometry.check_forced_bins``). Per call, so not a ``chunk_support_problem``;
both backends force (the CUDA one writes the forced ids from its device argmax: engine/cuda/engine.py).

Results: ``ChunkResult.chunk`` is the (H, action_dims) float32 array of actions (the bins' centres, or with
``action_readout`` "expectation" each slot's softmax mean: ``geometry.readout_actions``), ``chunk_bins`` its (H,
action_dims) argmax bins, ``action`` / ``action_bins`` their first row (what a single-step caller reads; a result
built with ``action`` alone gets ``chunk = action[None]``), ``token_ids`` all of gen. Both backends decode H >= 1
autoregressively and in parallel; the CUDA backend's parallel pass takes up to 256 slots (in 32-row tiles) and
refuses a wider chunk at configure by name (``Engine.chunk_support_problem``). The inference loop sets
``frame_stamp_ns``: the executor times the chunk's steps from it.
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
    token_ids: np.ndarray  # (scratch slots + 1,) int64: gen (S + 1 autoregressive, A + 1 parallel), vocabulary ids
    action_bins: np.ndarray  # (action_dims,) int64 in [0, 256): the chunk's first step
    action: np.ndarray  # (action_dims,) float32, un-normalised with q01/q99: the chunk's first step
    prefill_ms: float
    decode_ms: float  # all decode steps together
    total_ms: float
    evicted_frames: list[int] = field(default_factory=list)
    kv_occupancy_tokens: int = 0
    salient: bool = False
    chunk: Optional[np.ndarray] = None  # (H, action_dims) float32; None at construction: action[None] (H = 1)
    frame_stamp_ns: int = 0  # stamp of the camera frame the chunk was computed from (set by the inference loop)
    chunk_bins: Optional[np.ndarray] = None  # (H, action_dims) int64; None at construction: action_bins[None]
    forced_steps: int = 0  # d: chunk_bins[:d] were forced (run_chunk's forced_bins), not decoded

    def __post_init__(self) -> None:
        if self.chunk is None and self.action is not None:
            self.chunk = np.asarray(self.action).reshape(1, -1)
        if self.chunk_bins is None and self.action_bins is not None:
            self.chunk_bins = np.asarray(self.action_bins).reshape(1, -1)

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
    def run_chunk(self, vision_tokens: np.ndarray, frame_id: int, salient: bool = False,
                  forced_bins: Optional[np.ndarray] = None) -> ChunkResult:
        """Admit the frame into the KV cache (policy eviction), prefill it, decode greedily (the first d steps
        forced to ``forced_bins``, (d, action_dims) ints: module docstring), return the chunk."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop every retained frame (the pinned prefix stays)."""

    @abc.abstractmethod
    def memory(self) -> dict[str, int]:
        """{'current_bytes': ..., 'peak_bytes': ...} of the backend's own allocations (device for cuda)."""

    # ---- the rest of the contract: what the runtime reads and changes, defined once for every backend --------
    # A backend keeps its ModelConfig as ``cfg``, its core.kv.KVManager as ``kv``, the ``decode_tokens`` parameter
    # and S (geometry.chunk_decode_steps, module docstring) as ``decode_steps``.
    @property
    def action_names(self) -> tuple[str, ...]:
        """Names of the action dimensions, in order (the checkpoint's ``vla.action_names``)."""
        return tuple(self.cfg.action_names)

    def chunk_support_problem(self) -> Optional[str]:
        """Why this backend cannot decode the chunks its checkpoint asks for (None: it can). The inference node
        refuses to configure with this reason. The rule here is the numpy backend's (and its fleet's): any
        action_horizon H >= 1, autoregressive or parallel (module docstring). A backend that differs (CUDA:
        parallel up to 256 slots) overrides this. A per-call refusal (bad forced_bins) is run_chunk's, not this."""
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
