"""Robot <-> edge split with real processes: a camera (JPEG on the wire), an edge process (camera subscriber +
inference, --role edge), a robot process (action publisher, --role robot) and an action monitor.
The edge process is killed (link cut) and restarted: the robot side must publish every tick, hold once the
newest action is older than stale_after_ms, and resume fresh actions when the edge is back."""
from __future__ import annotations

import time

import pytest

from ros_env import (allocate_domain_ids, load_monitor, module_cmd, Proc, read_json, ros_env, runs, single_node_cmd,
                     wait_for)

DOMAIN_ID = allocate_domain_ids(1)
pytest.importorskip("rclpy")
PERIOD_S = 1.0 / 30.0


def _fresh_after(path, t0: float) -> int:
    try:
        actions, _ = load_monitor(path)
    except (OSError, ValueError):
        return 0
    return sum(1 for a in actions if a["kind"] == "fresh" and a["t"] > t0)


def test_edge_killed_robot_holds_every_tick_and_resumes(tmp_path):
    env = ros_env(DOMAIN_ID, tmp_path / "home")
    mon_out, robot_stats = tmp_path / "actions.jsonl", tmp_path / "robot.json"
    edge_cmd = module_cmd("vla_edge_ros.ros.runtime", "--role", "edge", "--ros-args", "-p", "backend:=numpy",
                          "-p", "kv_budget_tokens:=512", "-p", "image_transport:=compressed")
    robot = Proc(module_cmd("vla_edge_ros.ros.runtime", "--role", "robot", "--stats-out", str(robot_stats)),
                 env, tmp_path / "robot.log")
    monitor = Proc(module_cmd("vla_edge_ros.ros.tools.action_monitor", "--out", str(mon_out)), env,
                   tmp_path / "monitor.log")
    camera = Proc(module_cmd("vla_edge_ros.ros.tools.test_camera", "--ros-args", "-p", "compressed:=true",
                             "-p", "width:=160", "-p", "height:=120", "-p", "rate_hz:=30.0"), env,
                  tmp_path / "camera.log")
    # One host stands in for two machines: the edge side runs at a lower CPU priority so that its start-up
    # (imports, engine build, warm-up) does not take the robot's CPU the way it could not on separate hardware.
    edge_cmd = ["nice", "-n", "10"] + edge_cmd
    edge = Proc(edge_cmd, env, tmp_path / "edge1.log")
    edge2 = None
    try:
        assert wait_for(lambda: _fresh_after(mon_out, 0.0) > 30, 60.0), edge.output()[-2000:]
        time.sleep(1.0)
        t_kill = time.monotonic()
        edge.kill()  # the link is cut: no goodbye, no more fresh actions
        time.sleep(3.0)
        t_restart = time.monotonic()
        edge2 = Proc(edge_cmd, env, tmp_path / "edge2.log")
        assert wait_for(lambda: _fresh_after(mon_out, t_restart) > 30, 60.0), edge2.output()[-2000:]
        time.sleep(0.5)
        assert robot.alive() and monitor.alive()
    finally:
        codes = {"edge2": edge2.stop() if edge2 else 0, "camera": camera.stop(), "robot": robot.stop(),
                 "monitor": monitor.stop()}
        edge.kill()
    assert codes == {"edge2": 0, "camera": 0, "robot": 0, "monitor": 0}, (codes, robot.output()[-2000:])

    actions, statuses = load_monitor(mon_out)
    kinds = [a["kind"] for a in actions]
    assert set(kinds) <= {"fresh", "repeat", "hold"}

    # 1. every tick published: the tick numbers the monitor received are contiguous (none lost on the way),
    #    and the robot's timer never skipped a period (a gap > 1.5 periods counts as missed ticks)
    ticks = [st["tick"] for st in statuses]
    lost = sum(b - a - 1 for a, b in zip(ticks, ticks[1:]))
    s = read_json(robot_stats)
    gaps = [b["t"] - a["t"] for a, b in zip(actions, actions[1:])]
    print(f"split test: {len(ticks)} ticks observed across the cut, ticks lost: {lost}, robot timer missed "
          f"ticks: {s['action']['missed_ticks']}, longest gap at the subscriber {max(gaps) * 1e3:.1f} ms, "
          f"timer period error p99 {s['timer_period_error_ms']['p99']:.2f} ms")
    assert lost == 0 and ticks == sorted(ticks), ticks
    assert s["action"]["missed_ticks"] <= 2  # 2 shared cores: tolerate a rare scheduler hiccup (printed above)
    assert s["action"]["publish_errors"] == 0

    # 2. fresh before the cut, only hold from stale_after_ms (+ slack) after it until the new edge delivers
    before = [a for a in actions if a["t"] < t_kill]
    assert sum(a["kind"] == "fresh" for a in before) > 20
    during = [a for a in actions if t_kill + 0.2 + 0.25 < a["t"] < t_restart]
    assert len(during) >= 60, len(during)  # ~2.5 s of ticks while the edge is down
    assert all(a["kind"] == "hold" for a in during), runs([a["kind"] for a in during])
    assert all(a["position"][:6] == [0.0] * 6 for a in during)
    hold_reasons = {st["reason"] for st in statuses if t_kill + 0.45 < st["t"] < t_restart}
    assert hold_reasons == {"action_stale"}, hold_reasons

    # 3. resumes: fresh actions after the restart
    assert sum(a["kind"] == "fresh" for a in actions if a["t"] > t_restart) > 30
    assert s["action"]["fresh_msgs_rejected"] == 0


@pytest.mark.parametrize("kind,expect", [
    ("inference", "active: admitting chunks"),  # vla_inference = role edge
    ("action", "robot side: taking fresh actions from /vla/action_fresh"),  # vla_action = role robot
])
def test_single_node_executables_start_and_stop(tmp_path, kind, expect):
    env = ros_env(DOMAIN_ID, tmp_path / "home")
    stats = tmp_path / "stats.json"
    proc = Proc(single_node_cmd(kind, "--stats-out", str(stats), "--ros-args", "--params-file", "config/runtime.yaml",
                           "-p", "backend:=numpy"), env, tmp_path / "node.log")
    try:
        assert wait_for(lambda: expect in proc.output() or not proc.alive(), 60.0), proc.output()
        assert proc.alive(), proc.output()
    finally:
        rc = proc.stop()
    assert rc == 0, proc.output()
    s = read_json(stats)
    assert s["role"] == ("edge" if kind == "inference" else "robot")
