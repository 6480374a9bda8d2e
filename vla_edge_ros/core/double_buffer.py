"""Single-writer / single-reader "latest value" buffer between the camera callback and the inference thread.

The camera callback (writer) must never wait on the inference thread (reader), and the reader only ever wants
the freshest frame: older frames that were never read are worthless and are counted as ``overwritten``.

How it is lock-free
-------------------
The writer builds an immutable ``(seq, item)`` tuple and publishes it with ONE attribute store
(``self._slot = (seq, item)``). The reader loads ``self._slot`` once into a local and works on that tuple.

* In CPython an attribute store/load of an object reference is a single bytecode executed while holding the GIL
  (and, on the free-threaded 3.13t build, under the object's own per-object lock), so the reader observes
  either the old tuple or the new one, never a torn mix of a new ``seq`` with an old ``item``. Because the
  tuple is immutable and fully built before it is published, whatever the reader sees is consistent.
* Reference counting keeps the old tuple alive for as long as the reader still holds it, so there is no
  use-after-free / ABA problem that a C++ port must solve explicitly.
* A C++ port would use ``std::atomic<std::shared_ptr<const Slot>>`` (C++20; ``store(memory_order_release)`` by
  the writer, ``load(memory_order_acquire)`` by the reader), or the classic triple buffer: three slots plus an
  ``std::atomic<uint8_t>`` holding the "middle" index and a "new data" bit, swapped with ``exchange`` (acq_rel).

Each side owns its own counters (the writer ``_seq``, the reader a ``(read, last_read_seq, gaps)`` tuple that
is also published with a single store), so no counter is written by two threads. ``overwritten`` is exact:
every sequence number below the newest one that the reader never received can never be read any more.

Waiting: only the READER blocks (``wait_latest``) on a ``threading.Event``; the writer calls ``Event.set()``,
which takes the event's internal condition lock for a few instructions but never waits for the reader.
"""
from __future__ import annotations

import threading
import time
from typing import Generic, Optional, TypeVar

T = TypeVar("T")


class DoubleBuffer(Generic[T]):
    """Latest-value mailbox: ``write`` never blocks; ``read_latest`` returns each freshest item at most once."""

    def __init__(self) -> None:
        self._slot: Optional[tuple[int, T]] = None  # (seq, item); replaced, never mutated
        self._seq = 0  # writer-owned: number of items written
        self._reader: tuple[int, int, int] = (0, 0, 0)  # reader-owned: (read, last_read_seq, gap_overwritten)
        self._event = threading.Event()

    # ---- writer side ----------------------------------------------------------------------------------
    def write(self, item: T) -> None:
        seq = self._seq + 1
        self._seq = seq
        self._slot = (seq, item)  # the one atomic publication (see module docstring)
        self._event.set()  # wakes a waiting reader; never waits itself

    # ---- reader side ----------------------------------------------------------------------------------
    def read_latest_with_seq(self) -> Optional[tuple[int, T]]:
        """``(seq, item)`` of the freshest unread item, or None when nothing new was written since the last read."""
        slot = self._slot  # single load: a consistent (seq, item) pair
        read, last_seq, gaps = self._reader
        if slot is None or slot[0] <= last_seq:
            return None
        seq = slot[0]
        # Every seq strictly between the previous read and this one was written and replaced unread.
        self._reader = (read + 1, seq, gaps + (seq - last_seq - 1))
        return slot

    def read_latest(self) -> Optional[T]:
        slot = self.read_latest_with_seq()
        return None if slot is None else slot[1]

    def wait_latest(self, timeout_s: Optional[float]) -> Optional[T]:
        """Block the reader until an unread item exists (returned) or ``timeout_s`` passes (None)."""
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        while True:
            item = self.read_latest_with_seq()
            if item is not None:
                return item[1]
            # Clear, then re-check: a write landing between the check above and clear() would otherwise leave
            # the event cleared with an unread item (lost wake-up). The writer stores the slot BEFORE set().
            self._event.clear()
            item = self.read_latest_with_seq()
            if item is not None:
                return item[1]
            if deadline is None:
                self._event.wait()
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0.0 or not self._event.wait(remaining):
                    item = self.read_latest_with_seq()
                    return None if item is None else item[1]

    def peek(self) -> Optional[T]:
        """The newest item without marking it read (for diagnostics; any thread)."""
        slot = self._slot
        return None if slot is None else slot[1]

    # ---- counters (safe to read from any thread; each is derived from one atomic snapshot per side) -------
    @property
    def written(self) -> int:
        slot = self._slot  # the published seq, consistent with ``overwritten`` / ``pending``
        return 0 if slot is None else slot[0]

    @property
    def read(self) -> int:
        return self._reader[0]

    @property
    def last_read_seq(self) -> int:
        return self._reader[1]

    @property
    def overwritten(self) -> int:
        """Items replaced before the reader took them (exact): gaps already seen plus unread items below the newest."""
        _read, last_seq, gaps = self._reader
        slot = self._slot
        newest = 0 if slot is None else slot[0]
        return gaps + max(0, newest - last_seq - 1)

    @property
    def pending(self) -> int:
        """1 when the newest item has not been read yet, else 0."""
        slot = self._slot
        return int(slot is not None and slot[0] > self._reader[1])

    def stats(self) -> dict[str, int]:
        read, last_seq, gaps = self._reader
        slot = self._slot
        newest = 0 if slot is None else slot[0]
        return {
            "written": newest,
            "read": read,
            "overwritten": gaps + max(0, newest - last_seq - 1),
            "pending": int(newest > last_seq),
        }
