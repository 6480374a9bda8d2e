"""bench/host_load: the machine's CPU over a window from two samples (synthetic counters; one live sample)."""
import json
import os

from vla_edge_ros.bench import host_load


def test_window_and_line_from_two_samples():
    a = {"cpus": 16, "jiffies": [1000, 4000], "loadavg_1m": 3.0,
         "cgroup": {"nr_periods": 100, "nr_throttled": 2, "throttled_ms": 50.0, "quota_cpus": 16.0},
         "process": {"voluntary_switches": 10, "involuntary_switches": 5, "runq_ms": 100.0}}
    b = {"cpus": 16, "jiffies": [1600, 5000], "loadavg_1m": 9.5,
         "cgroup": {"nr_periods": 1300, "nr_throttled": 62, "throttled_ms": 3050.0, "quota_cpus": 16.0},
         "process": {"voluntary_switches": 1210, "involuntary_switches": 605, "runq_ms": 1300.0}}
    w = host_load.window(a, b, 120.0)
    assert w["busy_share"] == 0.6 and w["cgroup"] == {"nr_periods": 1200, "nr_throttled": 60, "throttled_ms": 3000.0,
                                                      "quota_cpus": 16.0}
    assert w["process"]["runq_ms_per_s"] == 10.0 and w["process"]["involuntary_switches_per_s"] == 5.0
    line = host_load.describe(w, "edge process")
    assert "cores busy 60.0 % of 16" in line and "throttled in 60 of 1200 periods (3000 ms), quota 16 CPUs" in line
    assert "edge process: 10 voluntary / 5 involuntary switches per s" in line and "waited 10.0 ms per s" in line
    assert host_load.describe(None) == "- machine CPU: not measured"
    assert "no cgroup CPU counters" in host_load.describe(host_load.window({}, {"cpus": 2}, 1.0))


def test_cgroup_v1_and_v2_counters_are_read(tmp_path, monkeypatch):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.stat").write_text("usage_usec 5\nnr_periods 40\nnr_throttled 3\nthrottled_usec 1500\n")
    (v2 / "cpu.max").write_text("200000 100000\n")
    monkeypatch.setattr(host_load, "CGROUP_STATS", (str(tmp_path / "none" / "cpu.stat"), str(v2 / "cpu.stat")))
    assert host_load._cgroup() == {"nr_periods": 40, "nr_throttled": 3, "throttled_ms": 1.5, "quota_cpus": 2.0}
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cpu.stat").write_text("nr_periods 7\nnr_throttled 1\nthrottled_time 2000000\n")
    monkeypatch.setattr(host_load, "CGROUP_STATS", (str(v1 / "cpu.stat"),))
    assert host_load._cgroup() == {"nr_periods": 7, "nr_throttled": 1, "throttled_ms": 2.0}
    monkeypatch.setattr(host_load, "CGROUP_STATS", ())
    assert host_load._cgroup() is None


def test_a_live_sample_of_this_process():
    s = host_load.sample(os.getpid())
    json.dumps(s)
    assert s["cpus"] >= 1
    if s["process"] is not None:  # Linux
        assert s["process"]["voluntary_switches"] >= 0
        assert s["process"]["cpu_s"] > 0 and s["process"]["children_cpu_s"] >= 0  # the edge's CPU, one reading
        w = host_load.window(s, host_load.sample(os.getpid()), 1.0)
        assert w["process"]["cpu_s_per_s"] >= 0 and "children_cpu_s_per_s" in w["process"]
    assert host_load.sample(None)["process"] is None
