"""DoubleBuffer: exactly-once freshest reads, exact overwrite counting, under real thread concurrency."""
import sys
import threading

import pytest

from vla_edge_ros.core.double_buffer import DoubleBuffer


def test_empty_buffer_reads_nothing():
    buf = DoubleBuffer()
    assert buf.read_latest() is None
    assert buf.wait_latest(0.0) is None
    assert buf.stats() == {"written": 0, "read": 0, "overwritten": 0, "pending": 0}


def test_freshest_item_is_read_exactly_once_and_gaps_are_counted():
    buf = DoubleBuffer()
    buf.write("a")
    assert buf.pending == 1
    assert buf.read_latest() == "a"
    assert buf.read_latest() is None  # exactly once
    for x in ("b", "c", "d"):
        buf.write(x)
    assert buf.overwritten == 2  # b and c can never be read any more
    assert buf.pending == 1
    assert buf.read_latest() == "d"
    assert buf.read_latest_with_seq() is None
    buf.write("e")
    assert buf.read_latest_with_seq() == (5, "e")
    assert buf.stats() == {"written": 5, "read": 3, "overwritten": 2, "pending": 0}
    assert buf.peek() == "e"  # peek does not consume...
    assert buf.read_latest() is None  # ...and does not resurrect a consumed item


def test_none_items_are_distinguishable_through_seq():
    buf = DoubleBuffer()
    buf.write(None)
    assert buf.read_latest_with_seq() == (1, None)


def test_wait_latest_times_out_then_wakes_on_write():
    buf = DoubleBuffer()
    assert buf.wait_latest(0.01) is None
    got = []
    reader = threading.Thread(target=lambda: got.append(buf.wait_latest(10.0)))
    reader.start()
    buf.write(42)  # the writer does not wait for the reader
    reader.join(10.0)
    assert not reader.is_alive()
    assert got == [42]
    assert buf.wait_latest(0.0) is None  # already consumed


def test_wait_latest_returns_an_item_written_before_the_call():
    buf = DoubleBuffer()
    buf.write(1)
    buf.wait_latest(0.0)
    buf.write(2)
    assert buf.wait_latest(None) == 2


@pytest.fixture
def fast_switching():
    """Force the interpreter to switch threads every microsecond so races are actually exercised."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("reader_waits", [True, False])
def test_concurrent_writer_and_slower_reader(fast_switching, reader_waits):
    n = 20000
    buf = DoubleBuffer()
    seen: list[int] = []
    torn: list[tuple] = []
    done = threading.Event()

    def writer():
        for i in range(1, n + 1):
            buf.write(i)  # item == its sequence number, so a torn (seq, item) pair is detectable
            if i % 64 == 0:
                threading.Event().wait(0.00005)  # let the reader in at varying points
        done.set()

    def reader():
        while True:
            if reader_waits:
                got = buf.wait_latest(0.01)
                if got is None:
                    if done.is_set() and buf.pending == 0:
                        return
                    continue
                seen.append(got)
            else:
                pair = buf.read_latest_with_seq()
                if pair is None:
                    if done.is_set() and buf.pending == 0:
                        return
                    continue
                if pair[0] != pair[1]:
                    torn.append(pair)
                seen.append(pair[1])
            # the reader is slower than the writer: some frames must be overwritten
            sum(range(200))

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not torn
    assert seen, "the reader read nothing"
    assert all(a < b for a, b in zip(seen, seen[1:])), "reader saw an older item after a newer one"
    assert seen[-1] == n, "the newest item must end up read"
    stats = buf.stats()
    assert stats["written"] == n and buf.written == n
    assert stats["read"] == len(seen)
    assert stats["pending"] == 0
    # every item was either read exactly once or counted as overwritten
    assert stats["read"] + stats["overwritten"] == n
    assert set(seen).isdisjoint(set(range(1, n + 1)) - set(seen))
    assert stats["overwritten"] == n - len(set(seen))
    assert stats["overwritten"] > 0, "the slower reader should have missed frames"


def test_counters_are_consistent_while_an_item_is_unread():
    buf = DoubleBuffer()
    for i in range(10):
        buf.write(i)
    s = buf.stats()
    assert s["written"] == s["read"] + s["overwritten"] + s["pending"] == 10
    assert s["pending"] == 1 and s["overwritten"] == 9
