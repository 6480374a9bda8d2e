"""The runtime's housekeeping kept off the fleet loop's way (issue 24, docs/FIGURES.md session 22): the stats file
compact while running and indented at the end, /diagnostics collected after the quiet point, the quiet point asking
the fleet edge for a gap between passes (and nobody else), the fleet's snapshot shared by the robots' statuses.
"""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("rclpy")

from vla_edge_ros.ros.runtime import Runtime, write_stats  # noqa: E402  (needs rclpy)


def test_stats_file_is_compact_unless_asked_and_replaced_whole(tmp_path):
    path = tmp_path / "sub" / "stats.json"
    stats = {"a": 1, "b": {"c": [1.5, 2], "d": "x"}, "when": object()}  # default=str for the odd value
    write_stats(str(path), stats)
    text = path.read_text()
    assert "\n" not in text and ", " not in text and ": " not in text  # the C encoder's compact form
    assert json.loads(text)["b"] == {"c": [1.5, 2], "d": "x"}
    write_stats(str(path), stats, indent=2)
    text = path.read_text()
    assert text.count("\n") > 5 and json.loads(text)["a"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["stats.json"]  # no temporary file left


def test_quiet_point_asks_the_fleet_edge_for_a_gap_and_returns_at_once_elsewhere():
    calls = []
    fleet = SimpleNamespace(wait_between_passes=lambda timeout_s: calls.append(timeout_s) or False)
    assert Runtime.quiet_point(SimpleNamespace(inference=fleet), 0.05) is False  # the gap did not come: said so
    assert calls == [0.05]
    single = SimpleNamespace()  # the single-robot inference node has no passes to wait for
    t0 = time.monotonic()
    assert Runtime.quiet_point(SimpleNamespace(inference=single), 5.0) is True
    assert Runtime.quiet_point(SimpleNamespace(inference=None), 5.0) is True
    assert time.monotonic() - t0 < 1.0


def test_diagnostics_are_collected_after_the_quiet_point(ros_context):
    import rclpy

    from vla_edge_ros.ros import diagnostics

    node = rclpy.create_node("housekeeping_test", context=ros_context)
    order = []
    try:
        def source():
            order.append("source")
            return diagnostics._status("x", diagnostics.OK, "ok", {})

        pub = diagnostics.DiagnosticsPublisher(node, [source], period_s=3600.0,
                                               before_build=lambda: order.append("quiet"))
        pub.publish_now()
        pub.publish_now()
        assert order == ["quiet", "source", "quiet", "source"]
        pub.destroy()
        plain = diagnostics.DiagnosticsPublisher(node, [source], period_s=3600.0)  # no hook: builds at once
        plain.publish_now()
        assert order[-1] == "source"
        plain.destroy()
    finally:
        node.destroy_node()


def test_fleet_snapshot_is_shared_within_its_age_and_robot_statuses_read_it():
    from vla_edge_ros.ros.fleet_node import ROBOT_SNAPSHOT_MAX_AGE_S, FleetNode

    builds = []

    def build():
        builds.append(time.monotonic())
        return {"robots": {"r1": {"fresh_actions": len(builds)}}, "n": len(builds)}

    fake = SimpleNamespace(_snapshot_cache=None, _build_snapshot=build)
    fake.snapshot = lambda max_age_s=0.0: FleetNode.snapshot(fake, max_age_s)
    fake.loop_stats = lambda: pytest.fail("a robot's status must not rebuild the loop's stats")
    assert FleetNode.snapshot(fake)["n"] == 1
    assert FleetNode.snapshot(fake)["n"] == 2  # default: always fresh (the stats file, the fleet status)
    # the robots' statuses right after the fleet's: one build serves them all
    assert [FleetNode.robot_snapshot(fake, "r1")["fresh_actions"] for _ in range(8)] == [2] * 8
    assert len(builds) == 2
    fake._snapshot_cache = (time.monotonic() - 2 * ROBOT_SNAPSHOT_MAX_AGE_S, fake._snapshot_cache[1])
    assert FleetNode.robot_snapshot(fake, "r1")["fresh_actions"] == 3  # too old: rebuilt once
    assert len(builds) == 3
