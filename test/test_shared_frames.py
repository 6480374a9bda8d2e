"""SharedFrameBuffer: DoubleBuffer's contract (freshest frame at most once, exact overwrite counts) across processes."""
from __future__ import annotations

import multiprocessing
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from vla_edge_ros.core.shared_frames import (
    FRAME_ID_BYTES, SLOT_META_WORDS, SLOTS, FrameTooLarge, SharedFrame, SharedFrameBuffer, _LATEST, _META, _READING,
    _shm_dir,
)

CTX = multiprocessing.get_context("spawn")  # the camera process is started this way: its locks must come from it


def frame(image, stamp_ns=1, received_ns=2, header_frame_id="cam"):
    return SimpleNamespace(image=image, stamp_ns=stamp_ns, received_ns=received_ns, header_frame_id=header_frame_id)


def img(value, shape=(4, 6, 3)):
    return np.full(shape, value, dtype=np.uint8)


@pytest.fixture
def buffers():
    """``make(slot_bytes, **kw)`` -> (reader/owner, writer attached to it); every buffer is closed at the end."""
    made: list[SharedFrameBuffer] = []

    def make(slot_bytes=4096, lock=None, reader_kw=None, writer_kw=None):
        lock = CTX.Lock() if lock is None else lock
        owner = SharedFrameBuffer.create(slot_bytes, lock, **(reader_kw or {}))
        made.append(owner)
        writer = SharedFrameBuffer.attach(*owner.spec(), **(writer_kw or {}))
        made.append(writer)
        return owner, writer

    yield make
    paths = {b.path for b in made if b.owner}
    for b in reversed(made):
        b.close()
    assert not any(os.path.exists(p) for p in paths), "an owner's close left its file behind"


def slot_of_latest(buf):
    return int(buf._hdr[_LATEST])


def slot_bytes_copy(buf, slot):
    return buf._data[slot * buf.slot_bytes:(slot + 1) * buf.slot_bytes].copy()


# ---- 1: round trip -----------------------------------------------------------------------------------------------
def _shapes():
    rng = np.random.default_rng(7)
    big = rng.integers(0, 256, size=(12, 18, 3), dtype=np.uint8)
    return {
        "rgb": rng.integers(0, 256, size=(8, 10, 3), dtype=np.uint8),
        "grey_2d": rng.integers(0, 256, size=(9, 11), dtype=np.uint8),
        "rgba": rng.integers(0, 256, size=(5, 7, 4), dtype=np.uint8),
        "single_pixel": np.array([[[42]]], dtype=np.uint8),
        "strided_view": big[::2, ::3, ::-1],  # non-contiguous, negative stride
        "transposed_grey": rng.integers(0, 256, size=(6, 13), dtype=np.uint8).T,
    }


@pytest.mark.parametrize("name", list(_shapes()))
def test_attached_writers_frame_reads_back_bit_identical_in_the_creator(buffers, name):
    image = _shapes()[name]
    if name in ("strided_view", "transposed_grey"):
        assert not image.flags.c_contiguous
    reader, writer = buffers(slot_bytes=1024)
    seq = writer.write(frame(image, stamp_ns=1_234_567_890_123, received_ns=1_234_567_899_999,
                             header_frame_id="wrist_cam_optical"))
    assert seq == 1
    got = reader.read_latest_with_seq()
    assert got is not None
    rseq, f = got
    assert isinstance(f, SharedFrame)
    assert rseq == seq == f.frame_id
    assert f.image.dtype == np.uint8 and f.image.shape == image.shape
    assert np.array_equal(f.image, image)
    assert f.stamp_ns == 1_234_567_890_123 and f.received_ns == 1_234_567_899_999
    assert f.header_frame_id == "wrist_cam_optical"


def test_read_image_is_a_private_copy_not_a_view_of_shared_memory(buffers):
    reader, writer = buffers(slot_bytes=256)
    writer.write(frame(img(7)))
    f = reader.read_latest()
    for v in range(8, 8 + 2 * SLOTS):  # enough writes to reuse every slot, including the one just read
        writer.write(frame(img(v)))
    assert (f.image == 7).all()
    f.image[...] = 99  # writable, and writing it touches nothing shared
    assert (reader.read_latest().image == 8 + 2 * SLOTS - 1).all()


def test_frame_ids_are_sequence_numbers_and_missing_fields_default(buffers):
    reader, writer = buffers(slot_bytes=256)
    seqs = [writer.write(frame(img(i), stamp_ns=100 + i)) for i in range(3)]
    assert seqs == [1, 2, 3]
    assert writer.written == reader.written == 3
    writer.write(SimpleNamespace(image=img(9), stamp_ns=5))  # no received_ns / header_frame_id attributes
    seq, f = reader.read_latest_with_seq()
    assert seq == f.frame_id == 4
    assert f.received_ns == 0 and f.header_frame_id == ""


def test_header_frame_id_longer_than_the_field_is_truncated_safely(buffers):
    reader, writer = buffers(slot_bytes=256)
    # 200 bytes of 2-byte characters: the cut at 128 bytes falls on a character boundary
    clean = "é" * 100
    writer.write(frame(img(1), header_frame_id=clean))
    assert reader.read_latest().header_frame_id == "é" * (FRAME_ID_BYTES // 2)
    # 201 bytes: the cut at 128 bytes splits a 2-byte character; reading must not raise, and what comes back is
    # the 127-byte prefix: the writer cuts at the character boundary
    odd = "a" + "é" * 100
    writer.write(frame(img(2), header_frame_id=odd))
    seq, f = reader.read_latest_with_seq()
    assert f.header_frame_id == "a" + "é" * 63
    slot = slot_of_latest(reader)
    assert int(reader._hdr[_META + slot * SLOT_META_WORDS + 7]) <= FRAME_ID_BYTES
    # a short id written later into the same slots is not polluted by the long one's tail
    for i in range(SLOTS):
        writer.write(frame(img(3), header_frame_id=f"c{i}"))
    assert reader.read_latest().header_frame_id == f"c{SLOTS - 1}"


# ---- 2: at most once, exact overwrite counts ------------------------------------------------------------------------
def test_empty_buffer_reads_nothing(buffers):
    reader, _ = buffers()
    assert reader.read_latest() is None
    assert reader.read_latest_with_seq() is None
    assert reader.wait_latest(0.0) is None
    assert reader.stats() == {"written": 0, "read": 0, "overwritten": 0, "pending": 0, "too_large": 0,
                              "lock_timeouts": 0}


def test_freshest_frame_is_read_at_most_once_and_overwrites_are_counted_exactly(buffers):
    reader, writer = buffers(slot_bytes=256)
    for i in range(1, 6):
        writer.write(frame(img(i), stamp_ns=i))
    s = reader.stats()
    assert s["pending"] == 1 and s["overwritten"] == 4
    seq, f = reader.read_latest_with_seq()
    assert seq == 5 and f.stamp_ns == 5 and (f.image == 5).all()
    assert reader.read_latest() is None  # at most once
    assert reader.stats()["pending"] == 0
    for i in (6, 7):
        writer.write(frame(img(i), stamp_ns=i))
    assert reader.stats()["pending"] == 1
    seq, f = reader.read_latest_with_seq()
    assert seq == 7 and f.stamp_ns == 7 and (f.image == 7).all()
    assert reader.read_latest_with_seq() is None
    s = reader.stats()
    assert {k: s[k] for k in ("written", "read", "overwritten", "pending")} == \
        {"written": 7, "read": 2, "overwritten": 5, "pending": 0}
    # the counters live in the shared header: the writer's side sees the same (but for its own lock_timeouts)
    assert writer.stats() == s


def test_wait_latest_times_out_then_returns_a_frame_written_before(buffers):
    reader, writer = buffers(slot_bytes=256)
    t0 = time.monotonic()
    assert reader.wait_latest(0.02) is None
    assert time.monotonic() - t0 >= 0.02
    writer.write(frame(img(3), stamp_ns=3))
    assert reader.wait_latest(1.0).stamp_ns == 3
    assert reader.wait_latest(0.0) is None


# ---- 3: the slot being read is never refilled -------------------------------------------------------------------------
def test_writer_never_fills_the_slot_being_read(buffers):
    reader, writer = buffers(slot_bytes=96)
    writer.write(frame(img(1), stamp_ns=1, header_frame_id="one"))
    slot = slot_of_latest(reader)
    reader._hdr[_READING] = slot  # the reader is copying this slot (as between its two index swaps)
    data_before = slot_bytes_copy(reader, slot)
    meta = _META + slot * SLOT_META_WORDS
    meta_before = reader._hdr[meta:meta + SLOT_META_WORDS].copy()
    used = set()
    for i in range(2, 12):
        assert writer.write(frame(img(i), stamp_ns=i, header_frame_id=f"id{i}")) == i
        used.add(slot_of_latest(reader))
    assert slot not in used and len(used) == SLOTS - 1  # the other two slots alternate
    assert np.array_equal(slot_bytes_copy(reader, slot), data_before)
    assert np.array_equal(reader._hdr[meta:meta + SLOT_META_WORDS], meta_before)
    reader.clear_reading()
    assert int(reader._hdr[_READING]) == -1
    seq, f = reader.read_latest_with_seq()
    assert seq == 11 and f.stamp_ns == 11 and (f.image == 11).all() and f.header_frame_id == "id11"
    assert reader.stats()["overwritten"] == 10


def test_a_read_releases_its_slot_for_the_writer(buffers):
    reader, writer = buffers(slot_bytes=96)
    writer.write(frame(img(1)))
    read_slot = slot_of_latest(reader)
    reader.read_latest()
    assert int(reader._hdr[_READING]) == -1
    slots = []
    for i in range(2, 2 + 2 * SLOTS):
        writer.write(frame(img(i)))
        slots.append(slot_of_latest(reader))
    assert read_slot in slots  # the slot just read is filled again
    assert all(a != b for a, b in zip(slots, slots[1:]))  # never the slot holding the newest frame


# ---- 4: rejected frames -------------------------------------------------------------------------------------------
def test_too_large_frame_is_rejected_counted_and_not_published(buffers):
    reader, writer = buffers(slot_bytes=4 * 6 * 3)
    assert writer.write(frame(img(1))) == 1  # exactly slot_bytes fits
    reader.read_latest()
    with pytest.raises(FrameTooLarge):
        writer.write(frame(img(2, shape=(4, 6, 4))))
    with pytest.raises(ValueError):  # FrameTooLarge is a ValueError
        writer.write(frame(img(2, shape=(100, 100))))
    assert issubclass(FrameTooLarge, ValueError)
    assert reader.written == 1
    s = reader.stats()
    assert s["too_large"] == 2 and s["written"] == 1 and s["pending"] == 0
    assert reader.read_latest() is None


@pytest.mark.parametrize("bad", [
    np.zeros((4, 6, 3), dtype=np.float32),
    np.zeros((4, 6, 3), dtype=np.uint16),
    np.zeros((4, 6, 3), dtype=np.int8),
    np.zeros(24, dtype=np.uint8),  # 1-D
    np.zeros((2, 2, 2, 3), dtype=np.uint8),  # 4-D
], ids=["float32", "uint16", "int8", "1d", "4d"])
def test_wrong_dtype_or_rank_raises_value_error_and_publishes_nothing(buffers, bad):
    reader, writer = buffers(slot_bytes=1024)
    with pytest.raises(ValueError) as info:
        writer.write(frame(bad))
    assert not isinstance(info.value, FrameTooLarge)
    assert reader.written == 0 and reader.read_latest() is None
    assert reader.stats()["too_large"] == 0


def test_a_lock_renewed_while_held_is_released_as_taken(buffers):
    """The supervisor may renew a buffer's lock while the reader or writer holds the old one: each release goes
    to the lock that was taken (releasing the new, untaken one raised ValueError), and the next swap uses the new."""
    old, new = CTX.Lock(), CTX.Lock()
    reader, writer = buffers(slot_bytes=256, lock=old)

    class RenewedWhileHeld:  # the old lock, but taking it makes both sides switch to the new one
        def acquire(self, block=True, timeout=None):
            ok = old.acquire(block, timeout)
            reader.renew_lock(new)
            writer.renew_lock(new)
            return ok

        def release(self):
            old.release()

    writer.renew_lock(RenewedWhileHeld())
    assert writer.write(frame(img(5), stamp_ns=5)) == 1
    assert writer.spec()[1] is new
    assert old.acquire(timeout=0.1) and new.acquire(timeout=0.1)  # both free: the old one was released as taken
    old.release()
    new.release()
    reader.renew_lock(RenewedWhileHeld())
    seq, f = reader.read_latest_with_seq()
    assert seq == 1 and (f.image == 5).all()
    assert old.acquire(timeout=0.1) and new.acquire(timeout=0.1)
    old.release()
    new.release()


# ---- 5: a lock held elsewhere -------------------------------------------------------------------------------------------
def test_lock_held_elsewhere_times_out_then_renewed_lock_recovers(buffers):
    stuck = CTX.Lock()
    reader, writer = buffers(slot_bytes=256, lock=stuck, reader_kw={"lock_timeout_s": 0.02},
                             writer_kw={"lock_timeout_s": 0.02})
    assert writer.write(frame(img(1), stamp_ns=1)) == 1
    assert stuck.acquire(timeout=1.0)  # as if a writer died holding it: never released
    t0 = time.monotonic()
    assert reader.read_latest_with_seq() is None
    assert time.monotonic() - t0 >= 0.015
    assert reader.stats()["lock_timeouts"] == 1
    assert reader.stats()["pending"] == 1  # the unread frame was not consumed by the failed read
    assert writer.write(frame(img(2), stamp_ns=2)) == 0  # dropped, not published
    assert writer.stats()["lock_timeouts"] == 1
    assert reader.written == 1
    assert reader.read_latest() is None
    assert reader.stats()["lock_timeouts"] == 2

    fresh = CTX.Lock()
    reader.renew_lock(fresh)
    writer.renew_lock(fresh)
    reader.clear_reading()
    assert reader.spec()[1] is fresh
    seq, f = reader.read_latest_with_seq()
    assert seq == 1 and f.stamp_ns == 1 and (f.image == 1).all()
    assert writer.write(frame(img(3), stamp_ns=3)) == 2
    seq, f = reader.read_latest_with_seq()
    assert seq == 2 and f.stamp_ns == 3
    s = reader.stats()
    assert s["written"] == 2 and s["read"] == 2 and s["overwritten"] == 0 and s["lock_timeouts"] == 2
    stuck.release()


class _LockFailingAfter:
    """A lock whose acquires succeed ``ok`` times, then time out (a lock taken by a process that then died)."""

    def __init__(self, inner, ok):
        self.inner, self.ok = inner, ok

    def acquire(self, block=True, timeout=None):
        if self.ok <= 0:
            return False
        self.ok -= 1
        return self.inner.acquire(block, timeout)

    def release(self):
        self.inner.release()


def test_read_interrupted_by_a_lost_lock_keeps_its_slot_until_clear_reading(buffers):
    reader, writer = buffers(slot_bytes=256)
    writer.write(frame(img(1), stamp_ns=1))
    slot = slot_of_latest(reader)
    reader.renew_lock(_LockFailingAfter(CTX.Lock(), ok=1))  # takes the slot, cannot give it back
    seq, f = reader.read_latest_with_seq()
    assert seq == 1 and (f.image == 1).all()  # the copy itself is complete
    assert int(reader._hdr[_READING]) == slot and reader.stats()["lock_timeouts"] == 1
    before = slot_bytes_copy(reader, slot)
    for i in range(2, 8):  # the writer still has a free slot, and never the marked one
        assert writer.write(frame(img(i), stamp_ns=i)) == i
    assert np.array_equal(slot_bytes_copy(reader, slot), before)
    fresh = CTX.Lock()
    reader.renew_lock(fresh)
    writer.renew_lock(fresh)
    reader.clear_reading()
    assert int(reader._hdr[_READING]) == -1
    assert reader.read_latest().stamp_ns == 7
    slots = set()
    for i in range(8, 8 + 2 * SLOTS):
        writer.write(frame(img(i), stamp_ns=i))
        slots.add(slot_of_latest(reader))
    assert slot in slots  # the freed slot is filled again
    assert reader.read_latest().stamp_ns == 7 + 2 * SLOTS


# ---- 6: frame ids across a writer restart --------------------------------------------------------------------------
def test_frame_ids_continue_across_a_writer_restart(buffers):
    reader, writer_a = buffers(slot_bytes=256)
    assert [writer_a.write(frame(img(i), stamp_ns=i)) for i in range(1, 4)] == [1, 2, 3]
    assert reader.read_latest().frame_id == 3
    writer_a.close()
    writer_b = SharedFrameBuffer.attach(*reader.spec())
    try:
        assert writer_b.write(frame(img(4), stamp_ns=4)) == 4
        seq, f = reader.read_latest_with_seq()
        assert seq == f.frame_id == 4 and (f.image == 4).all()
        assert writer_b.written == 4
    finally:
        writer_b.close()
    assert os.path.exists(reader.path)  # a writer (not the owner) closing leaves the file


# ---- 7: real processes ----------------------------------------------------------------------------------------------
PROC_SHAPE = (96, 128, 3)


def _spawned_writer(path, lock, n, start, exit_codes):
    """The camera process: frame i has every pixel == i % 256, stamp_ns == i, header_frame_id == f"f{i}"."""
    buf = SharedFrameBuffer.attach(path, lock, lock_timeout_s=2.0)
    bad = 0
    try:
        start.wait(30)
        for i in range(1, n + 1):
            seq = buf.write(SimpleNamespace(image=np.full(PROC_SHAPE, i % 256, dtype=np.uint8), stamp_ns=i,
                                            received_ns=10 * i, header_frame_id=f"f{i}"))
            bad += seq != i
            if i % 50 == 0:
                time.sleep(0.0002)  # let the reader in at varying points
    finally:
        buf.close()
    exit_codes.put(bad)


def test_spawned_writer_process_frames_are_never_torn(buffers):
    n = 4000
    reader, writer = buffers(slot_bytes=int(np.prod(PROC_SHAPE)), reader_kw={"lock_timeout_s": 2.0})
    writer.close()  # the writer lives in the child
    start, results = CTX.Event(), CTX.Queue()
    proc = CTX.Process(target=_spawned_writer, args=(*reader.spec(), n, start, results), daemon=True)
    proc.start()
    seen, torn = [], []
    try:
        start.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = reader.read_latest_with_seq()
            if got is None:
                if reader.written >= n or not proc.is_alive():
                    got = reader.read_latest_with_seq()  # the last frame, written after the peek
                    if got is None:
                        break
                else:
                    continue
            seq, f = got
            i = f.stamp_ns
            if not ((f.image == i % 256).all() and f.received_ns == 10 * i and f.header_frame_id == f"f{i}"
                    and seq == i == f.frame_id and f.image.shape == PROC_SHAPE):
                torn.append((seq, i, np.unique(f.image).tolist(), f.header_frame_id))
            seen.append(seq)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert proc.exitcode == 0
    assert results.get(timeout=5) == 0, "the writer got a dropped write or an unexpected seq"
    assert not torn, f"torn frames: {torn[:5]}"
    assert len(seen) > 1, "the reader never read concurrently"
    assert all(a < b for a, b in zip(seen, seen[1:])), "seqs must strictly increase"
    assert seen[-1] == n, "the newest frame must end up read"
    s = reader.stats()
    assert s["written"] == n and s["read"] == len(seen) and s["pending"] == 0
    assert s["read"] + s["overwritten"] == n
    assert s["overwritten"] == n - len(seen)


# ---- 8: lifecycle ---------------------------------------------------------------------------------------------------
def _shm_files(prefix):
    return [f for f in os.listdir(_shm_dir()) if f.startswith(prefix)]


@pytest.mark.parametrize("slot_bytes", [0, -1, -4096])
def test_create_fails_cleanly_for_non_positive_slot_bytes(slot_bytes):
    prefix = f"vla_frames_test_{os.getpid()}_"
    with pytest.raises((OSError, ValueError)):
        SharedFrameBuffer.create(slot_bytes, CTX.Lock(), prefix=prefix)
    assert _shm_files(prefix) == []


def test_owner_close_removes_the_file_and_a_second_close_is_harmless():
    buf = SharedFrameBuffer.create(128, CTX.Lock())
    other = SharedFrameBuffer.attach(*buf.spec())
    path = buf.path
    assert os.path.exists(path)
    assert os.path.getsize(path) >= SLOTS * 128
    other.close()
    other.close()
    assert os.path.exists(path)  # the attached side does not own the file
    buf.close()
    assert not os.path.exists(path)
    buf.close()  # no FileNotFoundError, no error from the closed map
    assert not os.path.exists(path)


def test_close_after_reads_succeeds_while_frames_are_still_referenced():
    buf = SharedFrameBuffer.create(128, CTX.Lock())
    writer = SharedFrameBuffer.attach(*buf.spec())
    writer.write(frame(img(5, shape=(4, 4)), stamp_ns=5))
    f = buf.read_latest()
    writer.close()
    buf.close()
    assert buf._mm.closed and writer._mm.closed
    assert (f.image == 5).all()  # the frame survives the buffer
    assert not os.path.exists(buf.path)


@pytest.mark.parametrize("content", [
    pytest.param(b"\0" * 8192, id="zeros"),
    pytest.param(b"hello, not a frame buffer" * 400, id="text"),
    pytest.param(b"x" * 10, id="tiny"),
])
def test_attaching_to_a_non_buffer_file_raises_value_error(tmp_path, content):
    path = tmp_path / "not_frames"
    path.write_bytes(content)
    with pytest.raises(ValueError):
        SharedFrameBuffer.attach(str(path), CTX.Lock())
    assert path.read_bytes() == content  # attaching never writes


def test_attaching_to_an_empty_file_raises_value_error(tmp_path):
    path = tmp_path / "empty"
    path.write_bytes(b"")
    with pytest.raises(ValueError):
        SharedFrameBuffer.attach(str(path), CTX.Lock())


def test_a_full_shm_fails_at_create_with_the_reason_and_leaves_no_file(monkeypatch):
    """posix_fallocate at creation: a /dev/shm too small for the slots fails then, with what to do, instead of a
    SIGBUS in the writer at its first large frame."""
    import errno
    import os

    from vla_edge_ros.core import shared_frames

    def frame_files() -> set:
        return {f for f in os.listdir(shared_frames._shm_dir()) if f.startswith("vla_frames_")}

    before = frame_files()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_frames.os, "posix_fallocate", full)
    with pytest.raises(OSError, match="cannot allocate .* MiB for a shared frame buffer") as info:
        SharedFrameBuffer.create(640 * 480 * 3, CTX.Lock())
    assert info.value.errno == errno.ENOSPC
    assert frame_files() - before == set()
