"""The freshest-frame mailbox between two processes: a camera process writes, the fleet edge's loop reads.

Why: measured in issue 24's 8-robot replay (docs/FIGURES.md, sessions 21-22), the fleet loop's slow passes wait
tens of milliseconds for the GIL, and the eight camera executors (rclpy taking messages, building wait sets) hold
it more than half of the time it is held. Frames must reach the loop without the cameras sharing its interpreter:
the cameras run in their own process (ros/fleet_cameras.py) and hand frames over through this buffer, which keeps
``core/double_buffer.DoubleBuffer``'s contract (the writer never waits for the reader's copy, the reader gets each
freshest frame at most once, frames replaced unread are counted exactly) across a process boundary.

How: a triple buffer in one shared-memory file (``/dev/shm`` where it exists). Three slots hold frames; a small
header says which slot holds the newest frame (``latest``) and which one the reader is copying (``reading``).
The writer fills a slot that is neither, then publishes it; the reader marks the newest slot as ``reading``,
copies it out, and releases it. With three slots the writer always has one to fill, so it never waits for a
copy. Only the index swaps take a lock (a process-shared semaphore: microseconds, and its acquire/release are the
memory barriers that make the slot's bytes visible before its index, on ARM too; Python has no fence of its own).
A lock held by a process that died is not waited for: the reader gives up after ``lock_timeout_s`` and counts it,
and the supervisor that restarts the writer gives both sides a new lock (``renew_lock``).

Frame ids: a frame's ``frame_id`` is its sequence number in this buffer, kept in the shared header, so a camera
process that is restarted goes on counting where the dead one stopped (the engine's KV cache keys its slots on
frame ids; ``CameraNode`` counts from 1 in every new process).

No ROS here: the camera process adapts its frames (``image``, ``stamp_ns``, ``received_ns``, ``header_frame_id``
attributes) to ``write``; the reader's frames are ``SharedFrame``.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

MAGIC = 0x56_4C_41_46_52_4D_31  # "VLAFRM1"
SLOTS = 3
HEADER_WORDS = 64  # int64 words before the slots' metadata
SLOT_META_WORDS = 8  # seq, stamp_ns, received_ns, height, width, channels, nbytes, id_len
FRAME_ID_BYTES = 128  # header.frame_id, utf-8, truncated
# header words
_MAGIC, _SLOT_BYTES, _LATEST, _WRITTEN, _READING, _READ, _LAST_READ, _GAPS, _TOO_LARGE = range(9)
_META = HEADER_WORDS
_IDS = (HEADER_WORDS + SLOTS * SLOT_META_WORDS) * 8  # byte offset of the frame-id strings
_DATA = _IDS + SLOTS * FRAME_ID_BYTES
_DATA = (_DATA + 63) // 64 * 64  # slots start cache-line aligned


class FrameTooLarge(ValueError):
    """A frame larger than the buffer's slots (``slot_bytes``): rejected and counted, never truncated."""


@dataclass
class SharedFrame:
    """A frame as the reader gets it: the camera_node.CameraFrame fields, the image copied out of shared memory."""
    image: np.ndarray  # (H, W, C) uint8
    stamp_ns: int
    received_ns: int
    frame_id: int  # this buffer's sequence number of the frame (continues across writer restarts)
    header_frame_id: str = ""


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class SharedFrameBuffer:
    """One robot's freshest-frame triple buffer in a shared file. ``create`` in the reader's process (it owns and
    unlinks the file), ``attach`` in the writer's; ``spec()`` is what the writer's process needs to attach."""

    def __init__(self, path: str, lock: Any, owner: bool, lock_timeout_s: float = 0.005) -> None:
        self.path, self.owner, self.lock_timeout_s = path, owner, float(lock_timeout_s)
        self._lock = lock
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            self._hdr = np.frombuffer(self._mm, dtype=np.int64, count=HEADER_WORDS + SLOTS * SLOT_META_WORDS)
        except ValueError:
            self._mm.close()
            raise ValueError(f"{path} is not a frame buffer ({size} bytes, shorter than the header)") from None
        magic = int(self._hdr[_MAGIC])
        if magic != MAGIC:
            self.close()
            raise ValueError(f"{path} is not a frame buffer (magic {magic:#x})")
        self.slot_bytes = int(self._hdr[_SLOT_BYTES])
        self._data = np.frombuffer(self._mm, dtype=np.uint8, offset=_DATA, count=SLOTS * self.slot_bytes)
        self.lock_timeouts = 0  # this side's acquires that gave up (a lock held by a dead process)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def create(cls, slot_bytes: int, lock: Any, prefix: str = "vla_frames_", **kw) -> "SharedFrameBuffer":
        """A new buffer whose slots take frames of up to ``slot_bytes``. The file's pages are allocated now, so
        a full ``/dev/shm`` fails here with OSError instead of killing the writer with SIGBUS later."""
        slot_bytes = int(slot_bytes)
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
        fd, path = tempfile.mkstemp(prefix=prefix, dir=_shm_dir())
        try:
            size = _DATA + SLOTS * slot_bytes
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot allocate {size / 2**20:.1f} MiB for a shared frame buffer in "
                                         f"{os.path.dirname(path)} ({exc.strerror}): free space there, or lower "
                                         "the frame size limit") from exc
            hdr = np.zeros(HEADER_WORDS + SLOTS * SLOT_META_WORDS, dtype=np.int64)
            hdr[_MAGIC], hdr[_SLOT_BYTES], hdr[_LATEST], hdr[_READING] = MAGIC, slot_bytes, -1, -1
            os.pwrite(fd, hdr.tobytes(), 0)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls(path, lock, owner=True, **kw)

    @classmethod
    def attach(cls, path: str, lock: Any, **kw) -> "SharedFrameBuffer":
        return cls(path, lock, owner=False, **kw)

    def spec(self) -> tuple[str, Any]:
        """``(path, lock)``: pass to a process started with multiprocessing (the lock travels only that way)."""
        return self.path, self._lock

    def renew_lock(self, lock: Any) -> None:
        """Use ``lock`` from now on (the old one may be held by a writer that died); give the new writer the same."""
        self._lock = lock

    def close(self) -> None:
        self._hdr = self._data = None  # views first: mmap.close refuses while they export its buffer
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # ---- the index swaps ------------------------------------------------------------------------------------
    def _acquire(self) -> Any:
        """The lock, taken (release that same object: ``renew_lock`` may swap ``_lock`` meanwhile), or None when
        it was not taken within ``lock_timeout_s`` (counted)."""
        lock = self._lock
        if lock.acquire(True, self.lock_timeout_s):
            return lock
        self.lock_timeouts += 1
        return None

    # ---- writer side ------------------------------------------------------------------------------------------
    def write(self, frame: Any) -> int:
        """Publish ``frame`` (``image`` (H, W[, C]) uint8, ``stamp_ns``, ``received_ns``, ``header_frame_id``); its
        sequence number (the reader's ``frame_id``), 0 when the lock could not be taken (counted, frame dropped).
        FrameTooLarge (counted in the header) for an image larger than a slot."""
        image = np.asarray(frame.image)
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise ValueError(f"frame image must be (H, W[, C]) uint8, got {image.dtype} {image.shape}")
        if image.nbytes > self.slot_bytes:
            self._hdr[_TOO_LARGE] += 1  # writer-owned word
            raise FrameTooLarge(f"frame of {image.shape} is {image.nbytes} bytes, the shared buffer's slots hold "
                                f"{self.slot_bytes}")
        hdr = self._hdr
        lock = self._acquire()
        if lock is None:
            return 0
        try:
            taken = {int(hdr[_LATEST]), int(hdr[_READING])}
            slot = next(s for s in range(SLOTS) if s not in taken)
        finally:
            lock.release()
        # the slot is neither the newest nor being read: nobody looks at it until it is published below
        h, w = image.shape[:2]
        c = image.shape[2] if image.ndim == 3 else 0
        start = slot * self.slot_bytes
        self._data[start:start + image.nbytes].reshape(image.shape)[...] = image
        ident = str(getattr(frame, "header_frame_id", "") or "").encode("utf-8")[:FRAME_ID_BYTES]
        ident = ident.decode("utf-8", "ignore").encode("utf-8")  # cut at a character boundary
        self._mm[_IDS + slot * FRAME_ID_BYTES:_IDS + slot * FRAME_ID_BYTES + len(ident)] = ident
        meta = _META + slot * SLOT_META_WORDS
        hdr[meta + 1:meta + SLOT_META_WORDS] = (int(frame.stamp_ns), int(getattr(frame, "received_ns", 0) or 0),
                                                h, w, c, image.nbytes, len(ident))
        lock = self._acquire()
        if lock is None:
            return 0
        try:
            seq = int(hdr[_WRITTEN]) + 1
            hdr[meta] = seq
            hdr[_LATEST] = slot
            hdr[_WRITTEN] = seq
        finally:
            lock.release()
        return seq

    # ---- reader side ------------------------------------------------------------------------------------------
    def read_latest_with_seq(self) -> Optional[tuple[int, SharedFrame]]:
        """``(seq, frame)`` of the freshest unread frame, or None (nothing new, or the lock not taken: counted)."""
        hdr = self._hdr
        if hdr is None:  # closed: nothing to read (a reader still polling during shutdown)
            return None
        last_seq = int(hdr[_LAST_READ])
        if int(hdr[_WRITTEN]) <= last_seq:  # unlocked peek: nothing new (a stale read only delays to next cycle)
            return None
        lock = self._acquire()
        if lock is None:
            return None
        try:
            slot = int(hdr[_LATEST])
            seq = int(hdr[_META + slot * SLOT_META_WORDS]) if slot >= 0 else 0
            if slot < 0 or seq <= last_seq:
                return None
            hdr[_READING] = slot
        finally:
            lock.release()
        try:
            meta = _META + slot * SLOT_META_WORDS
            stamp, received, h, w, c, nbytes, id_len = (int(x) for x in hdr[meta + 1:meta + SLOT_META_WORDS])
            start = slot * self.slot_bytes
            shape = (h, w, c) if c else (h, w)
            image = self._data[start:start + nbytes].reshape(shape).copy()
            ident = bytes(self._mm[_IDS + slot * FRAME_ID_BYTES:_IDS + slot * FRAME_ID_BYTES + id_len])
        finally:
            lock = self._acquire()
            if lock is not None:
                hdr[_READING] = -1
                lock.release()
            # else: the slot stays marked as read; the writer still has the third one, and a renewed lock clears it
        hdr[_READ] += 1  # reader-owned words
        hdr[_GAPS] += seq - last_seq - 1
        hdr[_LAST_READ] = seq
        return seq, SharedFrame(image, stamp, received, seq, ident.decode("utf-8", "replace"))

    def read_latest(self) -> Optional[SharedFrame]:
        got = self.read_latest_with_seq()
        return None if got is None else got[1]

    def wait_latest(self, timeout_s: Optional[float], poll_s: float = 0.001) -> Optional[SharedFrame]:
        """Poll until an unread frame exists or ``timeout_s`` passes (no cross-process event: the fleet loop reads
        on its cycle boundaries and never waits here; tests and tools do)."""
        end = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        while True:
            got = self.read_latest()
            if got is not None or (end is not None and time.monotonic() >= end):
                return got
            time.sleep(poll_s)

    def clear_reading(self) -> None:
        """After ``renew_lock``: a read interrupted by the old lock leaves its slot marked; free it."""
        lock = self._acquire()
        if lock is not None:
            self._hdr[_READING] = -1
            lock.release()

    # ---- counters (DoubleBuffer's, from either process) -----------------------------------------------------
    @property
    def written(self) -> int:
        return 0 if self._hdr is None else int(self._hdr[_WRITTEN])

    def stats(self) -> dict[str, int]:
        hdr = self._hdr
        if hdr is None:  # closed
            return {"written": 0, "read": 0, "overwritten": 0, "pending": 0, "too_large": 0,
                    "lock_timeouts": self.lock_timeouts, "closed": 1}
        newest, last_seq = int(hdr[_WRITTEN]), int(hdr[_LAST_READ])
        return {"written": newest, "read": int(hdr[_READ]),
                "overwritten": int(hdr[_GAPS]) + max(0, newest - last_seq - 1), "pending": int(newest > last_seq),
                "too_large": int(hdr[_TOO_LARGE]), "lock_timeouts": self.lock_timeouts}
