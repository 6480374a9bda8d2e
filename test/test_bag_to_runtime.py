"""An Open X-Embodiment clip, converted to an MCAP bag, replayed into the runtime: what `runtime.launch.py
bag:=PATH` starts (launch itself is not installable here, so the test starts the same two executables with the
same arguments the launch file passes) and an independent action subscriber.

Uses the real Bridge sample when ../shared/data/oxe is present, else a synthetic RLDS clip written by the
project's own writer, so the path is exercised on every machine.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ros_env import BAG_REPLAY, load_monitor, read_json, wait_for

pytest.importorskip("rclpy")
pytest.importorskip("rosbags")

from vla_edge_ros.data import oxe_to_bag, rlds  # noqa: E402

BRIDGE = Path(__file__).resolve().parents[2] / "shared" / "data" / "oxe" / "bridge_dataset" / "1.0.0"


def _clip(tmp_path: Path) -> tuple[Path, str]:
    if BRIDGE.exists():
        src, name = BRIDGE, "real Bridge sample"
    else:
        src, name = rlds.write_synthetic_dataset(tmp_path / "rlds", "bridge_dataset", episodes=2, steps=10), \
            "synthetic clip"
    summary = oxe_to_bag.convert(src, tmp_path / "clip_bag", episodes=3, progress=False)
    assert summary.frames > 0 and summary.skipped == 0, summary
    assert any(p.suffix == ".mcap" for p in (tmp_path / "clip_bag").iterdir())
    return tmp_path / "clip_bag", name


def test_replayed_clip_drives_the_runtime(tmp_path, ros_processes):
    bag, name = _clip(tmp_path)
    stats, monitor_out = tmp_path / "runtime.json", tmp_path / "actions.jsonl"
    runtime = ros_processes.runtime("-p", "kv_budget_tokens:=1024",
                                    # the 60 Hz re-timing repeats each 5 Hz frame on purpose: not a frozen camera
                                    "-p", "frozen_frame_limit:=0", stats_out=stats)
    monitor = ros_processes.monitor(monitor_out)
    ros_processes.wait_active(runtime)
    replay = ros_processes.start(BAG_REPLAY, "--bag", bag, "--decode", "--camera-hz", "60", "--loop", name="replay")
    wait_for(lambda: not replay.alive(), 10.0)
    assert replay.alive(), replay.output()[-2000:]
    codes = ros_processes.stop(replay, runtime, monitor)
    assert codes == {"replay": 0, "runtime": 0, "monitor": 0}, (codes, runtime.output()[-3000:])

    actions, _ = load_monitor(monitor_out)
    fresh = [a for a in actions if a["kind"] == "fresh"]
    s = read_json(stats)
    assert s["frames"]["received"] >= 100, (name, s["frames"])  # ~60 Hz for ~10 s
    assert s["frames"]["rejected"] == 0, s["frames"]
    assert len(fresh) >= 30, (name, len(fresh), s["chunks"])
    assert len({tuple(a["position"]) for a in fresh}) > 1, "every fresh action identical: frames not reaching it"
