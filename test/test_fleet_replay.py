"""The fleet replay (issue 24, bench/fleet_replay.py): its pure parts without ROS, then one short real run.

Pure: the options and their checks, the command lines (robots namespaced as test_fleet_ros.py runs them, each
replay's camera remapped onto the topic the edge subscribes for that robot), and the figures, table and verdict
from given stats dicts (window = end - start; one robot over 0.1 % misses, or without fresh actions, fails the
verdict). Real: one edge (numpy, the tiny default model, test_fleet_ros.py's 128 KV tokens and 100 ms deadline),
2 robot processes and 2 replays for 8 s; per-robot figures must come back and every robot must get fresh
actions. The miss rate is not asserted there: on 2 shared cores it is a figure of the host, not of the code.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from vla_edge_ros.bench import fleet_replay as fr
from vla_edge_ros.bench import host_load


# ---- options and command lines --------------------------------------------------------------------------------

def test_defaults_and_bad_options():
    a = fr.parse_args([])
    assert (a.robots, a.duration, a.camera_hz, a.backend, a.bag) == (8, 120.0, 60.0, "auto", None)
    assert (a.stats_every_s, a.edge_stats_every_s) == (0.5, 2.0)  # the edge's stats cost its passes the GIL
    assert a.settle_s == 0.0  # the window opens as soon as every robot's frames reach the edge
    assert fr.namespaces(3) == ["r1", "r2", "r3"]
    for bad in (["--robots", "0"], ["--duration", "0"], ["--camera-hz", "-1"], ["--param", "fleet_max_batch"],
                ["--backend", "tpu"], ["--domain-id", "300"], ["--param", "cost_quantil:=0.95"],
                ["--synthetic-size", "640"], ["--synthetic-size", "4x4"], ["--synthetic-size", "480x640", "--bag", "b"],
                ["--image-transport", "theora"], ["--edge-stats-every-s", "0"], ["--stats-every-s", "-1"],
                ["--settle-s", "-1"], ["--settle-s", "nan"]):
        with pytest.raises(SystemExit) as e:
            fr.parse_args(bad)
        assert e.value.code == 2, bad


def test_edge_values_are_typed_and_checked():
    a = fr.parse_args(["--robots", "2", "--backend", "numpy", "--deadline-ms", "100", "--kv-budget-tokens", "128"])
    v = fr.edge_values(a, fr.namespaces(2))
    assert v == {"robot_namespaces": "r1,r2", "backend": "numpy", "kv_budget_tokens": 128, "deadline_ms": 100.0}
    assert fr.check_values(v, "pick up the object") == []
    cmd = fr.edge_cmd(v, Path("p.yaml"), Path("edge.json"), 60, 0.5, ["fleet_max_batch:=4"])
    assert cmd[cmd.index("--role") + 1] == "edge" and "--params-file" in cmd
    ps = [cmd[i + 1] for i, x in enumerate(cmd) if x == "-p"]
    assert ps == ["robot_namespaces:=r1,r2", "backend:=numpy", "kv_budget_tokens:=128", "deadline_ms:=100.0",
                  "fleet_max_batch:=4"]  # 100.0, not 100: -p 100 would be an integer for a double parameter
    assert fr.check_values({**v, "kv_budget_tokens": 40}, "pick up the object")  # not even prefix + one frame


def test_robot_and_replay_commands_are_namespaced():
    cmd = fr.robot_cmd("r2", Path("r2.json"), 60, 0.5)
    assert cmd[cmd.index("--role") + 1] == "robot"
    assert cmd[cmd.index("--fresh-action-topic") + 1] == "/r2/vla/action_fresh"
    ros = cmd[cmd.index("--ros-args") + 1:]
    assert ros[:2] == ["-r", "__ns:=/r2"] and "action_topic:=/r2/vla/action" in ros
    assert "action_status_topic:=/r2/vla/action_status" in ros

    topics = [("/vla/episode_events", "std_msgs/msg/String"),
              ("/camera/image_raw/compressed", "sensor_msgs/msg/CompressedImage"),
              ("/vla/instruction", "std_msgs/msg/String")]
    camera, published = fr.replay_topics(topics, "/camera/image_raw")
    assert camera == "/camera/image_raw"
    assert published == ["/camera/image_raw", "/vla/episode_events", "/vla/instruction"]
    assert fr.replay_topics([("/cam0/rgb", "sensor_msgs/msg/Image")], "/camera/image_raw")[0] == "/cam0/rgb"
    with pytest.raises(ValueError, match="no image topic"):
        fr.replay_topics([("/vla/instruction", "std_msgs/msg/String")], "/camera/image_raw")
    cmd = fr.replay_cmd(Path("bag"), "r2", "/cam0/rgb", ["/cam0/rgb", "/vla/instruction"], "/camera/image_raw",
                        60.0, 100, Path("s.json"), 30)
    assert cmd[cmd.index("--camera-hz") + 1] == "60" and "--decode" in cmd and "--loop" in cmd
    assert cmd[cmd.index("--wait-for") + 1] == "/cam0/rgb"  # the replay's own (unremapped) name
    remaps = [cmd[i + 1] for i, x in enumerate(cmd) if x == "-r"]
    assert remaps == ["/cam0/rgb:=/r2/camera/image_raw", "/vla/instruction:=/r2/vla/instruction"]
    a = fr.parse_args(["--param", "cost_quantile:=0.95", "--synthetic-size", "480x640"])
    assert a.param == ["cost_quantile:=0.95"] and a.synthetic_size == "480x640" and a.image_transport == "raw"

    # compressed: the bag's JPEGs published as they are, onto <camera_topic>/compressed under the robot's namespace
    camera, published = fr.replay_topics(topics, "/camera/image_raw", decode=False)
    assert camera == "/camera/image_raw/compressed"
    assert published == ["/camera/image_raw/compressed", "/vla/episode_events", "/vla/instruction"]
    with pytest.raises(ValueError, match="no compressed image topic"):
        fr.replay_topics([("/cam0/rgb", "sensor_msgs/msg/Image")], "/camera/image_raw", decode=False)
    cmd = fr.replay_cmd(Path("bag"), "r2", camera, published, "/camera/image_raw", 60.0, 100, Path("s.json"), 30,
                        decode=False)
    assert "--decode" not in cmd and cmd[cmd.index("--wait-for") + 1] == "/camera/image_raw/compressed"
    assert [cmd[i + 1] for i, x in enumerate(cmd) if x == "-r"][0] == \
        "/camera/image_raw/compressed:=/r2/camera/image_raw/compressed"


# ---- figures, table, verdict ------------------------------------------------------------------------------------

def edge_stats(per_robot: dict, backend="numpy", memory=True, batch_sizes=None) -> dict:
    """The fleet edge's --stats-out shape (ros/runtime.py Runtime.stats, ros/fleet_node.py snapshot) for
    ``per_robot``: ns -> (admitted, misses, refused_capacity, frames received)."""
    robots, inner = {}, {}
    for ns, (adm, miss, cap, frames) in per_robot.items():
        robots[ns] = {"fresh_actions": adm - miss, "admitted": adm, "refused_deadline": 0, "refused_capacity": cap,
                      "deadline_misses": miss, "frames_received": frames}
        inner[ns] = {"loop": {"admitted": adm, "deadline_misses": miss, "refused_deadline": 0,
                              "refused_capacity": cap, "late_discarded": 0, "errors": 0,
                              "latency_ms": {"p50": 20.0, "p99": 30.0}},
                     "kv": {"max_occupancy_tokens": 109}}
    mem = {"current_bytes": 3 << 20, "peak_bytes": 4 << 20, "weight_bytes": 2 << 20, "kv_bytes": 1 << 20,
           "per_robot_kv_bytes": {ns: 1 << 19 for ns in per_robot}} if memory else {"peak_bytes": 4 << 20}
    return {"backend": backend, "robots": robots, "kv": {"budget_tokens": 128},
            "memory": {"peak_rss_mb": 150.0, "peak_vram_mb": 0.0},
            "inference": {"robots": inner, "engine_memory": mem, "deadline_ms": 100.0,
                          "loop": {"batch_sizes": batch_sizes or {"1": 3, "2": 500},
                                   "pass_ms": {"p50": 20.0, "p99": 30.0,
                                                                                  "max": 40.0},
                                   "cycle_overruns": 0, "batch_failures": 0}}}


def robot_stats(fresh, repeat=0, hold=0, missed=0) -> dict:
    return {"ticks": {"fresh": fresh, "repeat": repeat, "hold": hold}, "action": {"missed_ticks": missed}}


def test_window_figures_table_and_a_met_verdict():
    ns = ["r1", "r2"]
    start = edge_stats({"r1": (10, 1, 0, 20), "r2": (10, 0, 0, 20)}, batch_sizes={"1": 3, "2": 5})
    end = edge_stats({"r1": (1010, 2, 5, 2020), "r2": (1010, 0, 0, 2020)}, batch_sizes={"1": 3, "2": 505})
    r = fr.summarise(ns, start, end, {"r1": robot_stats(0, 0, 300, missed=2), "r2": robot_stats(0, 0, 300)},
                     {"r1": robot_stats(900, 100, 300, missed=3), "r2": robot_stats(1000, 0, 300)},
                     {"r1": {"camera_ticks": 2100}, "r2": {"camera_ticks": 2050}}, {"r1": 1 << 20})
    r1, r2 = r["robots"]["r1"], r["robots"]["r2"]
    assert (r1["admitted"], r1["deadline_misses"], r1["refused"], r1["frames_received"]) == (1000, 1, 5, 2000)
    assert r1["miss_rate"] == pytest.approx(0.001)  # exactly the limit: met
    assert r1["ticks"] == {"fresh": 900, "repeat": 100, "hold": 0} and r1["fresh_share"] == pytest.approx(0.9)
    assert r1["kv_bytes"] == 1 << 20 and r2["kv_bytes"] == 1 << 19  # the sampled peak beats the final figure
    assert (r1["frames_published"], r1["frames_received_total"]) == (2100, 2020)
    # the window's missed ticks: r1's 2 before it opened are in its total only
    assert (r1["missed_ticks"], r1["missed_ticks_total"], r2["missed_ticks"]) == (1, 3, 0)
    assert r["edge"]["memory_kind"].startswith("host memory") and r["edge"]["missing"] == []
    assert r["verdict"] == {"met": True, "reasons": []}
    text = fr.table({**r, "meta": {"duration_s": 8.0, "camera_hz": 60.0, "bag_description": "synthetic"}})
    assert "| r1 | 2100 / 2020 | 1000 | 5 | 1 | 0.100% | 20.0 / 30.0 | 900 / 100 / 0 | 90.0% | 1.00 MiB |" in text
    assert "grid points skipped in the window (a tick with no message): r1 1, r2 0 (since start: 3, 0)" in text
    assert "VERDICT: MET" in text and "weights 2.00 MiB" in text and "{'2': 500}" in text  # the window's passes
    assert r1["latency_ms"]["whole_run"] and "it has no histograms" in text  # an edge without them: said so
    json.dumps(r)  # written as fleet_replay.json


def test_the_settle_periods_late_chunks_get_their_own_line_and_stay_out_of_the_verdict():
    ns = ["r1", "r2"]
    before = edge_stats({"r1": (2, 0, 0, 10), "r2": (2, 0, 0, 10)})
    at_window = edge_stats({"r1": (40, 3, 0, 300), "r2": (41, 0, 0, 300)})  # r1 missed 3 while settling
    end = edge_stats({"r1": (1040, 3, 0, 2300), "r2": (1041, 1, 0, 2300)})
    st = fr.settle_figures(ns, before, at_window, 10.0)
    assert st == {"s": 10.0, "robots": {"r1": {"admitted": 38, "deadline_misses": 3},
                                        "r2": {"admitted": 39, "deadline_misses": 0}},
                  "admitted": 77, "deadline_misses": 3}
    r = fr.summarise(ns, at_window, end, {n: robot_stats(0) for n in ns}, {n: robot_stats(900) for n in ns})
    assert (r["robots"]["r1"]["deadline_misses"], r["robots"]["r2"]["deadline_misses"]) == (0, 1)
    assert r["verdict"]["met"]
    text = fr.table({**r, "settle": st})
    assert ("- before the window, 10 s of settling (frames flowing, the replays' processes starting up; not in "
            "the table or the verdict): 3 of 77 chunks late; per robot r1 3 / 38, r2 0 / 39") in text
    assert "settling" not in fr.table({**r, "settle": None}) and "settling" not in fr.table(r)


def test_latency_pass_time_and_counters_cover_the_window_only():
    """The edge's chunks before the window (a slow start) must not reach the window's percentiles; counters
    come from the edge's stats as the window closed, not from its final stats after the stop; the edge's CPU
    time and the cost model's parts are reported."""
    from vla_edge_ros.core.metrics import CumulativeHistogram

    def hist(samples):
        h = CumulativeHistogram()
        for ms in samples:
            h.add(ms)
        return h

    slow_start, window = [300.0] * 40, [20.0] * 990 + [30.0] * 10
    start = edge_stats({"r1": (40, 40, 0, 100)})
    end = edge_stats({"r1": (1040, 41, 0, 2100)})
    final = edge_stats({"r1": (1100, 60, 0, 2300)})  # after the replays stopped: not the window
    lat_start, lat_end = hist(slow_start), hist(slow_start + window)
    for st, lat, wall, cpu in ((start, lat_start, 10.0, 1.0), (end, lat_end, 40.0, 10.0)):
        st["wall_s"] = wall
        st["inference"]["robots"]["r1"]["loop"]["latency_hist"] = lat.snapshot()
        loop = st["inference"]["loop"]
        loop.update(pass_hist=lat.snapshot(), host_hist=hist([2.0] * len(lat.snapshot())).snapshot(),
                    thread_cpu_s=cpu, scheduler={"fleet": {"decode_steps": 8}, "cost": {"by_batch_size": {"1": {
                        "prefill_ema_ms": 3.0, "decode_ema_ms_per_step": 2.0, "host_ema_ms": 4.0,
                        "spread_ms": 1.5, "samples": 900}}}})
    r = fr.summarise(["r1"], start, end, {"r1": robot_stats(0)}, {"r1": robot_stats(900, 100)}, edge_final=final,
                     edge_cpu={"cpu_s": 18.0, "window_s": 30.0})
    r1, e = r["robots"]["r1"], r["edge"]
    assert (r1["admitted"], r1["deadline_misses"]) == (1000, 1) and r1["frames_received_total"] == 2300
    assert r1["latency_ms"]["count"] == 1000 and not r1["latency_ms"]["whole_run"]
    assert 20.0 <= r1["latency_ms"]["p50"] < 20.5 and 30.0 <= r1["latency_ms"]["max"] < 30.7  # no 300 ms in it
    assert 20.0 <= e["pass_ms"]["p99"] < 20.5 and e["pass_ms"]["count"] == 1000
    assert e["cpu"]["cpu_s_per_s"] == pytest.approx(0.6) and e["cpu"]["loop_thread_cpu_s_per_s"] == pytest.approx(0.3)
    assert e["cost_model"]["1"]["estimate_ms"] == pytest.approx(3.0 + 16.0 + 4.0 + 1.5)
    text = fr.table(r)
    assert "| r1 | n/a / 2300 | 1000 | 0 | 1 | 0.100% | 20.0 / 20.0 |" in text and "no histograms" not in text
    assert "edge process CPU 0.600 s per s over the window (the fleet loop's thread 0.300" in text
    assert "prefill 3.0 + decode 2.00 per step + host 4.0 + spread 1.5 = estimate 24.5 ms (900 samples)" in text
    json.dumps(r)


def test_proc_cpu_reads_this_process_and_none_for_a_missing_one():
    import os
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    t0 = host_load.proc_cpu_s(os.getpid())
    sum(i * i for i in range(2_000_000))  # burn some CPU
    assert t0 is not None and host_load.proc_cpu_s(os.getpid()) > t0
    assert host_load.proc_cpu_s(2 ** 31 - 1) is None


def test_children_cpu_counts_a_busy_child_and_not_the_parent():
    """children_cpu_s: the fleet edge's camera process is a child of the edge; its CPU is reported apart."""
    import os
    import subprocess
    import sys
    import time

    if not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    base = host_load.children_cpu_s(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.4: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while host_load.children_cpu_s(os.getpid()) - base < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert host_load.children_cpu_s(os.getpid()) - base >= 0.3
        assert host_load.children_cpu_s(child.pid) == 0.0  # it has no children of its own
    finally:
        child.kill()
        child.wait()


def test_one_robot_over_the_miss_limit_or_without_fresh_actions_fails_the_verdict():
    ns = ["r1", "r2", "r3"]
    end = edge_stats({"r1": (1000, 0, 0, 2000), "r2": (1000, 2, 0, 2000), "r3": (1000, 0, 0, 2000)},
                     backend="cuda", memory=False)
    ticks = {"r1": robot_stats(900), "r2": robot_stats(900), "r3": robot_stats(0, 0, 900)}
    r = fr.summarise(ns, {}, end, {}, ticks)
    assert r["robots"]["r2"]["miss_rate"] == pytest.approx(0.002)
    assert not r["verdict"]["met"]
    assert r["verdict"]["reasons"] == ["r2: miss rate 0.20 % > 0.1 %", "r3: no fresh actions"]
    assert r["edge"]["memory_kind"] == "VRAM" and "per_robot_kv_bytes" in r["edge"]["missing"]
    text = fr.table(r)
    assert "VERDICT: NOT MET" in text and "r2: miss rate 0.20 %" in text and "| VRAM |" in text
    assert "not in the edge's engine memory figures: per_robot_kv_bytes, weight_bytes" in text
    none = fr.summarise(ns, {}, {}, {}, {})  # the edge wrote nothing: every robot fails, nothing raises
    assert not none["verdict"]["met"] and "r1: no chunk admitted" in none["verdict"]["reasons"]


# ---- one real run ---------------------------------------------------------------------------------------------

def test_real_fleet_replay_two_robots(tmp_path, ros_processes):
    pytest.importorskip("rclpy")
    out = tmp_path / "out"
    p = ros_processes.run("vla_edge_ros.bench.fleet_replay", "--robots", 2, "--duration", 8, "--backend", "numpy",
                          "--kv-budget-tokens", 128, "--deadline-ms", 100, "--domain-id", ros_processes.domain_id,
                          "--startup-timeout", 120, "--settle-s", 1, "--out", out, timeout_s=300)
    print(p.stdout[-4000:])
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    r = json.loads((out / "fleet_replay.json").read_text())
    assert r["meta"]["errors"] == [] and set(r["meta"]["exit_codes"].values()) == {0}, r["meta"]
    assert sorted(r["robots"]) == ["r1", "r2"]
    for ns, s in r["robots"].items():
        assert s["admitted"] > 0 and s["frames_received"] > 0 and s["frames_published"] > 0, (ns, s)
        assert s["ticks"]["fresh"] > 0 and s["fresh_share"] > 0, (ns, s)  # every robot got fresh actions
        assert s["miss_rate"] is not None and s["kv_bytes"] > 0, (ns, s)
    assert r["edge"]["backend"] == "numpy" and r["edge"]["weight_bytes"] > 0 and r["edge"]["batch_sizes"]
    assert "VERDICT:" in (out / "fleet_replay.md").read_text() and "| r2 |" in p.stdout
    assert r["settle"]["s"] == 1.0 and set(r["settle"]["robots"]) == {"r1", "r2"}, r["settle"]
    assert "s of settling" in p.stdout


def test_synthetic_clip_has_frames_of_the_size_asked(tmp_path):
    pytest.importorskip("rosbags")
    from rosbags.highlevel import AnyReader
    from rosbags.typesys import Stores, get_typestore

    from vla_edge_ros.ros.tools.bag_sources import decode_jpeg

    bag, desc = fr.synthetic_bag(tmp_path, "48x80")
    with AnyReader([bag], default_typestore=get_typestore(Stores.ROS2_JAZZY)) as reader:
        camera, _ = fr.replay_topics([(c.topic, c.msgtype) for c in reader.connections], "/camera/image_raw",
                                     decode=False)
        conn = next(c for c in reader.connections if c.topic == camera)
        _, _, raw = next(reader.messages(connections=[conn]))
        msg = reader.deserialize(raw, conn.msgtype)
    assert decode_jpeg(msg.data).shape == (48, 80, 3) and "80x48" in desc


def test_pass_profile_slowest_passes_of_the_window_only_are_reported():
    """The edge's per-pass stages (core/pass_profile.py): the slowest passes that began before the window (a slow
    start) are left out; the table names each stage and the slowest pass's split."""
    from vla_edge_ros.core.pass_profile import PassProfile

    class Clock:
        t = 0

        def __call__(self):
            return self.t

    wall, cpu = Clock(), Clock()
    prof = PassProfile(clock_ns=wall, cpu_ns=cpu, runq_ns=lambda: None)

    def one(host_ms, engine_ms):
        prof.begin(wall.t, wall.t)
        for stage, ms in (("plan", 0.2), ("encode", 1.0), ("engine", engine_ms), ("deliver", 0.3)):
            wall.t += int(ms * 1e6)
            cpu.t += int(0.1 * 1e6)
            prof.mark(stage)
        prof.end(1, host_ms, {"prefill_ms": 2.0, "decode_ms": 13.0, "launch_ms": 1.0, "sync_ms": engine_ms - 1})
        wall.t += int(10e6)

    one(90.0, 100.0)  # start-up: before the window
    start = edge_stats({"r1": (10, 0, 0, 20)})
    start["inference"]["loop"]["pass_profile"] = prof.snapshot()
    for k in range(20):
        one(4.0 + k, 16.0 + k)
    end = edge_stats({"r1": (30, 0, 0, 60)})
    end["inference"]["loop"]["pass_profile"] = prof.snapshot()
    r = fr.summarise(["r1"], start, end, {"r1": robot_stats(0)}, {"r1": robot_stats(20)})
    slowest = r["edge"]["pass_profile"]["slowest"]
    assert [s["host_ms"] for s in slowest[:2]] == [23.0, 22.0] and all(s["host_ms"] < 90 for s in slowest)
    text = fr.table(r)
    assert "- pass stages over 20 passes" in text and "sync" in text
    assert "host 23.0 ms at" in text and "engine 35.0/0.1" in text
    json.dumps(r)


def test_next_write_returns_the_content_of_the_next_rewrite_only(tmp_path):
    import json
    import threading
    import time

    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"n": 1}))

    def rewrite():
        time.sleep(0.3)
        tmp = tmp_path / "stats.json.tmp"
        tmp.write_text(json.dumps({"n": 2}))
        tmp.replace(path)

    th = threading.Thread(target=rewrite)
    t0 = time.monotonic()
    th.start()
    assert fr.next_write(path, 5.0) == {"n": 2}  # not the content already there
    assert time.monotonic() - t0 >= 0.25
    th.join()
    assert fr.next_write(path, 0.2) is None  # no write within the timeout
    assert fr.next_write(tmp_path / "absent.json", 0.1) is None
