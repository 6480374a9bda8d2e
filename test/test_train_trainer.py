"""train/dataset.py and train/trainer.py: the runtime's contexts, a short deterministic run whose loss goes
down, and a written checkpoint that the numpy engine loads and acts with."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rosbags")

from test_bag_io import write_demo_bag  # noqa: E402
from vla_edge_ros.data.bag_reader import bag_digest, read_episodes  # noqa: E402
from vla_edge_ros.engine.config import DEFAULT_ACTION_NAMES, ModelConfig  # noqa: E402
from vla_edge_ros.engine.factory import make_engine  # noqa: E402
from vla_edge_ros.train import cli  # noqa: E402
from vla_edge_ros.train.dataset import START_BIN, ContextSpec, DemoDataset, end_bin  # noqa: E402
from vla_edge_ros.train.trainer import DeviceData, TrainConfig, train  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

TINY = dict(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, patch_grid=(2, 4), patch_size=8,
            batch_size=8, lr=3e-3, warmup_steps=2, eval_every=10, eval_samples=64, threads=1, progress=False)


@pytest.fixture(scope="module")
def bag(tmp_path_factory):
    path = tmp_path_factory.mktemp("bags") / "demo"
    write_demo_bag(path, episodes=6, steps=12, hw=(16, 32))
    return path


def run(bag, out, seed=0, steps=20, **kw):
    return train(TrainConfig(bags=[str(bag)], out=str(out), steps=steps, seed=seed, **{**TINY, **kw}),
                 log=lambda m: None)


def test_past_frames_are_what_eviction_leaves(bag):
    episodes, _ = read_episodes(bag)
    ds = DemoDataset(episodes, (16, 32), 512, 256, ContextSpec(max_past_frames=3, frame_stride=2), 0.2, seed=0)
    assert ds.past_indices(9, 3, None) == [3, 5, 7]  # the most recent, stride apart, oldest first
    assert ds.past_indices(3, 3, None) == [1]  # clipped at the episode start
    assert ds.past_indices(0, 3, None) == []
    sub = DemoDataset(episodes, (16, 32), 512, 256, ContextSpec(3, 1, "subset", subset_window=6), 0.2, seed=0)
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(50):
        p = sub.past_indices(11, 3, rng)
        assert len(p) == 3 and p == sorted(p) and len(set(p)) == 3 and all(5 <= i < 11 for i in p)
        seen.add(tuple(p))
    assert len(seen) > 5  # sparse subsets, not always the newest


def test_vectorised_past_frames_are_the_per_sample_rule(bag):
    episodes, _ = read_episodes(bag)
    ds = DemoDataset(episodes, (16, 32), 512, 256, ContextSpec(max_past_frames=3, frame_stride=2), 0.2, seed=0)
    t = np.arange(12).repeat(4)
    k = np.tile(np.arange(4), 12)
    got = ds.past_steps(t, k, None)
    assert got.shape == (48, 3)
    for row, ti, ki in zip(got, t, k):
        n = min(ki, ti // 2)  # the k most recent, 2 steps apart, clipped at the episode start
        want = [-1] * (3 - n) + [ti - 2 * j for j in range(n, 0, -1)]  # right-aligned, oldest first
        assert row.tolist() == want, (ti, ki, row)


def test_device_gather_is_the_numpy_batch(bag):
    """trainer.DeviceData gathers (shift by clamped indices) exactly what dataset.to_batch does, and to_batch's
    shift is an edge-padded crop."""
    episodes, _ = read_episodes(bag)
    ds = DemoDataset(episodes, (16, 32), 512, 256, ContextSpec(max_past_frames=2, shift_px=3), 0.2, seed=0)
    data = DeviceData(ds, torch.device("cpu"), tokens_per_frame=8)
    rng = np.random.default_rng(5)
    for _ in range(4):
        rows = ds.sample_rows(rng, 9)
        want, got = ds.to_batch(rows), data.batch(rows)
        assert (rows.shifts != 0).any()
        np.testing.assert_array_equal(got.frames.numpy(), want.frames)
        np.testing.assert_array_equal(got.targets.numpy(), want.targets)
        assert got.frame_counts.tolist() == want.frame_counts.tolist()
        for b, ids in enumerate(want.prefix_ids):
            assert got.prefix_lens[b] == len(ids) and got.prefix_ids[b, :len(ids)].tolist() == ids.tolist()
        assert got.context_len == max(len(p) + 8 * c for p, c in zip(want.prefix_ids, want.frame_counts))
    e, (dy, dx) = int(rows.episodes[0]), rows.shifts[0]
    frame = episodes[e].frames[rows.current[0]]
    padded = np.pad(frame, ((3, 3), (3, 3), (0, 0)), mode="edge")[3 + dy:3 + dy + 16, 3 + dx:3 + dx + 32]
    np.testing.assert_array_equal(want.frames[want.frame_counts[0] - 1], padded)


def test_photometric_augmentation(bag):
    """Brightness: one offset per sample for all its frames, the same in the numpy batch and the device gather;
    pixel noise (the device gather's) has the asked std, is seeded, and neither touches evaluation rows."""
    episodes, _ = read_episodes(bag)
    plain = DemoDataset(episodes, (16, 32), 512, 256, ContextSpec(max_past_frames=2, shift_px=3), 0.2, seed=0)
    ctx = ContextSpec(max_past_frames=2, shift_px=3, brightness=20.0)
    ds = DemoDataset(episodes, (16, 32), 512, 256, ctx, 0.2, seed=0)
    rows = ds.sample_rows(np.random.default_rng(5), 64)
    off = rows.brightness
    assert off.shape == (64,) and np.abs(off).max() <= 20.0 and off.std() > 5.0
    base = plain.to_batch(type(rows)(rows.episodes, rows.frames, rows.shifts))
    want = ds.to_batch(rows)
    first = np.repeat(off, want.frame_counts)
    expect = np.clip(base.frames + first[:, None, None, None], 0, 255)
    np.testing.assert_allclose(want.frames, expect)
    got = DeviceData(ds, torch.device("cpu"), tokens_per_frame=8).batch(rows)
    np.testing.assert_allclose(got.frames.numpy(), want.frames, atol=1e-4)  # pixel_noise 0: nothing else
    noisy = DemoDataset(episodes, (16, 32), 512, 256, ContextSpec(2, shift_px=3, pixel_noise=4.0), 0.2, seed=0)
    nrows = noisy.sample_rows(np.random.default_rng(5), 64)
    assert nrows.brightness is None and nrows.augmented
    ref = noisy.to_batch(nrows).frames
    g1 = DeviceData(noisy, torch.device("cpu"), 8, seed=1).batch(nrows).frames.numpy()
    g2 = DeviceData(noisy, torch.device("cpu"), 8, seed=1).batch(nrows).frames.numpy()
    np.testing.assert_array_equal(g1, g2)  # seeded
    inner = (ref > 20) & (ref < 235)  # away from the clip
    assert 3.5 < (g1 - ref)[inner].std() < 4.5
    ev = noisy.eval_rows(16, max_samples=16)[0]
    assert not ev.augmented and ev.brightness is None
    np.testing.assert_array_equal(DeviceData(noisy, torch.device("cpu"), 8).batch(ev).frames.numpy(),
                                  noisy.to_batch(ev).frames)
    with pytest.raises(ValueError, match="brightness"):
        ContextSpec(brightness=-1.0)


def test_split_quantiles_and_targets(bag):
    episodes, _ = read_episodes(bag)
    ds = DemoDataset(episodes, (16, 32), 512, 256, ContextSpec(), holdout_frac=0.34, seed=3)
    assert len(ds.heldout_idx) == 2 and not set(ds.heldout_idx) & set(ds.train_idx)
    train_actions = np.concatenate([episodes[i].actions for i in ds.train_idx])
    np.testing.assert_allclose(ds.q01, np.quantile(train_actions, 0.01, axis=0))
    np.testing.assert_allclose(ds.q99, np.quantile(train_actions, 0.99, axis=0))
    assert ds.varying_dims == [0, 1, 6]  # x, y and the gripper move; z roll pitch yaw are constant
    b = ds.sample(np.random.default_rng(0), 5)
    assert b.targets.shape == (5, 9) and (b.targets[:, 0] == START_BIN).all() and (b.targets[:, -1] == 255).all()
    assert end_bin(256) == 255 and b.frames.shape[1:] == (16, 32, 3) and b.frame_counts.sum() == len(b.frames)
    # a held-out step's targets are its action's bins
    e = ds.heldout_idx[0]
    one = ds.make_batch([(e, 4, [])], None)
    assert one.targets[0, 1:8].tolist() == ds.tokenizer.action_to_bins(episodes[e].actions[4]).tolist()
    np.testing.assert_array_equal(one.frames[0], episodes[e].frames[4])  # recorded at the model's size: as is


def test_short_run_is_deterministic_and_learns(bag, tmp_path):
    a = run(bag, tmp_path / "a", seed=0)
    b = run(bag, tmp_path / "b", seed=0)
    c = run(bag, tmp_path / "c", seed=1)
    assert a["losses"] == b["losses"] and len(a["losses"]) == 20
    assert a["losses"] != c["losses"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    first, last = np.mean(a["losses"][:3]), np.mean(a["losses"][-3:])
    assert first > 4.5 and last < 0.8 * first, a["losses"]  # ln 256 = 5.5 at the start
    held = a["figures"]["heldout"]
    assert set(held) == {"teacher_forced", "greedy", "greedy_full_context"}
    assert 0.0 <= held["greedy"]["action_token_acc"] <= 1.0 and held["teacher_forced"]["samples"] > 0
    assert [e["step"] for e in a["figures"]["evals"]] == [10, 20]


def test_checkpoint_record_and_curve(bag, tmp_path):
    rec = run(bag, tmp_path / "ck", steps=12)
    cfg = ModelConfig.from_json(tmp_path / "ck")
    ds_q = rec["data"]
    assert list(cfg.action_q01) == pytest.approx(ds_q["q01"]) and list(cfg.action_q99) == pytest.approx(ds_q["q99"])
    assert cfg.action_names == DEFAULT_ACTION_NAMES and cfg.n_action_bins == 256
    assert (cfg.patch_grid, cfg.patch_size, cfg.hidden_size, cfg.num_hidden_layers) == ((2, 4), 8, 32, 2)
    on_disk = json.loads((tmp_path / "ck" / "training_record.json").read_text())
    assert on_disk["data"]["sha256"] == bag_digest([bag]) and on_disk["seed"] == 0
    assert on_disk["command"] and "commit" in on_disk["git"] and on_disk["figures"]["time_per_step_ms"] > 0
    assert on_disk["deploy"]["max_retained_frames"] == 4 and on_disk["context"]["decode_targets"]["end_bin"] == 255
    assert (tmp_path / "ck" / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the runtime's engine loads it and acts, inside the data's range
    instruction = "reach the red goal"
    eng = make_engine({"backend": "numpy", "checkpoint": str(tmp_path / "ck"), "instruction": instruction,
                       "tokens_per_frame": 8, "kv_budget_tokens": 64, "eviction_policy": "sliding_window",
                       "window_frames": 4}, log=lambda m: None)
    episodes, _ = read_episodes(bag)
    for f, frame in enumerate(episodes[0].frames[:5]):
        r = eng.run_chunk(eng.encode_frame(frame), f)
        assert r.action.shape == (7,) and np.all(np.isfinite(r.action))
        assert np.all(r.action >= np.asarray(cfg.action_q01) - 1e-6)
        assert np.all(r.action <= np.asarray(cfg.action_q99) + 1e-6)
    assert len(eng.kv.frames) == 4


def test_cli(bag, tmp_path, capsys):
    rc = cli.main([str(bag), "--out", str(tmp_path / "o"), "--steps", "3", "--hidden", "32", "--layers", "1",
                   "--intermediate", "64", "--patch-grid", "2", "4", "--patch-size", "8", "--batch-size", "4",
                   "--threads", "1", "--no-progress", "--eval-samples", "16"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "held-out greedy" in out and "ms/step" in out
    rec = json.loads((tmp_path / "o" / "training_record.json").read_text())
    assert rec["command"].startswith("vla_train ") and "--steps 3" in rec["command"]
    assert cli.main([str(tmp_path / "nope"), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "no such" in capsys.readouterr().err


def test_init_checkpoint_continues_a_run_and_refuses_another_geometry(bag, tmp_path):
    a = run(bag, tmp_path / "a", seed=0, steps=20)
    # continuing at lr 0 leaves the weights as they were (AdamW's decay is scaled by lr too): the load is exact
    run(bag, tmp_path / "same", seed=0, steps=1, lr=0.0, init_checkpoint=str(tmp_path / "a"))
    wa = load_file(str(tmp_path / "a" / "model.safetensors"))
    ws = load_file(str(tmp_path / "same" / "model.safetensors"))
    assert set(wa) == set(ws) and all(np.array_equal(wa[k], ws[k]) for k in wa)
    # continuing with a learning rate starts from a's loss, not from a fresh init's ~ln 256
    b = run(bag, tmp_path / "b", seed=0, steps=5, init_checkpoint=str(tmp_path / "a"))
    assert b["losses"][0] < 0.8 * a["losses"][0], (b["losses"][0], a["losses"][0])
    with pytest.raises(ValueError, match="config differs.*hidden_size"):
        run(bag, tmp_path / "c", seed=0, steps=1, hidden=64, init_checkpoint=str(tmp_path / "a"))
