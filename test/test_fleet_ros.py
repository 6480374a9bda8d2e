"""One edge serving a fleet over DDS (issue 24): an edge process with robot_namespaces r1,r2,r3 (numpy backend, the
tiny default model), three unchanged robot processes (--role robot, namespaced topics), three test cameras, and a
monitor node in this process recording every robot's action stream and /diagnostics.

r2's camera process is stopped (its stream stalls): r1 and r3 keep fresh actions flowing, r2's robot holds every
tick. Then r3's robot process is killed and restarted: r1 keeps fresh actions through it and r3 resumes. Every
robot's tick numbers stay contiguous (per robot process). The edge's camera process killed: restarted, every
robot ticks through it and fresh actions come back. Timing figures are bounded loosely (one 2-core host runs
all of it, see test_split.py), the functional ones strictly. Also: the fleet-only refusals (backend cuda, role all)
and the pure helpers (namespace parsing, the command-line values, per-robot diagnostics levels).
"""
from __future__ import annotations

import threading
import time

import pytest

from ros_env import read_json, rclpy_context, runs, runtime_cmd, wait_for

pytest.importorskip("rclpy")

ROBOTS = ("r1", "r2", "r3")
# 100 ms deadline: a batch of three chunks of the tiny model takes 25-100 ms on these 2 shared cores (33 ms is a
# GPU's budget); 128 KV tokens (the prefix and 3 frames) keep each pass short.
EDGE_PARAMS = ("-p", "robot_namespaces:=r1,r2,r3", "-p", "kv_budget_tokens:=128", "-p", "deadline_ms:=100.0")


def robot_cmd(ns: str, stats) -> list[str]:
    """The robot side exactly as docs/OPERATIONS.md "One edge, many robots" runs it."""
    return runtime_cmd("-r", f"__ns:=/{ns}", "-p", f"action_topic:=/{ns}/vla/action",
                       "-p", f"action_status_topic:=/{ns}/vla/action_status",
                       "-p", f"action_trajectory_topic:=/{ns}/vla/action_trajectory",
                       role="robot", stats_out=stats, backend=None,
                       cli=["--fresh-action-topic", f"/{ns}/vla/action_fresh"])


class FleetMonitor:
    """Every robot's action kinds and tick numbers (receive time, monotonic) and the latest per-robot statuses
    of /diagnostics, recorded by one node of this process."""

    def __init__(self, ctx, robots=ROBOTS) -> None:
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
        from rclpy.executors import SingleThreadedExecutor
        from sensor_msgs.msg import JointState

        from vla_edge_ros.ros import conversions, qos

        self.node = rclpy.create_node("fleet_test_monitor", context=ctx)
        self.actions: dict[str, list] = {ns: [] for ns in robots}  # (t, kind)
        self.ticks: dict[str, list] = {ns: [] for ns in robots}  # (t, tick, kind)
        self.diag: dict[str, tuple] = {}  # status name -> (t, level, message)
        self.diag_log: list[tuple] = []  # every per-robot status: (t, name, level, message, values)
        for ns in robots:
            self.node.create_subscription(JointState, f"/{ns}/vla/action",
                                          lambda m, ns=ns: self.actions[ns].append((time.monotonic(),
                                                                                    m.header.frame_id)),
                                          qos.reliable_qos(100))
            self.node.create_subscription(DiagnosticStatus, f"/{ns}/vla/action_status",
                                          lambda m, ns=ns: self._on_status(ns, conversions.status_to_dict(m)),
                                          qos.reliable_qos(100))
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, qos.reliable_qos(20))
        self.executor = SingleThreadedExecutor(context=ctx)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def _on_status(self, ns: str, v: dict) -> None:
        self.ticks[ns].append((time.monotonic(), int(v.get("tick", -1)), v.get("kind")))

    def _on_diagnostics(self, msg) -> None:
        for st in msg.status:
            if "[" in st.name:  # the fleet's per-robot statuses
                level = st.level if isinstance(st.level, int) else int.from_bytes(st.level, "little")
                self.diag[st.name] = (time.monotonic(), level, st.message)
                self.diag_log.append((time.monotonic(), st.name, level, st.message,
                                      {kv.key: kv.value for kv in st.values}))

    def fresh(self, ns: str, t0: float, t1: float = float("inf")) -> int:
        return sum(1 for t, kind in list(self.actions[ns]) if t0 < t < t1 and kind == "fresh")

    def kinds(self, ns: str, t0: float, t1: float = float("inf")) -> list[str]:
        return [kind for t, kind in list(self.actions[ns]) if t0 < t < t1]

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=2.0)
        self.node.destroy_node()


def tick_segments(ticks: list[tuple]) -> list[list[int]]:
    """The tick numbers split where they restart (a new robot process counts from 1 again)."""
    segments: list[list[int]] = []
    for _, tick, _ in ticks:
        if not segments or tick <= segments[-1][-1]:
            segments.append([])
        segments[-1].append(tick)
    return segments


def test_fleet_edge_serves_three_robots_through_a_stall_and_a_robot_restart(tmp_path, ros_processes):
    procs = ros_processes
    edge_stats = tmp_path / "edge.json"
    stats = {ns: tmp_path / f"robot_{ns}.json" for ns in ROBOTS}
    with rclpy_context(procs.domain_id, procs.home) as ctx:
        mon = FleetMonitor(ctx)
        try:
            robots = {ns: procs.start_cmd(robot_cmd(ns, stats[ns]), name=f"robot_{ns}") for ns in ROBOTS}
            cameras = {ns: procs.camera("-r", f"__ns:=/{ns}", "-p", f"topic:=/{ns}/camera/image_raw",
                                        "-p", "width:=160", "-p", "height:=120", "-p", "rate_hz:=15.0",
                                        name=f"camera_{ns}") for ns in ROBOTS}
            # the edge at the lowest priority: its start-up must not take the robots' CPU (test_split.py)
            edge = procs.start_cmd(["nice", "-n", "19"] + runtime_cmd(*EDGE_PARAMS, role="edge",
                                                                      stats_out=edge_stats), name="edge")
            assert wait_for(lambda: all(mon.fresh(ns, 0.0) > 20 for ns in ROBOTS) or not edge.alive(), 120.0), \
                ({ns: mon.fresh(ns, 0.0) for ns in ROBOTS}, edge.output()[-3000:])
            assert edge.alive(), edge.output()[-3000:]

            # 1. r2's camera stalls (its process stopped)
            assert procs.stop(cameras["r2"]) == {"camera_r2": 0}
            t_stall = time.monotonic()
            time.sleep(3.5)
            diag_in_stall = dict(mon.diag)

            # 2. r3's robot process is killed (no goodbye) and restarted
            t_kill = time.monotonic()
            robots["r3"].kill()
            time.sleep(2.0)
            t_restart = time.monotonic()
            r3b = procs.start_cmd(robot_cmd("r3", tmp_path / "robot_r3b.json"), name="robot_r3b")
            assert wait_for(lambda: mon.fresh("r3", t_restart) > 20, 60.0), (r3b.output()[-2000:],
                                                                             edge.output()[-2000:])
            time.sleep(0.5)
            t_end = time.monotonic()
            assert all(p.alive() for p in (edge, robots["r1"], robots["r2"], r3b, cameras["r1"], cameras["r3"]))
            codes = procs.stop(edge, cameras["r1"], cameras["r3"], robots["r1"], robots["r2"], r3b)
            assert set(codes.values()) == {0}, (codes, edge.output()[-3000:])
        finally:
            mon.close()

    # every tick of every robot process reached the monitor, in order (r3: two processes)
    segments = {ns: tick_segments(mon.ticks[ns]) for ns in ROBOTS}
    for ns in ROBOTS:
        assert len(segments[ns]) == (2 if ns == "r3" else 1), (ns, [(s[0], s[-1]) for s in segments[ns]])
        for seg in segments[ns]:
            assert seg == list(range(seg[0], seg[0] + len(seg))), (ns, seg)
    for ns, path in (("r1", stats["r1"]), ("r2", stats["r2"]), ("r3", tmp_path / "robot_r3b.json")):
        a = read_json(path)["action"]
        n_ticks = sum(a["ticks"].values())
        # the robots' timer punctuality is a timing figure of this shared host: bounded by a fraction (as in
        # test_split.py), never zero-tolerance; the restarted r3 lives 3-5 s, its start-up on a host busy with
        # the others included (runs: 10 missed of 151; CI, stop 29: 17 of 161; session 24, 1 run in 5 with and
        # without that session's change: 19 of 96, 27 of 86), hence its own bound of 15 % with a floor of 45
        # ticks (its first 1.5 s: 27 sat near the former 30); the long-lived r1 and r2 keep 5 %, with a floor of 42
        # ticks: 0.4 s of their own plus the 30 of r3b's start-up, which they live through on the same 2 cores (CI,
        # stop 38: r2 missed 25 of 491 against the former floor of 12, i.e. 5.1 %)
        share, floor = (0.15, 45) if ns == "r3" else (0.05, 42)
        assert a["missed_ticks"] <= max(floor, share * n_ticks), (ns, a["missed_ticks"], n_ticks)
        assert a["publish_errors"] == 0 and a["fresh_msgs_rejected"] == 0, (ns, a)

    # r2: fresh before its camera stalled; after it (stale_after_ms 200 + a chunk in flight, 1 s of slack) it
    # holds on every tick, and gets no other robot's actions
    assert mon.fresh("r2", 0.0, t_stall) > 20
    held = mon.kinds("r2", t_stall + 1.0, t_end)
    assert len(held) >= 0.5 * 30 * (t_end - t_stall - 1.0), len(held)
    assert set(held) == {"hold"}, runs(held)
    # r1 keeps fresh actions flowing through r2's stall, r3's outage and r3's return; r3 through r2's stall
    for t0, t1 in ((t_stall, t_kill), (t_kill, t_restart), (t_restart, t_end)):
        assert mon.fresh("r1", t0, t1) >= 5, (t0 - t_stall, t1 - t_stall, runs(mon.kinds("r1", t0, t1)))
    assert mon.fresh("r3", t_stall, t_kill) >= 5, runs(mon.kinds("r3", t_stall, t_kill))
    assert mon.fresh("r3", t_restart) > 20

    # /diagnostics: one status per robot and its camera; r2's says why it holds
    for ns in ROBOTS:
        assert f"vla_inference: robot [{ns}]" in diag_in_stall and f"vla_camera: ingest [{ns}]" in diag_in_stall
    _, level, message = diag_in_stall["vla_inference: robot [r2]"]
    assert level == 1 and "camera" in message, (level, message)

    # the edge's figures: every robot served by one engine, chunks of several robots in one pass
    s = read_json(edge_stats)
    loop = s["inference"]["loop"]
    assert sorted(loop["robots"]) == list(ROBOTS) and loop["robot_add_failures"] == 0
    assert any(int(size) >= 2 for size in loop["batch_sizes"]), loop["batch_sizes"]
    for ns in ROBOTS:
        assert s["robots"][ns]["admitted"] > 0 and s["robots"][ns]["fresh_actions"] > 20, s["robots"][ns]
    assert loop["totals"]["errors"] == 0 and loop["batch_failures"] == 0, (loop["totals"], loop["last_error"])
    print(f"fleet test: batch sizes {loop['batch_sizes']}, pass ms {loop['pass_ms']}, per robot "
          f"{ {ns: s['robots'][ns] for ns in ROBOTS} }")


def camera_child_of(pid: int) -> int:
    """The pid of the fleet edge's camera process: its child started by multiprocessing's spawn (the other child,
    the resource tracker, runs ``resource_tracker``)."""
    import os
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ")
        except OSError:
            continue
        if int(stat[1]) == pid and b"spawn_main" in cmdline:
            return int(entry)
    return 0


def test_the_edges_camera_process_killed_is_an_error_then_restarted_and_every_robot_ticks_through_it(
        tmp_path, ros_processes):
    """The fleet edge's cameras run in a child process (ros/fleet_cameras.py). Killing that child (SIGKILL, the
    worst case) leaves the edge serving: every robot's action stream goes on tick by tick (it holds while no frame
    comes), /diagnostics shows the camera process restarted (a new pid, ``camera_process_restarts`` 1; the ERROR
    while it is down: test_fleet_cameras.py) and fresh actions come back for every robot."""
    import os
    import signal

    robots2 = ("r1", "r2")
    procs = ros_processes
    stats = {ns: tmp_path / f"robot_{ns}.json" for ns in robots2}
    with rclpy_context(procs.domain_id, procs.home) as ctx:
        mon = FleetMonitor(ctx, robots2)
        try:
            robots = {ns: procs.start_cmd(robot_cmd(ns, stats[ns]), name=f"robot_{ns}") for ns in robots2}
            cameras = {ns: procs.camera("-r", f"__ns:=/{ns}", "-p", f"topic:=/{ns}/camera/image_raw",
                                        "-p", "width:=160", "-p", "height:=120", "-p", "rate_hz:=15.0",
                                        name=f"camera_{ns}") for ns in robots2}
            edge = procs.start_cmd(["nice", "-n", "19"] + runtime_cmd(
                "-p", "robot_namespaces:=r1,r2", "-p", "kv_budget_tokens:=128", "-p", "deadline_ms:=100.0",
                role="edge", stats_out=tmp_path / "edge.json"), name="edge")
            assert wait_for(lambda: all(mon.fresh(ns, 0.0) > 20 for ns in robots2) or not edge.alive(), 120.0), \
                ({ns: mon.fresh(ns, 0.0) for ns in robots2}, edge.output()[-3000:])
            child = camera_child_of(edge.p.pid)
            assert child, edge.output()[-2000:]
            t_kill = time.monotonic()
            os.kill(child, signal.SIGKILL)

            def restarted():
                return [v for t, name, _, _, v in list(mon.diag_log) if t > t_kill and name.startswith("vla_camera")
                        and v.get("camera_process_restarts") == "1" and v.get("camera_process_alive") == "True"]

            assert wait_for(lambda: len(restarted()) >= 2, 30.0), (mon.diag_log[-4:], edge.output()[-3000:])
            assert {v["camera_process_pid"] for v in restarted()} == {str(camera_child_of(edge.p.pid))} != {str(child)}
            t_back = time.monotonic()
            assert wait_for(lambda: all(mon.fresh(ns, t_back) > 10 for ns in robots2), 60.0), \
                ({ns: runs(mon.kinds(ns, t_kill)) for ns in robots2}, edge.output()[-3000:])
            t_end = time.monotonic()
            assert all(p.alive() for p in (edge, *robots.values(), *cameras.values()))
            codes = procs.stop(edge, *cameras.values(), *robots.values())
            assert set(codes.values()) == {0}, (codes, edge.output()[-3000:])
        finally:
            mon.close()

    assert "exited (exit code -9)" in edge.output(), edge.output()[-3000:]
    # every tick of each robot reached the monitor, in order, through the outage: one process each, no gap
    for ns in robots2:
        segments = tick_segments(mon.ticks[ns])
        assert len(segments) == 1 and segments[0] == list(range(segments[0][0], segments[0][0] + len(segments[0]))), \
            (ns, [(s[0], s[-1], len(s)) for s in segments])
        assert mon.fresh(ns, 0.0, t_kill) > 20 and mon.fresh(ns, t_back, t_end) > 10
        a = read_json(stats[ns])["action"]
        assert a["publish_errors"] == 0 and a["fresh_msgs_rejected"] == 0, (ns, a)


@pytest.mark.parametrize("role,backend,expect", [
    ("all", "numpy", "served by --role edge only"),  # role all serves one robot: a fleet list there is a mistake
])
def test_fleet_settings_refused_at_start(ros_processes, role, backend, expect):
    proc = ros_processes.start_cmd(runtime_cmd("-p", "robot_namespaces:=r1,r2", role=role, backend=backend),
                                   name="runtime")
    assert wait_for(lambda: not proc.alive(), 60.0), proc.output()
    assert proc.stop() == 2 and expect in proc.output(), proc.output()


def test_the_cuda_fleet_engine_is_built_or_refused_with_the_reason():
    """backend cuda builds engine/cuda/fleet.FleetCudaEngine: what it cannot run is refused by name before the GPU
    is probed (quantised weights); without a usable GPU, the probe's reason."""
    from vla_edge_ros.engine.cuda import cuda_status
    from vla_edge_ros.engine.interface import EngineError
    from vla_edge_ros.ros.fleet_node import build_fleet_engine

    base = {"backend": "cuda", "robot_namespaces": "r1,r2", "kv_budget_tokens": 128}
    with pytest.raises(EngineError, match="bf16 weights only"):
        build_fleet_engine({**base, "weight_dtype": "int8"}, log=lambda m: None)
    ok, why = cuda_status()
    if ok:
        pytest.skip("a usable GPU: the engine itself is tested in test_cuda_fleet.py")
    with pytest.raises(EngineError, match="CUDA backend unavailable"):
        build_fleet_engine(base, log=lambda m: None)


def test_robot_namespaces_parsing():
    from vla_edge_ros.ros.fleet_node import parse_robot_namespaces, robot_topic

    assert parse_robot_namespaces("") == () and parse_robot_namespaces("  ") == ()
    assert parse_robot_namespaces(" r1, /r2 ,fleet/r_3/") == ("r1", "r2", "fleet/r_3")
    for bad, why in (("r1,,r2", "not a robot namespace"), ("r1,1r", "not a robot namespace"),
                     ("r1,r1", "listed twice"), ("a b", "not a robot namespace"), ("__warmup0", "not a robot"),
                     (["r1", "r2"], "one comma-separated string")):
        with pytest.raises(ValueError, match=why):
            parse_robot_namespaces(bad)
    assert robot_topic("r1", "/vla/action_fresh") == "/r1/vla/action_fresh"
    assert robot_topic("fleet/r2", "camera/image_raw") == "/fleet/r2/camera/image_raw"


def test_given_values_files_then_dash_p(tmp_path):
    from vla_edge_ros import params as P
    from vla_edge_ros.ros.runtime import given_values

    f = tmp_path / "p.yaml"
    f.write_text("vla_camera:\n  ros__parameters:\n    camera_topic: /cam\n    camera_deadline_ms: 50.0\n"
                 "vla_inference:\n  ros__parameters:\n    robot_namespaces: a,b\n")
    argv = ["x", "--ros-args", "--params-file", str(f), "-p", "camera_deadline_ms:=70.0", "-p", "backend:=numpy"]
    assert given_values(argv, P.CAMERA) == {"camera_topic": "/cam", "camera_deadline_ms": 70.0}
    assert given_values(argv, P.INFERENCE) == {"robot_namespaces": "a,b", "backend": "numpy"}
    assert given_values(["x", "--ros-args", "-p", "robot_namespaces:=r1,r2"], P.INFERENCE) == \
        {"robot_namespaces": "r1,r2"}


def test_robot_status_depends_on_its_own_figures_only():
    from vla_edge_ros.ros import diagnostics as D

    def robot(fresh_hz=12.0, stalled=False, cam_hz=15.0, error="", age=None, served=True):
        return {"served": served, "topics": {"fresh_action_topic": "/x/f", "camera_topic": "/x/c"},
                "fresh_rate_hz": fresh_hz, "fresh_actions": 10, "frame_to_action_ms": {}, "kv": {},
                "loop": {"admitted": 3}, "scheduler": {"refusal_streak": 0},
                "camera": {"stalled": stalled, "rate_hz": cam_hz, "received": 5},
                "last_error": error, "last_error_age_s": age}

    assert D.fleet_robot_status("r1", robot(), "active").level == D.OK
    st = D.fleet_robot_status("r2", robot(fresh_hz=0.0, stalled=True, cam_hz=0.0), "active")
    assert (st.level, st.message, st.name) == (D.WARN, "no fresh actions: camera stalled", "vla_inference: robot [r2]")
    st = D.fleet_robot_status("r3", robot(error="chunk_error: boom", age=1.0), "active")
    assert st.level == D.ERROR and "boom" in st.message
    assert D.fleet_robot_status("r3", robot(error="chunk_error: boom", age=20.0), "active").level == D.WARN
    assert D.fleet_robot_status("r4", robot(served=False), "active").level == D.ERROR
    assert D.fleet_robot_status("r1", robot(), "inactive").level == D.WARN


def _jpeg(rgb) -> bytes:
    import io

    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.fromarray(rgb).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def test_fleet_camera_defers_jpeg_and_yuv_decoding_to_the_taker_and_counts_a_late_rejection(ros_context):
    """A FleetCameraNode (the fleet edge's per-robot camera) called as its subscription would be: RGB frames are
    converted on receipt as before; JPEG and YUYV frames are stored as received and decoded by ``convert()`` (the
    fleet loop's call when a pass takes the frame), to the same pixels; frames overwritten unread are never
    decoded; a JPEG that cannot be decoded is rejected then, counted by the camera under its reason and as
    found at take; receipt-time checks (the stamp) still reject on receipt."""
    import numpy as np
    from rclpy.parameter import Parameter
    from sensor_msgs.msg import CompressedImage, Image

    from vla_edge_ros.core import image_convert
    from vla_edge_ros.core.double_buffer import DoubleBuffer
    from vla_edge_ros.ros.camera_node import CameraFrame
    from vla_edge_ros.ros.conversions import ns_to_stamp
    from vla_edge_ros.ros.fleet_camera_node import DeferredFrame, FleetCameraNode

    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buf = DoubleBuffer()
    cam = FleetCameraNode(buf, namespace="/r1", context=ros_context,
                          parameter_overrides=[Parameter("camera_topic", value="/r1/camera/image_raw"),
                                               Parameter("image_transport", value="compressed")])
    now_ns = cam.get_clock().now().nanoseconds
    try:
        def header(m, stamp=now_ns):
            m.header.stamp = ns_to_stamp(stamp)
            m.header.frame_id = "cam"
            return m

        def jpeg_msg(data):
            m = header(CompressedImage())
            m.format, m.data = "jpeg", data
            return m

        def raw_msg(enc, step, data):
            m = header(Image())
            m.height, m.width, m.encoding, m.step, m.data = 48, 64, enc, step, data
            return m

        cam._on_image(raw_msg("rgb8", 64 * 3, rgb.tobytes()))  # a view: made on receipt, as CameraNode does
        f = buf.read_latest()
        assert type(f) is CameraFrame and np.array_equal(f.image, rgb)

        good = _jpeg(rgb)
        cam._on_compressed(jpeg_msg(good))
        cam._on_compressed(jpeg_msg(good))  # overwrites the first unread: never decoded
        first_unread = buf._slot[1]
        cam._on_compressed(jpeg_msg(good))
        assert buf.stats()["overwritten"] == 2
        f = buf.read_latest()
        assert isinstance(f, DeferredFrame) and f.image is None and f.stamp_ns == now_ns and f.frame_id == 4
        img = f.convert()
        assert np.array_equal(img, image_convert.compressed_to_rgb("jpeg", good)) and f.convert() is img
        assert first_unread.image is None  # the overwritten frame was never decoded

        yuyv = rng.integers(16, 240, (48, 64 * 2), dtype=np.uint8).tobytes()
        cam._on_image(raw_msg("yuyv", 64 * 2, yuyv))
        f = buf.read_latest()
        assert isinstance(f, DeferredFrame)
        assert np.array_equal(f.convert(), image_convert.image_to_rgb(48, 64, "yuyv", 128, yuyv))

        cam._on_compressed(jpeg_msg(b"\xff\xd8 not a jpeg at all"))  # passes the receipt checks ...
        s = cam.snapshot()
        assert s["accepted"] == 6 and s["rejected"] == 0 and s["deferred_frames"] == 5
        bad = buf.read_latest()
        with pytest.raises(image_convert.ImageRejected):  # ... and is rejected when the fleet loop takes it
            bad.convert()
        s = cam.snapshot()
        assert s["rejected_by_reason"] == {"bad_compressed": 1} and s["rejected_at_take"] == 1
        assert "fleet loop took the frame" in s["last_rejection"]
        cam._on_compressed(header(jpeg_msg(good), stamp=now_ns + 60 * 10**9))  # a minute ahead: on receipt
        s = cam.snapshot()
        assert s["rejected_by_reason"] == {"bad_compressed": 1, "bad_stamp": 1} and s["rejected_at_take"] == 1
        assert s["received"] == 7 and s["accepted"] == 6 and buf.read_latest() is None
    finally:
        cam.destroy_node()

