"""data/bag_writer.py -> data/bag_reader.py round trips, for the sim layout (raw rgb8, success / seed in the
events) and the OXE layout (oxe_to_bag's compressed JPEG frames), and every kind of skipped message counted."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("rosbags")

from vla_edge_ros.data import bag_reader, bag_writer, oxe_to_bag, rlds  # noqa: E402
from vla_edge_ros.data.bag_reader import BagReadError, read_episodes  # noqa: E402

INSTRUCTIONS = ("reach the red goal", "push the puck to the green goal")


def square_frames(steps: int, hw=(16, 32), seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Frames with a bright square moving across a noisy background, and actions that are a function of the
    square's position (x, y), the rest constant: something a policy can learn from the current frame."""
    rng = np.random.default_rng(seed)
    h, w = hw
    frames = rng.integers(0, 60, size=(steps, h, w, 3), dtype=np.uint8)
    actions = np.zeros((steps, 7))
    for t in range(steps):
        r, c = int(rng.integers(0, h - 4)), int(rng.integers(0, w - 4))
        frames[t, r:r + 4, c:c + 4] = 255
        actions[t, :3] = [0.01 * (c / (w - 4) * 2 - 1), 0.01 * (r / (h - 4) * 2 - 1), 0.0]
        actions[t, 6] = 1.0 if c < w // 2 else 0.0
    return frames, actions


def write_demo_bag(path, episodes: int = 3, steps: int = 6, hw=(16, 32), rate_hz: float = 10.0,
                   storage: str = "mcap", images: str = "raw", seed: int = 0) -> list[dict]:
    """A bag in vla_sim_demos' layout through the shared writer; returns what went in, per episode."""
    truth, start = [], bag_writer.DEFAULT_START_NS
    with bag_writer.BagWriter(path, storage) as bag:
        for e in range(episodes):
            frames, actions = square_frames(steps, hw, seed=seed * 1000 + e)
            stamps = bag_writer.episode_stamps(start, steps, rate_hz)
            instruction = INSTRUCTIONS[e % 2]

            def write_images(i, stamp, frames=frames):
                if images in ("raw", "both"):
                    bag.raw_image(bag_writer.TOPIC_IMAGE, frames[i], stamp, "sim_camera")
                if images in ("png", "both"):
                    from vla_edge_ros.sim.demos import _png
                    bag.compressed_image(bag_writer.TOPIC_IMAGE, _png(frames[i]), "png", stamp)

            bag_writer.write_episode(bag, e, actions, [instruction] * steps, stamps, write_images,
                                     start_fields={"task": "reach", "seed": 100 + e, "rate_hz": rate_hz},
                                     end_fields={"success": e != 1, "seed": 100 + e})
            truth.append({"frames": frames, "actions": actions, "stamps": stamps, "instruction": instruction,
                          "seed": 100 + e, "success": e != 1})
            start = bag_writer.next_episode_start(stamps, rate_hz, 0.5)
    return truth


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_sim_layout_round_trip(tmp_path, storage):
    truth = write_demo_bag(tmp_path / "bag", episodes=3, steps=5, storage=storage)
    episodes, summary = read_episodes(tmp_path / "bag")
    assert summary.image_topic == "/camera/image_raw" and not summary.skipped and not summary.notes
    assert (summary.episodes, summary.steps) == (3, 15)
    assert summary.messages["/vla/recorded_action"] == 15 and summary.messages["/camera/image_raw"] == 15
    for ep, want in zip(episodes, truth):
        np.testing.assert_array_equal(ep.frames, want["frames"])
        np.testing.assert_allclose(ep.actions, want["actions"])
        assert ep.stamps_ns.tolist() == want["stamps"]
        assert np.diff(ep.stamps_ns).tolist() == [100_000_000] * 4  # the control rate
        assert ep.instructions == [want["instruction"]] * 5 and ep.instruction == want["instruction"]
        assert ep.success is want["success"] and ep.start["seed"] == ep.end["seed"] == want["seed"]
        assert ep.start["task"] == "reach" and ep.end["steps"] == 5
    # each gripper crossing became a salient event at its step, as in OXE bags
    msgs, types = oxe_to_bag_messages(tmp_path / "bag")
    assert types["/vla/episode_events"] == "std_msgs/msg/String"
    events = [json.loads(m.data) for m in msgs["/vla/episode_events"]]
    got = [(ev["episode"], ev["step"], ev["event"]) for ev in events if ev["event"].startswith("gripper")]
    want = [(e, i, "gripper_open" if t["actions"][i, 6] >= 0.5 else "gripper_close")
            for e, t in enumerate(truth) for i in range(1, 5)
            if (t["actions"][i, 6] >= 0.5) != (t["actions"][i - 1, 6] >= 0.5)]
    assert got == want and want


def oxe_to_bag_messages(path):
    from rosbags.highlevel import AnyReader
    from rosbags.typesys import Stores, get_typestore

    out = {}
    with AnyReader([path], default_typestore=get_typestore(Stores.ROS2_JAZZY)) as r:
        for conn, _, raw in r.messages():
            out.setdefault(conn.topic, []).append(r.deserialize(raw, conn.msgtype))
        return out, {c.topic: c.msgtype for c in r.connections}


def test_png_frames_decode_to_the_same_pixels_and_raw_is_preferred(tmp_path):
    truth = write_demo_bag(tmp_path / "png", episodes=2, steps=3, images="png")
    episodes, summary = read_episodes(tmp_path / "png")
    assert summary.image_topic == "/camera/image_raw/compressed"
    np.testing.assert_array_equal(episodes[1].frames, truth[1]["frames"])  # PNG is lossless
    write_demo_bag(tmp_path / "both", episodes=1, steps=3, images="both")
    assert read_episodes(tmp_path / "both")[1].image_topic == "/camera/image_raw"


def test_oxe_layout_round_trip(tmp_path):
    src = rlds.write_synthetic_dataset(tmp_path / "src", "bridge_dataset", episodes=3, steps=6, image_hw=(24, 40))
    oxe_to_bag.convert(src, tmp_path / "bag", progress=False)
    episodes, summary = read_episodes(tmp_path / "bag")
    assert summary.image_topic == "/camera/image_raw/compressed" and not summary.skipped
    assert [e.steps for e in episodes] == [6, 6, 6]
    ds = rlds.RLDSDataset(src)
    for ep, src_ep in zip(episodes, ds.episodes()):
        np.testing.assert_allclose(ep.actions, rlds.synthetic_action(ep.index, 6), atol=1e-6)
        assert ep.frames.shape == (6, 24, 40, 3)
        want = oxe_to_bag.decode_image(bytes(src_ep.steps["observation/image_0"][2]))
        np.testing.assert_array_equal(ep.frames[2], want)  # the JPEG as stored, decoded once
        assert ep.instruction == f"synthetic task {ep.index % 2}: move the block"
        assert ep.success is None and ep.start["rate_hz"] == 5.0  # OXE bags say nothing about success
    assert np.diff(episodes[0].stamps_ns).tolist() == [200_000_000] * 5


def _bag_with_faults(path):
    """Two good episodes, then: an action without an image, an image without an action, a step after the last
    episode, an episode that never ends, and an end without a start."""
    frames, actions = square_frames(4)
    t = bag_writer.DEFAULT_START_NS
    with bag_writer.BagWriter(path) as bag:
        for e in range(2):
            stamps = bag_writer.episode_stamps(t + e * 10**9, 4, 10.0)
            bag_writer.write_episode(bag, e, actions, ["reach the red goal"] * 4, stamps,
                                     lambda i, s: bag.raw_image(bag_writer.TOPIC_IMAGE, frames[i], s))
        base = t + 5 * 10**9
        bag.action(actions[0], base)  # no image at this stamp (outside any episode too)
        bag.raw_image(bag_writer.TOPIC_IMAGE, frames[0], base + 1)  # no action
        bag.raw_image(bag_writer.TOPIC_IMAGE, frames[1], base + 2)
        bag.action(actions[1], base + 2)  # a complete step, outside any episode
        bag.event(base + 3, event="episode_start", episode=7, steps=1)  # never ends
        bag.event(base + 4, event="episode_end", episode=8, steps=1)  # never started


def test_skipped_messages_are_counted_by_reason(tmp_path):
    _bag_with_faults(tmp_path / "bag")
    episodes, summary = read_episodes(tmp_path / "bag")
    assert [e.steps for e in episodes] == [4, 4]
    assert dict(summary.skipped) == {"action_without_image": 1, "image_without_action": 1, "outside_episode": 1,
                                     "episode_without_end": 1, "end_without_start": 1}
    text = summary.text()
    assert "outside_episode 1" in text and "2 episodes, 8 steps" in text


def test_a_bag_without_events_is_one_episode_and_says_so(tmp_path):
    frames, actions = square_frames(3)
    with bag_writer.BagWriter(tmp_path / "plain") as bag:
        for i in range(3):
            bag.raw_image(bag_writer.TOPIC_IMAGE, frames[i], 1000 + i)
            bag.action(actions[i], 1000 + i)
    episodes, summary = read_episodes(tmp_path / "plain")
    assert len(episodes) == 1 and episodes[0].steps == 3 and episodes[0].instruction == ""
    assert any("no episode events" in n for n in summary.notes)


def test_refusals(tmp_path):
    with pytest.raises(BagReadError, match="no such"):
        read_episodes(tmp_path / "missing")
    with bag_writer.BagWriter(tmp_path / "names") as bag:
        bag.raw_image(bag_writer.TOPIC_IMAGE, np.zeros((4, 4, 3), np.uint8), 5)
        bag.action([0.0] * 7, 5, names=("a", "b", "c", "d", "e", "f", "g"))
    with pytest.raises(BagReadError, match="runtime's"):
        read_episodes(tmp_path / "names")
    with bag_writer.BagWriter(tmp_path / "noimg") as bag:
        bag.action([0.0] * 7, 5)
    with pytest.raises(BagReadError, match="no /camera/image_raw"):
        read_episodes(tmp_path / "noimg")
    with bag_writer.BagWriter(tmp_path / "x") as bag:
        with pytest.raises(ValueError, match="7 names"):
            bag.action([0.0] * 6, 5)
        with pytest.raises(ValueError, match="uint8"):
            bag.raw_image(bag_writer.TOPIC_IMAGE, np.zeros((4, 4, 3), np.float32), 5)
    with pytest.raises(FileExistsError):
        bag_writer.prepare_output(tmp_path / "x", overwrite=False)


def test_digest_follows_the_content(tmp_path):
    write_demo_bag(tmp_path / "a", episodes=1, steps=3)
    write_demo_bag(tmp_path / "b", episodes=1, steps=3, storage="sqlite3")  # same messages, other storage
    write_demo_bag(tmp_path / "c", episodes=1, steps=3, seed=1)  # other pixels and actions
    da, db, dc = (bag_reader.bag_digest([tmp_path / n]) for n in "abc")
    assert da == db != dc and len(da) == 64
    assert bag_reader.bag_digest([tmp_path / "a", tmp_path / "c"]) not in (da, dc)
