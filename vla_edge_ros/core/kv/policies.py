"""Eviction policies over the retained frames (no K/V arrays here: only order and pooled embeddings).

``FrameOrder`` keeps the retained frames oldest -> newest as a doubly linked list (O(1) removal anywhere) and,
for every adjacent retained pair, the cosine similarity of their pooled embeddings in a max-heap with lazy
invalidation: admitting a frame pushes one pair (previous newest, new); removing a frame from the middle
creates exactly one new adjacent pair (its predecessor, its successor) whose similarity is computed once.
Entries whose pair is no longer adjacent (or whose frames left) are skipped when they reach the top, and the
heap is rebuilt from the live pairs when stale entries outnumber them, so a long ``fifo`` run cannot grow it
without bound. Similarities are maintained under every policy, so a live switch to ``semantic`` works at once.

Policies:
- ``semantic``: evict the OLDER frame of the adjacent pair with the highest cosine similarity (ties: the
  oldest such pair). With fewer than two frames there is no pair and the oldest frame goes. With
  ``protect_salient`` (the default) a salient-tagged older frame whose newer partner is not salient is kept
  and the partner goes instead: the two are near-duplicates, so the pair's content survives either way, but
  "evict the older" alone removes every scene-change onset (it is the older frame of the first pair of its
  new stretch) almost at once; vla_kv_bench shows both.
- ``fifo``: evict the oldest frame.
- ``sliding_window``: evict the oldest frame; in addition the manager keeps at most ``window_frames`` frames.

Cosine similarity uses float64 unit vectors; a zero vector has similarity 0 with anything except another zero
vector (1.0: two identical blank frames are as redundant as frames get).
"""
from __future__ import annotations

import heapq
from typing import Iterator

import numpy as np

POLICIES = ("semantic", "fifo", "sliding_window")


def check_policy(name: object) -> str:
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}: choose one of {', '.join(POLICIES)}")
    return name


def unit_vector(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    scale = float(np.max(np.abs(v))) if v.size else 0.0
    if scale == 0.0:
        return np.zeros_like(v)
    v = v / scale  # so the squared norm cannot overflow for huge finite values
    return v / float(np.sqrt(np.dot(v, v)))


def cosine_of_units(ua: np.ndarray, ub: np.ndarray) -> float:
    """Cosine similarity of two vectors given as :func:`unit_vector` outputs."""
    if not ua.any() and not ub.any():
        return 1.0
    return float(np.dot(ua, ub))


class FrameOrder:
    """Retained frames in admission order plus the adjacent-pair similarity heap."""

    def __init__(self) -> None:
        self._prev: dict[int, int | None] = {}
        self._next: dict[int, int | None] = {}
        self._seq: dict[int, int] = {}
        self._unit: dict[int, np.ndarray] = {}
        self._head: int | None = None
        self._tail: int | None = None
        self._counter = 0
        # (-similarity, seq_older, seq_newer, older_id, newer_id); python compares tuples lexicographically,
        # so equal similarities pop the oldest pair first.
        self._heap: list[tuple[float, int, int, int, int]] = []

    # ---- order --------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, frame_id: int) -> bool:
        return frame_id in self._seq

    def __iter__(self) -> Iterator[int]:
        f = self._head
        while f is not None:
            yield f
            f = self._next[f]

    @property
    def oldest(self) -> int | None:
        return self._head

    @property
    def newest(self) -> int | None:
        return self._tail

    def neighbours(self, frame_id: int) -> tuple[int | None, int | None]:
        return self._prev[frame_id], self._next[frame_id]

    def similarity(self, older: int, newer: int) -> float:
        return cosine_of_units(self._unit[older], self._unit[newer])

    def append(self, frame_id: int, pooled: np.ndarray) -> None:
        self._seq[frame_id] = self._counter
        self._counter += 1
        self._unit[frame_id] = unit_vector(pooled)
        self._prev[frame_id] = self._tail
        self._next[frame_id] = None
        if self._tail is None:
            self._head = frame_id
        else:
            self._next[self._tail] = frame_id
            self._push_pair(self._tail, frame_id)
        self._tail = frame_id

    def remove(self, frame_id: int) -> None:
        p, n = self._prev.pop(frame_id), self._next.pop(frame_id)
        del self._seq[frame_id], self._unit[frame_id]
        if p is None:
            self._head = n
        else:
            self._next[p] = n
        if n is None:
            self._tail = p
        else:
            self._prev[n] = p
        if p is not None and n is not None:
            self._push_pair(p, n)  # the one new adjacent pair
        self._maybe_compact()

    # ---- similarity heap ---------------------------------------------------------------------------------
    def _push_pair(self, older: int, newer: int) -> None:
        heapq.heappush(self._heap, (-self.similarity(older, newer), self._seq[older], self._seq[newer],
                                    older, newer))

    def _live(self, entry: tuple[float, int, int, int, int]) -> bool:
        _, sa, sb, a, b = entry
        return self._seq.get(a) == sa and self._seq.get(b) == sb and self._next.get(a) == b

    def _maybe_compact(self) -> None:
        if len(self._heap) > 2 * len(self._seq) + 64:
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)

    def most_similar_pair(self) -> tuple[int, int, float] | None:
        """The adjacent pair with the highest cosine similarity (oldest on ties), or None with < 2 frames."""
        heap = self._heap
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        if not heap:
            return None
        neg, _, _, a, b = heap[0]
        return a, b, -neg


SEMANTIC_EVICT = ("older", "newer")


def check_semantic_evict(which: object) -> str:
    if which not in SEMANTIC_EVICT:
        raise ValueError(f"semantic_evict={which!r}: choose 'older' or 'newer'")
    return which  # type: ignore[return-value]


def choose_victim(policy: str, order: FrameOrder, semantic_evict: str = "older",
                  is_salient=None) -> int:
    """The frame ``policy`` evicts next from ``order`` (which must not be empty).

    ``semantic_evict`` picks which frame of the most similar pair ``semantic`` drops: "older" (the issue's
    rule; keeps the newest frame of each static stretch) or "newer" (keeps the first frame of each stretch,
    i.e. the scene-change onset; see the saliency figures of vla_kv_bench). ``is_salient`` (frame id -> bool),
    when given, protects a salient frame of the pair whose partner is not salient.
    """
    if len(order) == 0:
        raise RuntimeError("no retained frame to evict")
    if policy == "semantic":
        pair = order.most_similar_pair()
        if pair is not None:
            victim, partner = (pair[0], pair[1]) if semantic_evict == "older" else (pair[1], pair[0])
            if is_salient is not None and is_salient(victim) and not is_salient(partner):
                victim = partner
            return victim
    return order.oldest  # fifo, sliding_window, or semantic with a single frame
