"""KVManager: the KV-cache policy layer shared by the numpy and CUDA backends.

It holds no K/V arrays: only the slot table (frame -> slots), the order of retained frames, their pooled
embeddings (for ``semantic``) and counters. A backend calls :meth:`KVManager.admit` for every new frame, writes
the frame's pre-RoPE keys and values into the returned slots, and attends over :meth:`context_slots`, rotating
each key by its index in that array (its logical position), so positions stay below the budget forever.

Budget: ``budget_tokens`` counts the pinned prefix. ``admit`` evicts exactly enough frames *before* it takes
a block, so the occupancy never exceeds the budget, not even transiently.

Live changes: ``set_policy`` takes effect at the next eviction; ``set_budget`` evicts at once by the current
policy and returns the evicted ids (frames left beyond a shrunken budget are relocated: see
:meth:`take_moves`); ``set_window`` takes effect at the next admitted frame.
"""
from __future__ import annotations

import functools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .policies import FrameOrder, check_policy, check_semantic_evict, choose_victim
from .saliency import DEFAULT_KS, SaliencyTracker
from .slot_table import SlotTable, check_geometry


@dataclass
class Admission:
    slots: np.ndarray  # int32 (tokens_per_frame,): where the new frame's K/V go
    evicted: list[int] = field(default_factory=list)  # frame ids evicted to make room, in eviction order


def _synchronized(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


def _check_window(window_frames: object) -> int:
    if not isinstance(window_frames, (int, np.integer)) or isinstance(window_frames, bool) or window_frames < 1:
        raise ValueError(f"window_frames must be an integer >= 1, got {window_frames!r}")
    return int(window_frames)


class KVManager:
    """Slot table + eviction policy under a hard token budget (see the module docstring).

    Beyond the documented interface: ``embed_dim`` fixes the pooled-vector length up front (otherwise the first
    admitted vector does); ``saliency_ks`` are the k of the saliency-retention report; ``semantic_evict`` picks
    which frame of the most similar adjacent pair ``semantic`` drops: "older" (the issue's rule) or "newer"
    (keeps the first frame of each static stretch, i.e. scene-change onsets; vla_kv_bench compares both);
    ``protect_salient`` keeps a salient frame of the chosen pair when its partner is not salient.
    Thread-safe: parameter callbacks may call ``set_*`` while the inference thread admits.
    """

    def __init__(self, budget_tokens: int, tokens_per_frame: int, prefix_tokens: int, policy: str = "semantic",
                 window_frames: int = 16, embed_dim: int | None = None, saliency_ks=DEFAULT_KS,
                 timing_samples: int = 4096, semantic_evict: str = "older", protect_salient: bool = True):
        check_geometry(budget_tokens, tokens_per_frame, prefix_tokens)
        self.semantic_evict = check_semantic_evict(semantic_evict)
        if not isinstance(protect_salient, bool):
            raise ValueError(f"protect_salient must be a bool, got {protect_salient!r}")
        self.protect_salient = protect_salient
        self._policy = check_policy(policy)
        self._window = _check_window(window_frames)
        if embed_dim is not None and (not isinstance(embed_dim, int) or embed_dim < 1):
            raise ValueError(f"embed_dim must be a positive integer or None, got {embed_dim!r}")
        self._embed_dim = embed_dim  # fixed by the first admitted vector when None
        self._table = SlotTable(budget_tokens, tokens_per_frame, prefix_tokens)
        self._order = FrameOrder()
        self._salient: set[int] = set()
        self.saliency = SaliencyTracker(saliency_ks)
        self._context: np.ndarray | None = None
        # KV blocks of the retained frames in context order, kept up to date by admit/evict (the context list is
        # rebuilt from it every chunk: walking the frame order through the slot table cost ~50 us per chunk);
        # None = rebuild from the order (after a budget change, a reset)
        self._ctx_blocks: np.ndarray | None = np.zeros(0, np.int64)
        self._moves: list[tuple[int, np.ndarray, np.ndarray]] = []
        self.max_occupancy_tokens = self._table.occupancy_tokens
        self.frames_admitted = 0
        self.evictions = 0
        self._evict_us: deque[float] = deque(maxlen=timing_samples)
        # A parameter callback (set_*) may run on another thread than the inference loop (admit); the lock keeps
        # the table and order consistent. Backends still apply live changes between chunks (K/V moves).
        self._lock = threading.RLock()

    # ---- read-only views ----------------------------------------------------------------------------------
    @property
    def policy(self) -> str:
        return self._policy

    @property
    def budget_tokens(self) -> int:
        return self._table.budget_tokens

    @property
    def tokens_per_frame(self) -> int:
        return self._table.tokens_per_frame

    @property
    def prefix_tokens(self) -> int:
        return self._table.prefix_tokens

    @property
    def window_frames(self) -> int:
        return self._window

    @property
    def capacity_frames(self) -> int:
        return self._table.capacity_frames

    @property
    def prefix_slots(self) -> np.ndarray:
        return self._table.prefix_slots

    @property
    def occupancy_tokens(self) -> int:
        return self._table.occupancy_tokens

    @property
    @_synchronized
    def frames(self) -> list[int]:
        """Retained frame ids, oldest -> newest."""
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, frame_id: int) -> bool:
        return frame_id in self._order

    def slots_of(self, frame_id: int) -> np.ndarray:
        return self._table.slots(frame_id)

    def is_salient(self, frame_id: int) -> bool:
        return frame_id in self._salient

    @_synchronized
    def context_slots(self) -> np.ndarray:
        """Prefix slots, then each retained frame's slots oldest -> newest; logical position == index."""
        if self._context is None:
            if self._ctx_blocks is None:
                self._ctx_blocks = self._table.blocks_of_frames(self._order)
            self._context = np.concatenate([self._table.prefix_slots, self._table.slots_of_blocks(self._ctx_blocks)])
            self._context.flags.writeable = False
        return self._context

    # ---- admission ----------------------------------------------------------------------------------------
    def _check_pooled(self, pooled: object) -> np.ndarray:
        try:
            v = np.asarray(pooled, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"pooled embedding is not numeric: {exc}") from None
        if v.ndim != 1 or v.size == 0:
            raise ValueError(f"pooled embedding must be a non-empty 1-D vector (hidden,), got shape {v.shape}")
        if self._embed_dim is not None and v.shape[0] != self._embed_dim:
            raise ValueError(f"pooled embedding has {v.shape[0]} values, expected {self._embed_dim} (hidden size)")
        if not np.all(np.isfinite(v)):
            raise ValueError("pooled embedding contains NaN or infinite values")
        return v

    def _check_frame_id(self, frame_id: object) -> int:
        if not isinstance(frame_id, (int, np.integer)) or isinstance(frame_id, bool):
            raise ValueError(f"frame id must be an integer, got {type(frame_id).__name__} ({frame_id!r})")
        frame_id = int(frame_id)
        if frame_id in self._order:
            raise ValueError(f"duplicate frame id {frame_id}: that frame is already in the KV cache")
        return frame_id

    def _evict_one(self) -> int:
        victim = choose_victim(self._policy, self._order, self.semantic_evict,
                               self._salient.__contains__ if self.protect_salient else None)
        self._order.remove(victim)
        if self._ctx_blocks is not None:
            self._ctx_blocks = self._ctx_blocks[self._ctx_blocks != self._table.block_of(victim)]
        self._table.free(victim)
        self._salient.discard(victim)
        self.evictions += 1
        return victim

    @_synchronized
    def admit(self, frame_id: int, pooled: np.ndarray, salient: bool = False) -> Admission:
        frame_id = self._check_frame_id(frame_id)
        v = self._check_pooled(pooled)
        # frames that may stay besides the new one
        keep = self._table.capacity_frames - 1
        if self._policy == "sliding_window":
            keep = min(keep, self._window - 1)
        evicted: list[int] = []
        if len(self._order) > keep:
            t0 = time.perf_counter_ns()
            while len(self._order) > keep:
                evicted.append(self._evict_one())
            self._evict_us.append((time.perf_counter_ns() - t0) / 1e3 / len(evicted))
            self.saliency.on_evict(evicted)
        if self._embed_dim is None:
            self._embed_dim = v.shape[0]
        slots = self._table.allocate(frame_id)
        self._order.append(frame_id, v)
        if self._ctx_blocks is not None:
            self._ctx_blocks = np.append(self._ctx_blocks, self._table.block_of(frame_id))
        if salient:
            self._salient.add(frame_id)
        self.saliency.on_admit(frame_id, bool(salient))
        self.frames_admitted += 1
        self._context = None
        self.max_occupancy_tokens = max(self.max_occupancy_tokens, self._table.occupancy_tokens)
        return Admission(slots=slots, evicted=evicted)

    # ---- live changes -------------------------------------------------------------------------------------
    @_synchronized
    def set_policy(self, name: str) -> None:
        """Switch policy; it applies from the next eviction (similarities are always maintained)."""
        self._policy = check_policy(name)

    @_synchronized
    def set_window(self, window_frames: int) -> None:
        """Change ``window_frames``; applies at the next admitted frame (sliding_window only)."""
        self._window = _check_window(window_frames)

    @_synchronized
    def set_budget(self, budget_tokens: int) -> list[int]:
        """Change the budget now. A shrink evicts by the current policy at once; returns the evicted ids.

        Frames whose slots lie beyond a shrunken budget are moved into free slots inside it; the backend must
        copy their K/V: see :meth:`take_moves`.
        """
        check_geometry(budget_tokens, self._table.tokens_per_frame, self._table.prefix_tokens)
        new_cap = (budget_tokens - self._table.prefix_tokens) // self._table.tokens_per_frame
        evicted: list[int] = []
        while len(self._order) > new_cap:
            evicted.append(self._evict_one())
        self.saliency.on_evict(evicted)
        self._moves.extend(self._table.resize(int(budget_tokens)))
        self._context = None
        self._ctx_blocks = None  # frames may have moved to other blocks
        return evicted

    @_synchronized
    def reset(self) -> list[int]:
        """Drop every retained frame (e.g. a new episode); the pinned prefix, policy, budget and counters stay.

        Returns the dropped ids (not counted as evictions; salient ones count as lost for saliency retention).
        Pending moves are discarded: no retained frame is left to copy.
        """
        dropped = list(self._order)
        for f in dropped:
            self._order.remove(f)
            self._table.free(f)
        self._salient.clear()
        self.saliency.on_evict(dropped)
        self._moves = []
        self._context = None
        self._ctx_blocks = None
        return dropped

    @_synchronized
    def take_moves(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Relocations made by budget shrinks since the last call: ``[(frame_id, old_slots, new_slots)]``.

        The backend copies K/V rows ``old_slots -> new_slots`` before the next attention. Each old block reaches
        beyond the new budget, each new one lies inside it, and no old slot belongs to any retained frame
        afterwards, so the copies never overlap and their order does not matter.
        """
        moves, self._moves = self._moves, []
        return moves

    # ---- reporting ----------------------------------------------------------------------------------------
    @_synchronized
    def stats(self) -> dict:
        s = {
            "policy": self._policy,
            "semantic_evict": self.semantic_evict,
            "protect_salient": self.protect_salient,
            "budget_tokens": self.budget_tokens,
            "tokens_per_frame": self.tokens_per_frame,
            "prefix_tokens": self.prefix_tokens,
            "window_frames": self._window,
            "occupancy_tokens": self.occupancy_tokens,
            "max_occupancy_tokens": self.max_occupancy_tokens,
            "frames_retained": len(self._order),
            "frames_admitted": self.frames_admitted,
            "evictions": self.evictions,
            "salient_retained": len(self._salient),
            "saliency": self.saliency.report(),
        }
        if self._evict_us:
            us = np.fromiter(self._evict_us, dtype=np.float64)
            s["eviction_time_us"] = {"p50": float(np.percentile(us, 50)), "p99": float(np.percentile(us, 99)),
                                     "samples": int(us.size)}
        else:
            s["eviction_time_us"] = {"p50": None, "p99": None, "samples": 0}
        return s
