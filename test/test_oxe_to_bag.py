"""RLDS -> ROS 2 bag conversion, read back with rosbags; metadata.yaml checked as rosbag2 (Jazzy) reads it."""
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import yaml
from rosbags.highlevel import AnyReader
from rosbags.interfaces import QosDurability, QosReliability
from rosbags.typesys import Stores, get_typestore

from vla_edge_ros.data import mappings, oxe_to_bag, rlds, tfrecord
from vla_edge_ros.engine.config import DEFAULT_ACTION_NAMES

SHARED_BRIDGE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "oxe"
TS = get_typestore(Stores.ROS2_JAZZY)


def read_bag(path):
    out = {}
    with AnyReader([Path(path)], default_typestore=TS) as reader:
        for conn, stamp, raw in reader.messages():
            out.setdefault(conn.topic, []).append((stamp, reader.deserialize(raw, conn.msgtype)))
        types = {c.topic: c.msgtype for c in reader.connections}
    return out, types


def stamp_ns(msg):
    return msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec


# What rosbag2 Jazzy (metadata version 9) writes for each offered QoS profile, and the policy names it parses
# (rmw's *_from_str); durations are {sec, nsec}, RMW_DURATION_INFINITE = 9223372036 s 854775807 ns.
QOS_KEYS = {"history", "depth", "reliability", "durability", "deadline", "lifespan", "liveliness",
            "liveliness_lease_duration", "avoid_ros_namespace_conventions"}
POLICY_NAMES = {"history": {"system_default", "keep_last", "keep_all"},
                "reliability": {"system_default", "reliable", "best_effort", "best_available"},
                "durability": {"system_default", "transient_local", "volatile", "best_available"},
                "liveliness": {"system_default", "automatic", "manual_by_topic", "best_available"}}
INFINITE = {"sec": 9223372036, "nsec": 854775807}


def bag_info(bag):
    return yaml.safe_load((Path(bag) / "metadata.yaml").read_text())["rosbag2_bagfile_information"]


def check_metadata(bag, storage):
    """Jazzy distro and a complete, parseable offered QoS profile per topic; returns {topic: profile}."""
    info = bag_info(bag)
    assert info["version"] == 9 and info["ros_distro"] == "jazzy"
    profiles = {}
    for entry in info["topics_with_message_count"]:
        meta = entry["topic_metadata"]
        offered = meta["offered_qos_profiles"]
        assert isinstance(offered, list) and len(offered) == 1, (meta["name"], offered)
        q = offered[0]
        assert set(q) == QOS_KEYS, meta["name"]
        for policy, names in POLICY_NAMES.items():
            assert q[policy] in names, (meta["name"], policy, q[policy])
        assert isinstance(q["depth"], int) and q["depth"] >= 1
        for duration in ("deadline", "lifespan", "liveliness_lease_duration"):
            assert q[duration] == INFINITE, (meta["name"], duration)
        assert q["avoid_ros_namespace_conventions"] is False
        profiles[meta["name"]] = q
    # the copy of the metadata inside the storage file says the same distro
    if storage == "sqlite3":
        db = next(Path(bag).glob("*.db3"))
        with sqlite3.connect(db) as con:
            (embedded,), = con.execute("SELECT metadata FROM metadata").fetchall()
        assert yaml.safe_load(embedded)["ros_distro"] == "jazzy"
    else:
        raw = next(Path(bag).glob("*.mcap")).read_bytes()
        assert b"ros_distro: jazzy" in raw and b"ros_distro: rosbags" not in raw
    return profiles


@pytest.mark.parametrize("layout,rate", [("bridge_dataset", 5.0), ("fractal20220817_data", 3.0)])
@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_round_trip_counts_stamps_actions(tmp_path, layout, rate, storage):
    steps, episodes = 6, 3
    src = rlds.write_synthetic_dataset(tmp_path / "src", layout, episodes=episodes, steps=steps)
    bag = tmp_path / "bag"
    summary = oxe_to_bag.convert(src, bag, storage=storage, progress=False, episode_gap_s=0.5)
    assert (summary.episodes, summary.frames, summary.skipped) == (episodes, episodes * steps, 0)
    assert summary.bag_bytes > 0
    assert any(bag.glob("*.mcap" if storage == "mcap" else "*.db3"))
    msgs, types = read_bag(bag)
    assert types["/camera/image_raw/compressed"] == "sensor_msgs/msg/CompressedImage"
    assert types["/vla/recorded_action"] == "sensor_msgs/msg/JointState"
    assert types["/vla/instruction"] == types["/vla/episode_events"] == "std_msgs/msg/String"
    frames, actions = msgs["/camera/image_raw/compressed"], msgs["/vla/recorded_action"]
    assert len(frames) == len(actions) == episodes * steps
    period = int(round(1e9 / rate))
    t0 = oxe_to_bag.DEFAULT_START_NS
    for e in range(episodes):
        ep_start = t0 + e * (steps * period + int(0.5e9))
        expected_actions = rlds.synthetic_action(e, steps)
        for i in range(steps):
            bag_t, img = frames[e * steps + i]
            assert bag_t == stamp_ns(img) == ep_start + i * period
            assert img.format == "jpeg" and bytes(img.data[:2]) == b"\xff\xd8"
            bag_t, js = actions[e * steps + i]
            assert bag_t == stamp_ns(js) == ep_start + i * period
            assert list(js.name) == list(DEFAULT_ACTION_NAMES)  # the runtime's names, not a second list
            np.testing.assert_allclose(js.position, expected_actions[i], atol=1e-6)
    instructions = [m.data for _, m in msgs["/vla/instruction"]]
    assert instructions == [f"synthetic task {e % 2}: move the block" for e in range(episodes)]
    events = [json.loads(m.data) for _, m in msgs["/vla/episode_events"]]
    kinds = [ev["event"] for ev in events]
    assert kinds.count("episode_start") == kinds.count("episode_end") == episodes
    closes = [ev for ev in events if ev["event"] == "gripper_close"]
    assert [(ev["episode"], ev["step"]) for ev in closes] == [(e, steps // 2) for e in range(episodes)]
    assert all(ev["salient"] for ev in closes)


def test_corrupt_record_skipped_and_reported(tmp_path):
    src = rlds.write_synthetic_dataset(tmp_path / "src", "bridge_dataset", episodes=4, steps=4)
    shard = next(src.glob("*.tfrecord-*"))
    offsets = [o for o, _ in tfrecord.iter_records(shard)]
    raw = bytearray(shard.read_bytes())
    raw[offsets[1] + 100] ^= 0xFF
    shard.write_bytes(bytes(raw[:-10]))  # and truncate the last record
    summary = oxe_to_bag.convert(src, tmp_path / "bag", progress=False)
    assert summary.episodes == 2 and summary.frames == 8 and summary.skipped == 2
    assert sorted((i.kind, i.offset) for i in summary.issues) == [("data_crc", offsets[1]),
                                                                  ("truncated", offsets[3])]
    text = summary.text()
    assert "skipped records: 2" in text and f"@{offsets[1]}" in text
    msgs, _ = read_bag(tmp_path / "bag")
    assert len(msgs["/vla/recorded_action"]) == 8


def test_cli_raw_images_episode_limit_and_summary_json(tmp_path, capsys):
    src = rlds.write_synthetic_dataset(tmp_path / "src", "bridge_dataset", episodes=3, steps=3, image_hw=(16, 24))
    out = tmp_path / "bag"
    rc = oxe_to_bag.main([str(src), str(out), "--episodes", "2", "--images", "both", "--no-progress",
                          "--storage", "sqlite3", "--summary-json", str(tmp_path / "s.json")])
    assert rc == 0
    assert "episodes  2" in capsys.readouterr().out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["episodes"] == 2 and summary["frames"] == 6 and summary["skipped_records"] == 0
    msgs, types = read_bag(out)
    assert types["/camera/image_raw"] == "sensor_msgs/msg/Image"
    raw = msgs["/camera/image_raw"][0][1]
    assert (raw.height, raw.width, raw.encoding, raw.step) == (16, 24, "rgb8", 72) and len(raw.data) == 16 * 24 * 3
    assert len(msgs["/camera/image_raw/compressed"]) == 6
    assert oxe_to_bag.main([str(src), str(out), "--no-progress"]) == 2  # exists, no --overwrite
    assert "exists" in capsys.readouterr().err


def test_cli_unknown_dataset_needs_and_accepts_a_mapping(tmp_path, capsys):
    src = rlds.write_synthetic_dataset(tmp_path / "src", "fractal20220817_data", episodes=1, steps=4)
    info = json.loads((src / "dataset_info.json").read_text())
    assert oxe_to_bag.main([str(src), str(tmp_path / "b0"), "--dataset", "my_robot:2.0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no mapping for dataset 'my_robot'" in err and "--image-key" in err
    rc = oxe_to_bag.main([str(src), str(tmp_path / "b1"), "--dataset", "my_robot:2.0", "--no-progress",
                          "--image-key", "observation/image", "--instruction-key",
                          "observation/natural_language_instruction", "--action-keys",
                          "action/world_vector,action/rotation_delta,action/gripper_closedness_action",
                          "--gripper", "close_pm1", "--rate-hz", "10"])
    assert rc == 0, capsys.readouterr().err
    msgs, _ = read_bag(tmp_path / "b1")
    stamps = [t for t, _ in msgs["/vla/recorded_action"]]
    assert np.diff(stamps).tolist() == [100_000_000] * 3
    np.testing.assert_allclose([m.position for _, m in msgs["/vla/recorded_action"]],
                               rlds.synthetic_action(0, 4), atol=1e-6)
    # a key the dataset lacks is named in the error
    rc = oxe_to_bag.main([str(src), str(tmp_path / "b2"), "--image-key", "observation/nope", "--no-progress"])
    assert rc == 2 and "observation/nope" in capsys.readouterr().err
    assert info["name"] == "fractal20220817_data"


@pytest.mark.skipif(not (SHARED_BRIDGE / "bridge_dataset").is_dir(), reason="../shared/data/oxe not present")
def test_real_bridge_sample_converts(tmp_path):
    summary = oxe_to_bag.convert(SHARED_BRIDGE, tmp_path / "bridge", progress=False)
    assert (summary.episodes, summary.frames, summary.skipped) == (25, 250, 0)
    msgs, _ = read_bag(tmp_path / "bridge")
    assert len(msgs["/camera/image_raw/compressed"]) == 250
    stamps = [t for t, _ in msgs["/camera/image_raw/compressed"][:10]]
    assert np.diff(stamps).tolist() == [200_000_000] * 9  # 5 Hz
    first = oxe_to_bag.decode_image(bytes(msgs["/camera/image_raw/compressed"][0][1].data))
    assert first.shape == (64, 64, 3) and first.std() > 5  # a real picture, not a blank
    ds = rlds.RLDSDataset(SHARED_BRIDGE)
    ep0 = next(ds.episodes())
    np.testing.assert_allclose([m.position for _, m in msgs["/vla/recorded_action"][:10]], ep0.steps["action"],
                               atol=1e-6)
    assert msgs["/vla/instruction"][0][1].data == ep0.steps["language_instruction"][0]
    assert list(msgs["/vla/recorded_action"][0][1].name) == list(DEFAULT_ACTION_NAMES)
    profiles = check_metadata(tmp_path / "bridge", "mcap")
    assert profiles["/camera/image_raw/compressed"]["reliability"] == "best_effort"


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_metadata_says_jazzy_and_offers_each_topics_qos(tmp_path, storage):
    src = rlds.write_synthetic_dataset(tmp_path / "src", "bridge_dataset", episodes=2, steps=3, image_hw=(16, 24))
    bag = tmp_path / "bag"
    oxe_to_bag.convert(src, bag, storage=storage, images="both", progress=False)
    profiles = check_metadata(bag, storage)
    assert set(profiles) == {"/camera/image_raw", "/camera/image_raw/compressed", "/vla/instruction",
                             "/vla/recorded_action", "/vla/episode_events"}
    for topic in ("/camera/image_raw", "/camera/image_raw/compressed"):  # sensor data: only the freshest frame
        assert (profiles[topic]["reliability"], profiles[topic]["durability"], profiles[topic]["history"],
                profiles[topic]["depth"]) == ("best_effort", "volatile", "keep_last", 1)
    assert (profiles["/vla/instruction"]["reliability"], profiles["/vla/instruction"]["durability"]) == \
        ("reliable", "transient_local")  # a subscriber that joins late still gets the task
    for topic in ("/vla/recorded_action", "/vla/episode_events"):
        assert (profiles[topic]["reliability"], profiles[topic]["durability"]) == ("reliable", "volatile")
    # an independent parser (rosbags' reader of metadata version 9) reads the same profiles back
    with AnyReader([bag], default_typestore=TS) as reader:
        parsed = {c.topic: c.ext.offered_qos_profiles for c in reader.connections}
    assert parsed["/camera/image_raw/compressed"][0].reliability == QosReliability.BEST_EFFORT
    assert parsed["/vla/instruction"][0].durability == QosDurability.TRANSIENT_LOCAL
    assert parsed["/vla/recorded_action"][0].reliability == QosReliability.RELIABLE


def test_recorded_qos_matches_what_the_runtime_publishes_with():
    """The bag's profiles are vla_bag_replay's (ros/qos.py), so `ros2 bag play` and the replayer offer alike."""
    pytest.importorskip("rclpy")
    from vla_edge_ros.ros import qos

    def policies(profile):
        return (profile.reliability.name.lower(), profile.durability.name.lower(), profile.history.name.lower())

    cam, rel = oxe_to_bag.CAMERA_QOS, oxe_to_bag.RELIABLE_QOS
    assert policies(qos.camera_publisher_qos()) == (cam.reliability, cam.durability, cam.history)
    assert qos.camera_publisher_qos().depth == cam.depth
    assert policies(qos.reliable_qos()) == (rel.reliability, rel.durability, rel.history)


def test_one_action_naming_shared_with_the_runtime():
    assert mappings.ACTION_NAMES is DEFAULT_ACTION_NAMES
    assert list(DEFAULT_ACTION_NAMES) == ["x", "y", "z", "roll", "pitch", "yaw", "gripper"]  # README, /vla/action
    pytest.importorskip("rclpy")
    from vla_edge_ros.ros import action_node

    assert tuple(action_node.DEFAULT_ACTION_NAMES) == tuple(DEFAULT_ACTION_NAMES)
