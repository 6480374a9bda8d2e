"""Frame -> KV slot mapping under a hard token budget.

The cache is ``budget_tokens`` slots long. Slots ``0 .. prefix_tokens-1`` hold the pinned prefix and are never
handed out or freed. The rest is cut into frame-sized blocks of ``tokens_per_frame`` consecutive slots starting
at ``prefix_tokens``; a frame owns one block. Evicting a frame returns its block to a free list (a min-heap,
so the lowest free block is reused first and occupied blocks stay packed towards the front), so eviction never
moves any other frame's K/V. When ``prefix_tokens`` is not a multiple of ``tokens_per_frame`` the last
``(budget - prefix) % tpf`` slots are left unused: a frame never straddles the budget.

Only a budget shrink can move data: frames whose block lies beyond the new budget are relocated into free
blocks inside it; :meth:`SlotTable.resize` returns those moves and the backend copies K/V accordingly.
"""
from __future__ import annotations

import heapq

import numpy as np


def check_geometry(budget_tokens: int, tokens_per_frame: int, prefix_tokens: int) -> None:
    """Raise ValueError with a clear reason when the budget geometry is unusable."""
    for name, value in (("budget_tokens", budget_tokens), ("tokens_per_frame", tokens_per_frame),
                        ("prefix_tokens", prefix_tokens)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {type(value).__name__} ({value!r})")
    if tokens_per_frame < 1:
        raise ValueError(f"tokens_per_frame={tokens_per_frame} must be at least 1")
    if prefix_tokens < 0:
        raise ValueError(f"prefix_tokens={prefix_tokens} must not be negative")
    if budget_tokens % tokens_per_frame != 0:
        raise ValueError(f"kv budget_tokens={budget_tokens} is not a multiple of tokens_per_frame="
                         f"{tokens_per_frame}")
    if budget_tokens < prefix_tokens + tokens_per_frame:
        raise ValueError(f"kv budget_tokens={budget_tokens} is smaller than the pinned prefix ({prefix_tokens} "
                         f"tokens) plus one frame ({tokens_per_frame} tokens)")


class SlotTable:
    def __init__(self, budget_tokens: int, tokens_per_frame: int, prefix_tokens: int):
        check_geometry(budget_tokens, tokens_per_frame, prefix_tokens)
        self.budget_tokens = int(budget_tokens)
        self.tokens_per_frame = int(tokens_per_frame)
        self.prefix_tokens = int(prefix_tokens)
        self.prefix_slots = np.arange(self.prefix_tokens, dtype=np.int32)
        self.prefix_slots.flags.writeable = False
        self._block_of: dict[int, int] = {}  # frame id -> block index
        self._free: list[int] = list(range(self.capacity_frames))  # min-heap of free block indices

    # ---- geometry ----------------------------------------------------------------------------------------
    @property
    def capacity_frames(self) -> int:
        return (self.budget_tokens - self.prefix_tokens) // self.tokens_per_frame

    def block_slots(self, block: int) -> np.ndarray:
        start = self.prefix_tokens + block * self.tokens_per_frame
        return np.arange(start, start + self.tokens_per_frame, dtype=np.int32)

    # ---- frames ------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._block_of)

    def __contains__(self, frame_id: int) -> bool:
        return frame_id in self._block_of

    @property
    def occupancy_tokens(self) -> int:
        return self.prefix_tokens + len(self._block_of) * self.tokens_per_frame

    def slots(self, frame_id: int) -> np.ndarray:
        return self.block_slots(self._block_of[frame_id])

    def block_of(self, frame_id: int) -> int:
        return self._block_of[frame_id]

    def blocks_of_frames(self, frame_ids) -> np.ndarray:
        return np.array([self._block_of[f] for f in frame_ids], dtype=np.int64)

    def slots_of_blocks(self, blocks: np.ndarray) -> np.ndarray:
        """The slots of several blocks, concatenated in the given order (one vectorised op: the inference path
        rebuilds the ~4096-slot context list every chunk, and one np.arange per frame cost ~0.1 ms of host time)."""
        tpf = self.tokens_per_frame
        return (self.prefix_tokens + np.asarray(blocks, np.int64)[:, None] * tpf + np.arange(tpf)).astype(np.int32).ravel()

    def slots_of_frames(self, frame_ids) -> np.ndarray:
        """The slots of several frames, concatenated in the given order."""
        return self.slots_of_blocks(self.blocks_of_frames(frame_ids))

    def allocate(self, frame_id: int) -> np.ndarray:
        if frame_id in self._block_of:
            raise ValueError(f"frame id {frame_id} already holds KV slots")
        if not self._free:
            raise RuntimeError(f"no free KV block: {len(self)} frames fill the budget of {self.budget_tokens} "
                               "tokens (evict before allocating)")
        block = heapq.heappop(self._free)
        self._block_of[frame_id] = block
        return self.block_slots(block)

    def free(self, frame_id: int) -> None:
        heapq.heappush(self._free, self._block_of.pop(frame_id))

    def resize(self, budget_tokens: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Change the budget. The caller must already have evicted down to the new capacity.

        Returns ``[(frame_id, old_slots, new_slots), ...]`` for frames relocated into the new range.
        """
        check_geometry(budget_tokens, self.tokens_per_frame, self.prefix_tokens)
        new_cap = (budget_tokens - self.prefix_tokens) // self.tokens_per_frame
        if len(self._block_of) > new_cap:
            raise RuntimeError(f"{len(self)} frames do not fit a budget of {budget_tokens} tokens "
                               f"({new_cap} frames): evict first")
        old_cap = self.capacity_frames
        self.budget_tokens = int(budget_tokens)
        moves: list[tuple[int, np.ndarray, np.ndarray]] = []
        if new_cap >= old_cap:
            for block in range(old_cap, new_cap):
                heapq.heappush(self._free, block)
            return moves
        free_inside = sorted(b for b in self._free if b < new_cap)
        outside = sorted((b, f) for f, b in self._block_of.items() if b >= new_cap)
        for (old_block, frame_id), new_block in zip(outside, free_inside):
            moves.append((frame_id, self.block_slots(old_block), self.block_slots(new_block)))
            self._block_of[frame_id] = new_block
        used = set(self._block_of.values())
        self._free = [b for b in range(new_cap) if b not in used]
        heapq.heapify(self._free)
        return moves
