"""bench/gil_probe: options, the probe, the table; one short real run over DDS (both executor kinds take messages)."""
import subprocess
import sys

import numpy as np
import pytest

from vla_edge_ros.bench import gil_probe as gp
from vla_edge_ros.bench.procs import ros_child_env


def test_options_are_checked():
    a = gp.parse_args(["--executors", "single, events", "--size", "48x64"])
    assert a.kinds == ["single", "events"] and a.size_hw == (48, 64)
    for bad in (["--executors", "multi"], ["--executors", ""], ["--topics", "0"], ["--hz", "-1"]):
        with pytest.raises(SystemExit):
            gp.parse_args(bad)
    with pytest.raises(ValueError, match="HxW"):
        gp.parse_size("64")


def test_probe_measures_overshoots_of_its_sleep():
    over = gp.probe(0.2, 1.0)
    assert 20 < len(over) < 220 and np.all(over > -0.2)  # a sleep never ends much early
    text = gp.table([{"kind": "single", "messages_per_s": 480.0, "p50_ms": 0.1, "p99_ms": 2.5, "max_ms": 9.0,
                      "over_5ms": 3, "probes": 900, "cpu_per_s": 0.4}], gp.parse_args([]))
    assert "| single | 480 | 0.100 / 2.500 / 9.0 | 3 of 900 | 0.40 |" in text


def test_a_short_real_run_takes_messages_with_both_executors(ros_domain, tmp_path):
    pytest.importorskip("rclpy")
    env = ros_child_env(ros_domain, tmp_path / "ros_home", keep_operator_settings=False)
    out = subprocess.run([sys.executable, "-m", "vla_edge_ros.bench.gil_probe", "--topics", "2", "--hz", "30",
                          "--seconds", "2", "--executors", "none,single,events", "--domain-id", str(ros_domain)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"none", "single", "events"}
    taken = {k: float(rows[k].split("|")[2]) for k in ("none", "single", "events")}
    assert taken["none"] == 0 and taken["single"] > 0 and taken["events"] > 0, out.stdout  # 2 x 30 Hz offered
