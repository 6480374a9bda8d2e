"""train/quantize.py (`vla_quantize`): a pre-quantised checkpoint calibrated on demonstration bags (GPTQ), or
rounded to nearest without bags; what it records; and its refusals, with nothing overwritten."""
from __future__ import annotations

import json

import numpy as np
import pytest

from vla_edge_ros.engine import quant as Q
from vla_edge_ros.engine import quant_checkpoint as QC
from vla_edge_ros.engine import quant_gptq as G
from vla_edge_ros.engine.checkpoint import load_checkpoint, write_checkpoint
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict
from vla_edge_ros.engine.factory import make_engine
from vla_edge_ros.train import quantize as VQ

from test_bag_io import write_demo_bag
from test_numpy_engine import random_weights


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vq")
    d = tiny_default_dict()
    d.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=1024, rope_theta=10000.0)
    cfg = ModelConfig.from_json(d)
    w = random_weights(cfg, seed=4)
    src = write_checkpoint(root / "src", d, w)
    w = load_checkpoint(src, cfg)  # bf16-rounded, as vla_quantize reads it
    (src / "training_record.json").write_text(json.dumps({"deploy": {"window_frames": 2}}))
    bag_a, bag_b = root / "bag_a", root / "bag_b"
    write_demo_bag(bag_a, episodes=4, steps=8, seed=1)
    write_demo_bag(bag_b, episodes=3, steps=8, seed=2)
    return cfg, w, src, [str(bag_a), str(bag_b)]


def test_spread_picks_evenly_with_both_ends():
    assert VQ.spread(7, 3) == [0, 3, 6]
    assert VQ.spread(7, 1) == [0]
    assert VQ.spread(4, 9) == [0, 1, 2, 3]
    assert VQ.spread(10, 4) == [0, 3, 6, 9]


def test_calibrated_checkpoint_holds_the_gptq_codes_and_says_how_they_were_made(setup, tmp_path, capsys):
    cfg, w, src, bags = setup
    dst = tmp_path / "q4"
    assert VQ.main([str(src), str(dst), "--weight-dtype", "int4", "--calibrate", *bags, "--episodes", "3"]) == 0
    out = capsys.readouterr().out
    assert "GPTQ int4 on 24 frames of 3 episodes" in out and "layer 2/2" in out and "weight_dtype:=int4" in out
    record = json.loads((dst / VQ.RECORD_FILE).read_text())
    assert record["method"] == "gptq" and record["weight_dtype"] == "int4"
    cal = record["calibration"]
    assert [e["episode"] for e in cal["episodes"]] == [0, 3, 2]  # episodes 0, 3 of bag_a and 2 of bag_b (the last)
    assert cal["frames"] == 24 and cal["window_frames"] == 2 and len(cal["sha256"]) == 64
    assert set(record["per_weight"]) == {n for n in w if Q.is_quantized_name(n)}
    assert json.loads((dst / "training_record.json").read_text()) == {"deploy": {"window_frames": 2}}
    # the same codes as calibrating those frames directly, in the documented layout
    seqs, _ = VQ.calibration_sequences(bags, 3, 1)
    want = G.calibrate(cfg, w, "int4", G.CalibrationStreams(cfg, seqs, 2), progress=None)
    _, got = QC.read_quantized_checkpoint(dst, "int4")
    for n, q in want.linear.items():
        assert np.array_equal(got.linear[n].codes, q.codes) and np.array_equal(got.linear[n].scales, q.scales)
    assert any(not np.array_equal(q.codes, Q.quantize_linear(w[n], "int4").codes) for n, q in want.linear.items())
    eng = make_engine({"backend": "numpy", "checkpoint": str(dst), "weight_dtype": "int4",
                       "kv_budget_tokens": 256, "eviction_policy": "fifo"}, log=lambda m: None)
    frame = np.zeros((16, 32, 3), np.uint8)
    assert np.all(np.isfinite(eng.run_chunk(eng.encode_frame(frame), 0).action))


def test_without_bags_the_codes_are_round_to_nearest(setup, tmp_path):
    _, w, src, _ = setup
    assert VQ.main([str(src), str(tmp_path / "q8"), "--weight-dtype", "int8"]) == 0
    _, got = QC.read_quantized_checkpoint(tmp_path / "q8", "int8")
    want = Q.quantize_weights(w, "int8")
    assert all(np.array_equal(got.linear[n].codes, q.codes) for n, q in want.linear.items())
    assert json.loads((tmp_path / "q8" / VQ.RECORD_FILE).read_text())["method"] == "round_to_nearest"


def test_refusals_name_the_cause_and_overwrite_nothing(setup, tmp_path, capsys):
    _, _, src, bags = setup
    assert VQ.main([str(src), str(tmp_path / "q"), "--weight-dtype", "fp8"]) == 0
    before = (tmp_path / "q" / QC.QUANT_FILE).stat().st_mtime_ns
    capsys.readouterr()
    cases = [([str(src), str(tmp_path / "q"), "--weight-dtype", "int8"], "exists and is not empty (or not a directory)"),
             ([str(tmp_path / "q"), str(tmp_path / "a"), "--weight-dtype", "int8"], "already a pre-quantised"),
             ([str(src), str(tmp_path / "b"), "--weight-dtype", "int4", "--calibrate", str(tmp_path / "nobag")],
              "no such file"),
             ([str(src), str(tmp_path / "c"), "--weight-dtype", "int4", "--calibrate", *bags, "--every", "0"],
              "--every must be >= 1")]
    for argv, why in cases:
        assert VQ.main(argv) == 2, argv
        assert why in capsys.readouterr().err, why
    assert (tmp_path / "q" / QC.QUANT_FILE).stat().st_mtime_ns == before
    assert not any((tmp_path / n).exists() for n in "abc")
