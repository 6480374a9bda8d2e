"""RLDS directory reading (features.json shapes, shards, damaged records) and the mapping table."""
import json
from pathlib import Path

import numpy as np
import pytest

from vla_edge_ros.data import mappings, rlds, tfrecord

SHARED_BRIDGE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "oxe"


@pytest.fixture(params=rlds.SYNTHETIC_LAYOUTS)
def synthetic(request, tmp_path):
    return request.param, rlds.write_synthetic_dataset(tmp_path, request.param, episodes=3, steps=6, shards=2)


def test_reads_synthetic_layouts_with_step_shapes(synthetic):
    layout, path = synthetic
    ds = rlds.RLDSDataset(path.parent.parent)  # found two levels below
    assert ds.root == path and ds.name == layout
    assert len(ds.shard_paths()) == 2
    issues = []
    eps = list(ds.episodes(issues=issues))
    assert issues == [] and len(eps) == 3
    for ep in eps:
        assert ep.num_steps == 6
        for key, spec in ds.step_specs.items():
            v = ep.steps[key]
            if spec.kind in ("image", "text"):
                assert isinstance(v, list) and len(v) == 6
            else:
                assert v.shape == (6,) + spec.shape, key
    m = mappings.mapping_for(ds.name, ds.version, ds.step_keys)
    # shards interleave episodes (0, 2 | 1): the sign of dx tells the synthetic episode parity
    for ep in eps:
        act = m.action(ep.steps)
        sign = 1 if act[0, 0] > 0 else -1
        expected = rlds.synthetic_action(0 if sign > 0 else 1, 6)
        np.testing.assert_allclose(act, expected, atol=1e-6)


def test_damaged_episode_is_skipped_and_reported(tmp_path):
    path = rlds.write_synthetic_dataset(tmp_path, "bridge_dataset", episodes=4, steps=5)
    shard = next(path.glob("*.tfrecord-*"))
    offsets = [o for o, _ in tfrecord.iter_records(shard)]
    raw = bytearray(shard.read_bytes())
    raw[offsets[2] + 40] ^= 0x55
    shard.write_bytes(bytes(raw))
    issues = []
    eps = list(rlds.RLDSDataset(path).episodes(issues=issues))
    assert len(eps) == 3 and [e.offset for e in eps] == [offsets[0], offsets[1], offsets[3]]
    assert len(issues) == 1 and issues[0].offset == offsets[2] and issues[0].kind == "data_crc"


def test_inconsistent_step_lengths_are_a_decode_issue(tmp_path):
    name, version, specs = rlds.synthetic_specs("bridge_dataset", (8, 8))
    good = {"observation/image_0": [b"\xff\xd8a"] * 2, "observation/state": np.zeros((2, 7)),
            "action": np.zeros((2, 7)), "language_instruction": ["x"] * 2, "is_first": [1, 0],
            "is_last": [0, 1], "reward": [0.0, 1.0]}
    bad = dict(good, action=np.zeros((3, 7)))  # 3 action steps, 2 of everything else
    path = rlds.write_rlds_dataset(tmp_path, name, version, specs, [good, bad, good])
    issues = []
    eps = list(rlds.RLDSDataset(path).episodes(issues=issues))
    assert len(eps) == 2
    assert issues[0].kind == "decode" and "disagree" in issues[0].message


def test_missing_metadata_gives_clear_errors(tmp_path):
    with pytest.raises(rlds.RLDSError, match="no dataset_info.json"):
        rlds.RLDSDataset(tmp_path)
    path = rlds.write_synthetic_dataset(tmp_path, "bridge_dataset", episodes=1, steps=2)
    (path / "features.json").unlink()
    with pytest.raises(rlds.RLDSError, match="features.json is missing"):
        rlds.RLDSDataset(path)
    with pytest.raises(rlds.RLDSError, match="no such directory"):
        rlds.RLDSDataset(tmp_path / "nope")


def test_missing_shards_are_an_error(tmp_path):
    path = rlds.write_synthetic_dataset(tmp_path, "bridge_dataset", episodes=1, steps=2)
    for p in path.glob("*.tfrecord-*"):
        p.unlink()
    with pytest.raises(rlds.RLDSError, match="shard"):
        rlds.RLDSDataset(path).shard_paths()


def test_features_tree_round_trip():
    _, _, specs = rlds.synthetic_specs("fractal20220817_data")
    assert sorted(rlds.parse_features(json.loads(json.dumps(rlds.features_tree(specs)))),
                  key=lambda s: s.key) == sorted(specs, key=lambda s: s.key)


def test_mapping_table_covers_required_datasets_and_layouts():
    for key in [("bridge_dataset", "1.0.0"), ("bridge", "0.1.0"), ("fractal20220817_data", "0.1.0"),
                ("taco_play", "0.1.0")]:
        assert key in mappings.MAPPINGS
    nested = ["observation/image", "observation/natural_language_instruction", "action/world_vector",
              "action/rotation_delta", "action/open_gripper", "action/terminate_episode"]
    flat = ["observation/image_0", "language_instruction", "action"]
    assert mappings.mapping_for("bridge", "0.1.0", nested).layout == "OXE bucket layout"
    assert mappings.mapping_for("bridge", "0.1.0", flat).layout == "TFDS catalog layout"
    with pytest.raises(mappings.MappingError, match="missing"):
        mappings.mapping_for("fractal20220817_data", "0.1.0", flat)
    with pytest.raises(mappings.MappingError, match="--image-key"):
        mappings.mapping_for("mystery", "1.0", flat)


def test_gripper_transforms_and_action_width():
    taco = mappings.MAPPINGS[("taco_play", "0.1.0")][0]
    steps = {"action/rel_actions_world": np.array([[0, 0, 0, 0, 0, 0, -1], [0, 0, 0, 0, 0, 0, 1]], np.float32)}
    np.testing.assert_array_equal(taco.action(steps)[:, 6], [1.0, 0.0])  # -1 open -> 1, +1 close -> 0
    m = mappings.custom_mapping("x", "1", ["img"], None, "a[0:3],b", 10.0)
    with pytest.raises(mappings.MappingError, match="need 7"):
        m.action({"a": np.zeros((2, 6)), "b": np.zeros((2, 2))})
    out = m.action({"a": np.arange(12, dtype=np.float32).reshape(2, 6), "b": np.ones((2, 4))})
    np.testing.assert_array_equal(out[1], [6, 7, 8, 1, 1, 1, 1])
    assert str(mappings.ActionPart.parse("action/x[1:]")) == "action/x[1:]"


@pytest.mark.skipif(not (SHARED_BRIDGE / "bridge_dataset").is_dir(), reason="../shared/data/oxe not present")
def test_real_bridge_sample():
    ds = rlds.RLDSDataset(SHARED_BRIDGE)
    assert (ds.name, ds.version) == ("bridge_dataset", "1.0.0")
    issues = []
    eps = list(ds.episodes(issues=issues))
    assert len(eps) == 25 and issues == []
    assert all(e.num_steps == 10 for e in eps)
    ep = eps[0]
    assert ep.steps["action"].shape == (10, 7) and ep.steps["language_embedding"].shape == (10, 512)
    assert ep.steps["observation/image_0"][0][:3] == b"\xff\xd8\xff"
    assert bool(ep.steps["is_first"][0]) and not ep.steps["is_first"][1:].any()
    instructions = {e.steps["language_instruction"][0] for e in eps}
    assert "put carrot on plate" in instructions and len(instructions) == 4
    m = mappings.mapping_for(ds.name, ds.version, ds.step_keys)
    assert m.rate_hz == 5.0 and set(np.unique(m.action(ep.steps)[:, 6])) <= {0.0, 1.0}
