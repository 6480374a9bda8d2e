"""bench/quant_report.py's frame sources (bench/quant_frames.py: noise, the real Bridge clip, MetaWorld) and its
streaming action agreement against the bf16 model (issue 23), on tiny random models and the shipped policy."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

import vla_edge_ros.sim  # noqa: F401  first: it selects MUJOCO_GL=egl before mujoco is imported (sim test)
from vla_edge_ros.bench import quant_frames as QF
from vla_edge_ros.bench import quant_report as QR
from vla_edge_ros.engine.checkpoint import write_checkpoint
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict

from test_numpy_engine import random_weights  # non-degenerate weights

SHARED_BRIDGE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "oxe"
BRIDGE_INSTRUCTIONS = {"put carrot on plate", "flip pot upright which is in sink",
                       "put cup from counter or drying rack into sink", "turn lever vertical to front"}  # its README


def cfg_dict(horizon=1, action_start="prefill", tied=False, hidden=64, inter=128):
    d = tiny_default_dict()
    d.update(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=inter, max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=tied)
    d["vla"].update(action_horizon=horizon, action_start=action_start)
    return d


# ---- frame sources ----------------------------------------------------------------------------------------------

def test_random_frames_are_one_seeded_sequence_of_uint8_images():
    (seq,) = QF.random_sequences(4, seed=1)
    assert seq.instruction == QR.INSTRUCTION and len(seq.frames) == 4
    assert all(f.shape == (120, 160, 3) and f.dtype == np.uint8 for f in seq.frames)
    again, other = QF.random_sequences(4, seed=1)[0], QF.random_sequences(4, seed=2)[0]
    assert all(np.array_equal(a, b) for a, b in zip(seq.frames, again.frames))
    assert not np.array_equal(seq.frames[0], other.frames[0]) and not np.array_equal(seq.frames[0], seq.frames[1])
    with pytest.raises(ValueError, match="frames must be >= 1"):
        QF.random_sequences(0)


@pytest.mark.skipif(not (SHARED_BRIDGE / "bridge_dataset").is_dir(), reason="../shared/data/oxe not present")
def test_bridge_frames_are_consecutive_frames_of_one_episode_with_its_instruction():
    from PIL import Image

    from vla_edge_ros.data import rlds

    seqs = QF.bridge_sequences(SHARED_BRIDGE, episodes=2, max_frames=5)
    episodes = list(rlds.RLDSDataset(SHARED_BRIDGE).episodes(limit=2))
    assert [s.meta["episode"] for s in seqs] == [0, 1]
    for seq, ep in zip(seqs, episodes):
        assert len(seq.frames) == 5 and all(f.shape == (64, 64, 3) and f.dtype == np.uint8 for f in seq.frames)
        assert seq.instruction in BRIDGE_INSTRUCTIONS and seq.meta["instruction_from"] == "episode"
        assert seq.instruction == ep.steps["language_instruction"][0]
        for i in (0, 4):  # step i of THIS episode, decoded independently
            with Image.open(io.BytesIO(ep.steps["observation/image_0"][i])) as im:
                np.testing.assert_array_equal(seq.frames[i], np.asarray(im.convert("RGB")))
        assert any(not np.array_equal(a, b) for a, b in zip(seq.frames, seq.frames[1:]))  # the scene moves
    assert len(QF.bridge_sequences(SHARED_BRIDGE, episodes=1)[0].frames) == 10  # default: the whole episode
    with pytest.raises(ValueError, match="asked for 26 episodes, 25 readable"):
        QF.bridge_sequences(SHARED_BRIDGE, episodes=26, max_frames=1)


def test_missing_bridge_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no RLDS dataset"):
        QF.bridge_sequences(tmp_path / "absent")


def test_sim_frames_follow_the_expert_every_kth_step():
    pytest.importorskip("metaworld")
    from vla_edge_ros.sim.tasks import TASKS
    try:
        seqs = QF.sim_sequences("push", seeds=2, seed_start=0, every=5, max_frames=3, image_hw=(64, 128))
    except RuntimeError as exc:
        if "GL" in str(exc):
            pytest.skip(f"no offscreen GL: {exc}")
        raise
    assert [s.meta["seed"] for s in seqs] == [0, 1]
    for seq in seqs:
        assert seq.instruction == TASKS["push"].instruction and len(seq.frames) == 3
        assert all(f.shape == (64, 128, 3) and f.dtype == np.uint8 for f in seq.frames)
        assert seq.meta["expert_steps"] >= 11 and not np.array_equal(seq.frames[0], seq.frames[2])  # the arm moved
    assert not np.array_equal(seqs[0].frames[0], seqs[1].frames[0])  # another seed, another scene
    (dense,) = QF.sim_sequences("push", seeds=1, seed_start=0, every=1, max_frames=11, image_hw=(64, 128))
    for got, want in zip(seqs[0].frames, dense.frames[::5]):  # steps 0, 5, 10 of the same rollout
        np.testing.assert_array_equal(got, want)


# ---- the agreement arithmetic -----------------------------------------------------------------------------------

def test_streaming_agreement_figures_from_known_differences():
    rng = np.random.default_rng(0)
    base = rng.integers(10, 200, (4, 2, 3))  # 4 chunks, H = 2, 3 dims
    other = base.copy()
    other[1, 0, 2] += 3
    other[3, 1, 0] -= 1
    a = QR.streaming_agreement(base, other, base * 0.01, other * 0.01)
    assert a["chunks"] == 4 and a["chunk_action_agreement"] == 0.5 and a["bin_agreement"] == 22 / 24
    assert a["bin_agreement_per_dim"] == [7 / 8, 1.0, 7 / 8]
    assert a["bin_agreement_per_step_dim"] == [[1.0, 1.0, 0.75], [0.75, 1.0, 1.0]]
    assert a["mean_abs_bin_diff_per_dim"] == [1 / 8, 0.0, 3 / 8] and a["max_abs_bin_diff"] == 3
    np.testing.assert_allclose(a["max_action_diff_per_dim"], [0.01, 0.0, 0.03], rtol=1e-9)
    assert a["max_action_diff"] == pytest.approx(0.03)
    with pytest.raises(ValueError, match=r"\(N, H, dims\)"):
        QR.streaming_agreement(base, other[:3], base, other[:3])


# ---- streaming on tiny random models ----------------------------------------------------------------------------

@pytest.mark.parametrize("horizon", [1, 2])
def test_self_agreement_is_exact_and_action_embedding_noise_spares_only_the_prefill_bin(horizon):
    """action_start "prefill": bin (0, 0) of a chunk is the prefill's argmax, which never reads an action-token
    embedding (the prefix is byte tokens, the frame is vision tokens, decode tokens are not retained). Noise on
    the action-token embedding rows of an untied model (the head untouched) must therefore leave exactly that
    bin equal in every chunk and change the later ones; a bin taken from the wrong step, or a decode token kept
    in the context, breaks it."""
    cfg = ModelConfig.from_json(cfg_dict(horizon))
    w = random_weights(cfg, seed=4)
    noisy = dict(w)
    emb = w["model.embed_tokens.weight"].copy()
    emb[cfg.action_token_offset:] += np.random.default_rng(5).normal(0, 0.3, emb[cfg.action_token_offset:].shape)
    noisy["model.embed_tokens.weight"] = emb.astype(np.float32)
    seqs = QF.random_sequences(3, seed=3, instruction="pick up") + QF.random_sequences(2, seed=4, instruction="go")
    rows = QR.measure(cfg, w, {"self": dict(w), "noisy": noisy}, seqs, decode_tokens=8, window_frames=2)
    me, nz = rows["self"], rows["noisy"]
    assert me["chunks"] == nz["chunks"] == 5
    assert np.shape(me["bin_agreement_per_step_dim"]) == (horizon, 7)
    assert me["chunk_action_agreement"] == me["bin_agreement"] == me["token_agreement"] == 1.0
    assert me["bin_agreement_per_dim"] == [1.0] * 7 and me["mean_abs_bin_diff_per_dim"] == [0.0] * 7
    assert me["max_action_diff"] == 0.0 and min(me["hidden_cos"] + me["logits_cos"]) > 1 - 1e-12

    per_step = np.asarray(nz["bin_agreement_per_step_dim"])
    assert per_step[0, 0] == 1.0 and nz["hidden_cos"][0] > 1 - 1e-12  # the prefill: untouched
    assert nz["bin_agreement"] < 1.0 and nz["chunk_action_agreement"] < 1.0 and min(nz["hidden_cos"][1:]) < 0.999
    np.testing.assert_allclose(nz["bin_agreement_per_dim"], per_step.mean(axis=0))
    assert nz["chunk_action_agreement"] <= per_step.min()
    for d in range(7):  # a dimension agrees everywhere <=> no bin differs <=> no action differs (q01 < q99)
        full = nz["bin_agreement_per_dim"][d] == 1.0
        assert full == (nz["mean_abs_bin_diff_per_dim"][d] == 0.0) == (nz["max_action_diff_per_dim"][d] == 0.0)
    # the action units: a bin step is (q99 - q01) / n_bins; the largest difference is a whole number of steps
    step = (np.asarray(cfg.action_q99) - np.asarray(cfg.action_q01)) / cfg.n_action_bins
    bins_moved = np.asarray(nz["max_action_diff_per_dim"]) / step
    np.testing.assert_allclose(bins_moved, np.round(bins_moved), atol=1e-3)
    assert bins_moved.max() <= nz["max_abs_bin_diff"] + 1e-3


def test_kv_window_holds_exactly_the_asked_frames():
    cfg = ModelConfig.from_json(cfg_dict())
    for window in (1, 2, 5):
        assert QR.kv_manager(cfg, "push the puck", window).capacity_frames == window


def test_json_holds_the_sequences_and_every_dtype_side_by_side(tmp_path, capsys):
    cfg = ModelConfig.from_json(cfg_dict(hidden=128, inter=256))
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, cfg_dict(hidden=128, inter=256), random_weights(cfg, seed=1), dtype="float32")
    (ckpt / "training_record.json").write_text(json.dumps({"deploy": {"window_frames": 2}}))
    out = tmp_path / "q.json"
    QR.main(["--checkpoint", str(ckpt), "--frames", "3", "--seed", "7", "--dtypes", "bf16", "int4",
             "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["frames_from"] == "random" and doc["window_frames"] == 2 and "training_record" in doc["window_from"]
    assert doc["action_names"] == list(cfg.action_names) and doc["decode_steps"] == 6  # prefill: 7 bins
    assert [(s["frames"], s["frame_shape"], s["instruction"]) for s in doc["sequences"]] == \
        [(3, [120, 160, 3], QR.INSTRUCTION)]
    assert list(doc["dtypes"]) == ["bf16", "int4"]
    bf, i4 = doc["dtypes"]["bf16"], doc["dtypes"]["int4"]
    assert bf["chunk_action_agreement"] == 1.0 and bf["max_action_diff"] == 0.0 and bf["chunks"] == 3
    assert i4["linear_bytes"] < bf["linear_bytes"] and len(i4["hidden_cos"]) == 7
    assert len(i4["bin_agreement_per_dim"]) == 7 and np.shape(i4["bin_agreement_per_step_dim"]) == (1, 7)
    want = QR.report(cfg, random_weights(cfg, seed=1), ("bf16", "int4"), sequences=QF.random_sequences(3, 7),
                     window_frames=2)  # the file holds what report() measures
    assert doc["dtypes"]["int4"]["bin_agreement_per_dim"] == want["int4"]["bin_agreement_per_dim"]
    assert doc["dtypes"]["int4"]["logits_cos"] == pytest.approx(want["int4"]["logits_cos"], abs=1e-12)
    table = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(table) if line.split() == ["bf16", "int4"])
    assert any(line.startswith("bin agreement gripper") for line in table[header:])
    (ckpt / "training_record.json").write_text(json.dumps({"deploy": {"window_frames": 0}}))
    with pytest.raises(ValueError, match="window_frames must be an integer >= 1"):
        QR.main(["--checkpoint", str(ckpt), "--frames", "1"])


def test_the_shipped_policy_streams_with_its_training_window_by_name(capsys):
    """metaworld_mt3 (trained with one past frame) by its shipped name, as `--checkpoint metaworld_mt3` takes it."""
    from vla_edge_ros.engine import shipped
    from vla_edge_ros.engine.checkpoint import load_checkpoint
    from vla_edge_ros.engine.interface import EngineError
    from vla_edge_ros.sim.tasks import TASKS

    policy = shipped.resolve("metaworld_mt3")
    cfg = ModelConfig.from_json(policy)
    assert QR.default_window_frames(policy)[0] == 2
    rng = np.random.default_rng(0)
    seq = QF.FrameSequence("noise", TASKS["push"].instruction,
                           [rng.integers(0, 256, (64, 128, 3), dtype=np.uint8) for _ in range(2)])
    rows = QR.report(cfg, load_checkpoint(policy, cfg), ("bf16", "int8"), sequences=[seq], window_frames=2)
    assert rows["bf16"]["chunk_action_agreement"] == 1.0 and rows["bf16"]["chunks"] == 2
    assert min(rows["int8"]["hidden_cos"][0], rows["int8"]["logits_cos"][0]) >= rows["int8"]["threshold"]
    QR.main(["--checkpoint", "metaworld_mt3", "--frames", "1", "--dtypes", "bf16"])
    assert f"checkpoint {policy}:" in capsys.readouterr().out
    with pytest.raises(EngineError, match="nor a shipped policy"):
        QR.main(["--checkpoint", "no_such_policy", "--frames", "1"])


def test_calibrated_columns_sit_beside_each_type_and_calibration_never_uses_the_judged_seeds(tmp_path, capsys):
    """--calibrate-tasks: a <type>-gptq column per quantised type, same layout and bytes, its own figures; a
    calibration seed range that overlaps the evaluated one is refused before anything runs."""
    from vla_edge_ros.engine.quant_gptq import CalibrationStreams

    cfg = ModelConfig.from_json(cfg_dict(hidden=128, inter=256))
    w = random_weights(cfg, seed=1)
    cal = CalibrationStreams(cfg, [(QR.INSTRUCTION, QF.sample_frames(3, 11))], window_frames=2)
    rows = QR.report(cfg, w, ("bf16", "int4"), sequences=QF.random_sequences(2, 7), window_frames=2,
                     calibration=cal)
    assert list(rows) == ["bf16", "int4", "int4-gptq"]
    assert rows["int4-gptq"]["linear_bytes"] == rows["int4"]["linear_bytes"] and rows["int4-gptq"]["threshold"] == 0.99
    assert rows["int4-gptq"]["hidden_cos"] != rows["int4"]["hidden_cos"]  # other codes, other outputs
    with pytest.raises(SystemExit):
        QR.main(["--frames-from", "sim", "--task", "push", "--seeds", "3", "--calibrate-tasks", "push,drawer-close",
                 "--calibrate-seed-start", "2"])
    assert "overlap the evaluated seeds 0..2" in capsys.readouterr().err
