"""bench/stack_summary.py on py-spy's raw format (lines as `py-spy record --threads --idle --native --format raw`
wrote them for a two-thread process): per-thread shares and the leaves that say where a thread waits."""
from __future__ import annotations

from vla_edge_ros.bench import stack_summary

BOOT = ("0x7f9e185278ec (libc.so.6);0x7f9e184a71f5 (libc.so.6);thread_run (libpython3.11.so.1.0);"
        "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982)")
RAW = [
    f"thread (4200): waiter;{BOOT};waiter (spyt.py:8);time_sleep (libpython3.11.so.1.0);clock_nanosleep (libc.so.6) 120",
    f"thread (4200): waiter;{BOOT};waiter (spyt.py:8);time_sleep (libpython3.11.so.1.0);"
    "pthread_cond_timedwait (libc.so.6);0x7f9e184a3f16 (libc.so.6) 80",
    f"thread (4199): busy;{BOOT};busy (spyt.py:6) 196",
    f"thread (4199): busy;{BOOT};busy (spyt.py:6);pthread_cond_signal (libc.so.6) 4",
    "0x7f9e184a3f16 (libc.so.6);epoll_wait (libc.so.6) 7",  # a native thread without a thread frame
    "",
    "not a stack line",
]


def test_samples_are_grouped_by_thread_name_under_their_innermost_python_and_named_native_frame():
    t = stack_summary.parse(RAW)
    assert set(t) == {"waiter", "busy", "(process)"}
    assert t["waiter"] == {"waiter (spyt.py:8) -> clock_nanosleep (libc.so.6)": 120,
                           "waiter (spyt.py:8) -> pthread_cond_timedwait (libc.so.6)": 80}  # the address skipped
    assert t["busy"] == {"busy (spyt.py:6)": 196, "busy (spyt.py:6) -> pthread_cond_signal (libc.so.6)": 4}
    assert t["(process)"] == {"(native only) epoll_wait (libc.so.6)": 7}


def test_the_report_gives_each_threads_share_and_its_leaves_by_frequency():
    text = stack_summary.report(stack_summary.parse(RAW), top=1)
    assert text.startswith("407 samples over 3 threads")
    assert "waiter: 200 samples (49.1 %)" in text and "busy: 200 samples (49.1 %)" in text
    assert "60.0 %  waiter (spyt.py:8) -> clock_nanosleep" in text
    assert "pthread_cond_timedwait" not in text  # top=1: only the most frequent leaf per thread
    assert stack_summary.report({}) == "no samples"


def test_the_command_refuses_a_missing_file(tmp_path, capsys):
    assert stack_summary.main([str(tmp_path / "absent.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    f = tmp_path / "raw.txt"
    f.write_text("\n".join(RAW))
    assert stack_summary.main([str(f), "--top", "2"]) == 0
    assert "busy: 200 samples" in capsys.readouterr().out
