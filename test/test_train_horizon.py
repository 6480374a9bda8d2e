"""Training action chunks (issue 22, training side): targets [START, bins(t), .., bins(t+H-1), END] with the steps
past an episode's end masked out, the numpy batch and the device gather equal, H = 1 unchanged, the loss blind to
padded targets, action_horizon in config.json, an H = 1 checkpoint seeding an H = 2 run, and TorchStream's chunk
held to the numpy engine's decode stream on the same weights."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rosbags")

from test_bag_io import write_demo_bag  # noqa: E402
from test_train_trainer import TINY  # noqa: E402
from vla_edge_ros.core.kv.manager import KVManager  # noqa: E402
from vla_edge_ros.data.bag_reader import BagEpisode  # noqa: E402
from vla_edge_ros.engine.checkpoint import write_checkpoint  # noqa: E402
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict  # noqa: E402
from vla_edge_ros.engine.factory import make_engine  # noqa: E402
from vla_edge_ros.train import cli  # noqa: E402
from vla_edge_ros.train.dataset import START_BIN, ContextSpec, DemoDataset  # noqa: E402
from vla_edge_ros.train.model import TorchStream, VLAPolicy  # noqa: E402
from vla_edge_ros.train.trainer import DeviceData, TrainConfig, batch_loss, greedy_bins, train  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

INSTRUCTION = "reach the red goal"
P = len(INSTRUCTION.encode())
TPF = 8  # patch_grid [2, 4] of 8 px: 16 x 32 images
END = 255
BUDGET = 56  # tokens: the prefix and 4 frames (whole frames of 8)


def episode(steps: int, seed: int) -> BagEpisode:
    """Distinct actions per step (x rises, y falls, gripper alternates), so a wrong step or episode shows."""
    rng = np.random.default_rng(seed)
    actions = np.zeros((steps, 7))
    actions[:, 0] = 0.01 * np.arange(steps) + 0.001 * seed
    actions[:, 1] = -0.01 * np.arange(steps)
    actions[:, 6] = np.arange(steps) % 2
    return BagEpisode(index=seed, instructions=[INSTRUCTION] * steps,
                      frames=rng.integers(0, 256, (steps, 16, 32, 3), dtype=np.uint8), actions=actions,
                      stamps_ns=np.arange(steps))


def dataset(horizon: int, shift_px: int = 0, max_past: int = 2) -> tuple[DemoDataset, list[BagEpisode]]:
    eps = [episode(4, 0), episode(6, 1)]
    return DemoDataset(eps, (16, 32), 512, 256, ContextSpec(max_past_frames=max_past, shift_px=shift_px),
                       holdout_frac=0.0, horizon=horizon), eps


def test_targets_for_h3_are_consecutive_steps_and_the_episode_end_is_masked():
    ds, eps = dataset(3)
    bins = [ds.tokenizer.action_to_bins(e.actions) for e in eps]  # (T, 7) per episode, tokenised here
    assert all(len({tuple(r) for r in b}) == len(b) for b in bins)  # every step's bins differ
    T, M = True, False
    steps = np.array([[1, 0], [1, 2], [0, 1], [0, 2], [0, 3]])
    targets, mask = ds.chunk_targets(steps[:, 0], steps[:, 1])
    assert targets.shape == mask.shape == (5, 3 * 7 + 2)
    # inside the episode: START, steps t, t+1, t+2 time-major, END; all in the loss
    assert targets[0].tolist() == [START_BIN, *bins[1][0], *bins[1][1], *bins[1][2], END]
    assert targets[1].tolist() == [START_BIN, *bins[1][2], *bins[1][3], *bins[1][4], END]
    assert targets[2].tolist() == [START_BIN, *bins[0][1], *bins[0][2], *bins[0][3], END]  # ends at the last step
    assert mask[:3].all()
    # past the end (episode 0 has 4 steps): the last action's bins repeated as inputs, masked with END
    assert targets[3].tolist() == [START_BIN, *bins[0][2], *bins[0][3], *bins[0][3], END]
    assert mask[3].tolist() == [T] + [T] * 14 + [M] * 7 + [M]
    assert targets[4].tolist() == [START_BIN, *bins[0][3], *bins[0][3], *bins[0][3], END]
    assert mask[4].tolist() == [T] + [T] * 7 + [M] * 14 + [M]
    # the dataset's count of padded steps is what the masks say over every sample
    everything = np.array([(e, t) for e in range(2) for t in range(eps[e].steps)])
    _, m = ds.chunk_targets(everything[:, 0], everything[:, 1])
    assert ds.padded_steps() == {"train": 6, "heldout": 0} == {"train": int((~m[:, 1:-1]).sum()) // 7, "heldout": 0}
    with pytest.raises(ValueError, match="outside its episode"):
        ds.chunk_targets(np.array([0]), np.array([4]))
    with pytest.raises(ValueError, match="horizon"):
        DemoDataset(eps, (16, 32), 512, 256, horizon=0)


def test_numpy_batch_equals_the_device_gather_with_padding():
    ds, eps = dataset(3, shift_px=2)
    data = DeviceData(ds, torch.device("cpu"), tokens_per_frame=TPF)
    rng = np.random.default_rng(0)
    padded = 0
    for k in (0, 2):
        steps = np.array([(e, t) for e in range(2) for t in range(eps[e].steps)])  # the end steps included
        rows = ds.rows(steps[rng.permutation(len(steps))], k, rng)
        want, got = ds.to_batch(rows), data.batch(rows)
        np.testing.assert_array_equal(got.targets.numpy(), want.targets)
        np.testing.assert_array_equal(got.target_mask.numpy(), want.target_mask)
        np.testing.assert_array_equal(got.frames.numpy(), want.frames)
        padded += int((~want.target_mask).sum())
    assert padded == 2 * (6 * 7 + 4)  # 6 padded steps and 4 padded ENDs per pass
    for _ in range(3):  # and on sampled training batches
        rows = ds.sample_rows(rng, 7)
        np.testing.assert_array_equal(data.batch(rows).target_mask.numpy(), ds.to_batch(rows).target_mask)
        np.testing.assert_array_equal(data.batch(rows).targets.numpy(), ds.to_batch(rows).targets)


def test_h1_batches_are_the_single_step_layout_and_the_same_draws():
    one, eps = dataset(1, shift_px=2)
    three, _ = dataset(3, shift_px=2)
    r1, r3 = one.sample_rows(np.random.default_rng(4), 16), three.sample_rows(np.random.default_rng(4), 16)
    for a, b in ((r1.episodes, r3.episodes), (r1.frames, r3.frames), (r1.shifts, r3.shifts)):
        np.testing.assert_array_equal(a, b)  # H does not change what a seed draws
    b1 = one.to_batch(r1)
    bins = [one.tokenizer.action_to_bins(e.actions) for e in eps]
    want = np.array([[START_BIN, *bins[e][t], END] for e, t in zip(r1.episodes, r1.current)])
    np.testing.assert_array_equal(b1.targets, want)
    assert b1.target_mask.shape == (16, 9) and b1.target_mask.all()
    d1 = DeviceData(one, torch.device("cpu"), TPF).batch(r1)
    np.testing.assert_array_equal(d1.targets.numpy(), want)
    np.testing.assert_array_equal(three.to_batch(r3).targets[:, :8], want[:, :8])  # step 0 = the H = 1 action


def tiny_cfg(horizon: int = 1, action_start: str = "token") -> ModelConfig:
    d = tiny_default_dict()
    d.update(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, tie_word_embeddings=True)
    d["vla"].update(patch_grid=[2, 4], patch_size=8, action_horizon=horizon, action_start=action_start)
    return ModelConfig.from_json(d)


def test_padded_targets_do_not_contribute_to_the_loss():
    ds, eps = dataset(3)
    cfg = tiny_cfg(3)
    policy = VLAPolicy(cfg).init_weights(0, std=0.1)
    data = DeviceData(ds, torch.device("cpu"), TPF)
    rows = ds.rows(np.array([[0, 3], [0, 2], [1, 1]]), 1, None, augment=False)
    b = data.batch(rows)
    assert not b.target_mask.all()
    with torch.no_grad():
        loss, logits, _ = batch_loss(policy, b)
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), b.targets.reshape(-1), reduction="none")
        m = b.target_mask.reshape(-1)
        assert float(loss) == pytest.approx(float(ce[m].mean()), rel=1e-6)
        assert float(loss) != pytest.approx(float(ce.mean()), rel=1e-3)  # the mask matters here
        # a different padded target (not an input: only the last, END of a padded chunk) leaves the loss
        b.targets[0, -1] = 17
        assert float(batch_loss(policy, b)[0]) == float(loss)
        b.targets[2, -1] = 17  # an unpadded END does count
        assert float(batch_loss(policy, b)[0]) != pytest.approx(float(loss), rel=1e-6)
        # a padded step's targets feed only later padded rows as inputs: changing them leaves the loss too
        b2 = data.batch(rows)
        pad = ~b2.target_mask[0]
        b2.targets[0, pad] = (b2.targets[0, pad] + 50) % 256
        assert float(batch_loss(policy, b2)[0]) == pytest.approx(float(loss), rel=1e-6)
    with pytest.raises(ValueError, match="disagree on H"):
        batch_loss(VLAPolicy(tiny_cfg(2)).init_weights(0), b)


@pytest.fixture(scope="module")
def bag(tmp_path_factory):
    path = tmp_path_factory.mktemp("bags") / "demo"
    write_demo_bag(path, episodes=6, steps=12, hw=(16, 32))
    return path


def test_h2_run_writes_its_horizon_learns_and_reports_per_step(bag, tmp_path):
    rec = train(TrainConfig(bags=[str(bag)], out=str(tmp_path / "h2"), steps=20, seed=0, action_horizon=2,
                            **TINY), log=lambda m: None)
    on_disk = json.loads((tmp_path / "h2" / "config.json").read_text())
    assert on_disk["vla"]["action_horizon"] == 2 and ModelConfig.from_json(tmp_path / "h2").action_horizon == 2
    losses = rec["losses"]
    assert np.all(np.isfinite(losses)) and np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    g = rec["figures"]["heldout"]["greedy"]
    assert g["action_horizon"] == 2 and len(g["action_token_acc_varying_dims_per_step"]) == 2
    assert set(g["step0"]) >= {"action_token_acc", "bin_mae_varying_dims", "action_mae_per_dim"}
    assert g["padded_steps"] > 0  # held-out samples at an episode's last step
    assert rec["context"]["decode_targets"]["rows"] == 16 and rec["deploy"]["action_horizon"] == 2
    d = rec["data"]  # H = 2: one padded step per episode (its last step's chunk)
    assert d["padded_chunk_steps"] == {"train": d["train_episodes"], "heldout": d["heldout_episodes"]} != {}
    assert d["train_episodes"] == 5


def test_an_h1_checkpoint_initialises_an_h2_run(bag, tmp_path, capsys):
    train(TrainConfig(bags=[str(bag)], out=str(tmp_path / "h1"), steps=10, seed=0, **TINY), log=lambda m: None)
    assert ModelConfig.from_json(tmp_path / "h1").action_horizon == 1
    rc = cli.main([str(bag), "--out", str(tmp_path / "h2"), "--steps", "1", "--lr", "0", "--hidden", "32",
                   "--layers", "2", "--intermediate", "64", "--patch-grid", "2", "4", "--patch-size", "8",
                   "--batch-size", "4", "--threads", "1", "--no-progress", "--eval-samples", "16",
                   "--action-horizon", "2", "--init-checkpoint", str(tmp_path / "h1")])
    assert rc == 0, capsys.readouterr().err
    assert ModelConfig.from_json(tmp_path / "h2").action_horizon == 2
    w1, w2 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("h1", "h2"))
    assert set(w1) == set(w2) and all(np.array_equal(w1[k], w2[k]) for k in w1)  # lr 0: the load is exact
    with pytest.raises(ValueError, match="config differs.*intermediate_size"):  # other geometry: still refused
        train(TrainConfig(bags=[str(bag)], out=str(tmp_path / "x"), steps=1, action_horizon=2,
                          init_checkpoint=str(tmp_path / "h1"), **{**TINY, "intermediate": 96}), log=lambda m: None)


def images(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (16, 32, 3), dtype=np.uint8) for _ in range(n)]


def test_torch_stream_chunk_is_the_engines_decode_stream(tmp_path):
    """H = 2: S = max(8, A + 1) = 15 decode steps and bins = gen[1..14] as (2, 7); the numpy engine on the same
    tensors (an H = 1 config, decode_tokens 15) decodes the same greedy stream. decode_tokens 20 > A + 1: 20."""
    h1, h2 = tiny_cfg(1), tiny_cfg(2)
    policy = VLAPolicy(h2).init_weights(0, std=0.1).eval()
    write_checkpoint(tmp_path, h1.to_dict(), policy.export_tensors(), dtype="float32")
    eng = make_engine({"backend": "numpy", "checkpoint": str(tmp_path), "instruction": INSTRUCTION,
                       "tokens_per_frame": TPF, "decode_tokens": 15, "kv_budget_tokens": BUDGET,
                       "eviction_policy": "fifo"},
                      log=lambda m: None)
    stream = TorchStream(policy, KVManager(BUDGET, TPF, P, "fifo", embed_dim=32), INSTRUCTION, decode_tokens=8)
    long = TorchStream(policy, KVManager(BUDGET, TPF, P, "fifo", embed_dim=32), INSTRUCTION, decode_tokens=20)
    off = h2.action_token_offset
    chunks = set()
    for f, img in enumerate(images(5)):
        tokens = eng.encode_frame(img)
        r, s, s20 = eng.run_chunk(tokens, f), stream.run_chunk(tokens, f), long.run_chunk(tokens, f)
        assert len(s["token_ids"]) == 16 and len(s20["token_ids"]) == 21
        assert s["token_ids"].tolist() == r.token_ids.tolist() == s20["token_ids"][:16].tolist()
        assert s["chunk_bins"].tolist() == (r.token_ids[1:15] - off).reshape(2, 7).tolist()
        assert s["chunk"].shape == (2, 7) and np.array_equal(s["chunk"][0], s["action"])
        assert s["action_bins"].tolist() == r.action_bins.tolist()
        np.testing.assert_allclose(s["action"], r.action)
        chunks.add(tuple(s["chunk_bins"].ravel()))
    assert len(chunks) > 1  # frames matter: not a constant output


def test_torch_stream_prefill_shape_is_the_engines(tmp_path):
    """action_start "prefill" (issue 23): bins = gen[0..A-1], A - 1 decode steps, as the numpy engine."""
    cfg = tiny_cfg(1, "prefill")
    policy = VLAPolicy(cfg).init_weights(1, std=0.1).eval()
    write_checkpoint(tmp_path, cfg.to_dict(), policy.export_tensors(), dtype="float32")
    eng = make_engine({"backend": "numpy", "checkpoint": str(tmp_path), "instruction": INSTRUCTION,
                       "tokens_per_frame": TPF, "kv_budget_tokens": BUDGET, "eviction_policy": "fifo"},
                      log=lambda m: None)
    stream = TorchStream(policy, KVManager(BUDGET, TPF, P, "fifo", embed_dim=32), INSTRUCTION)
    for f, img in enumerate(images(3, seed=2)):
        tokens = eng.encode_frame(img)
        r, s = eng.run_chunk(tokens, f), stream.run_chunk(tokens, f)
        assert len(s["token_ids"]) == 7 and s["token_ids"].tolist() == r.token_ids.tolist()
        assert s["action_bins"].tolist() == r.action_bins.tolist()


def test_greedy_bins_decode_the_chunk_the_stream_decodes():
    """trainer.greedy_bins (A + 2 full passes) on a sample with the whole episode so far as context gives the
    streaming chunk's gen[0..A+1] (no eviction yet: the same computation)."""
    ds, eps = dataset(2, max_past=3)
    cfg = tiny_cfg(2)
    policy = VLAPolicy(cfg).init_weights(0, std=0.1).eval()
    data = DeviceData(ds, torch.device("cpu"), TPF)
    stream = TorchStream(policy, KVManager(BUDGET + 4 * TPF, TPF, P, "fifo", embed_dim=32), INSTRUCTION)
    off = cfg.action_token_offset
    for t in range(4):
        s = stream.run_chunk(stream.encode_frame(eps[1].frames[t]), t)
        rows = ds.rows(np.array([[1, t]]), t, None, augment=False)
        assert rows.frames[0].tolist()[-(t + 1):] == list(range(t + 1))
        assert greedy_bins(policy, data.batch(rows))[0].tolist() == (s["token_ids"] - off).tolist()
