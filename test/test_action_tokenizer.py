"""OpenVLA-style 256-bin action (de-)tokenisation with q01/q99 un-normalisation."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vla_edge_ros.core.action_tokenizer import ActionTokenizer, from_config
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict

Q01 = [-0.05, -0.04, -0.03, -0.2, -0.1, -0.3, 0.0]
Q99 = [0.05, 0.04, 0.05, 0.2, 0.1, 0.3, 1.0]


@pytest.fixture
def tok():
    return ActionTokenizer(512, Q01, Q99)


def test_bin_centres_and_ids(tok):
    assert tok.offset == 256 and tok.bin_centers.shape == (256,)
    assert tok.bin_centers[0] == pytest.approx(-1 + 1 / 256) and tok.bin_centers[-1] == pytest.approx(1 - 1 / 256)
    assert np.allclose(np.diff(tok.bin_centers), 2 / 256)
    ids = np.array([256, 511, 256 + 128, 256 + 127, 300, 400, 256])
    assert tok.bins_from_token_ids(ids).tolist() == [0, 255, 128, 127, 44, 144, 0]


def test_detokenize_formula(tok):
    ids = np.array([256, 511, 384, 383, 256, 511, 511])
    a = tok.detokenize(ids)
    assert a.dtype == np.float32 and a.shape == (7,)
    x = -1 + (ids - 256 + 0.5) * (2 / 256)
    expect = 0.5 * (x + 1) * (np.array(Q99) - np.array(Q01)) + np.array(Q01)
    np.testing.assert_allclose(a, expect, rtol=1e-6)
    assert a[0] == pytest.approx(-0.05 + 0.1 / 512, rel=1e-5)  # lowest bin: half a bin above q01
    assert a[6] == pytest.approx(1 - 1 / 512, rel=1e-5)  # gripper, highest bin


def test_round_trip_of_every_bin(tok):
    for b in range(256):
        ids = np.full(7, 256 + b)
        assert np.array_equal(tok.tokenize(tok.detokenize(ids)), ids)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=7, max_size=7))
def test_quantisation_error_is_at_most_half_a_bin(fractions):
    tok = ActionTokenizer(512, Q01, Q99)
    q01, q99 = np.array(Q01), np.array(Q99)
    a = q01 + np.array(fractions) * (q99 - q01)
    back = tok.detokenize(tok.tokenize(a))
    half_bin = (q99 - q01) / 256 / 2
    assert np.all(np.abs(back - a) <= half_bin * (1 + 1e-4) + 1e-7)


def test_saturation_and_constant_dimension():
    tok = ActionTokenizer(300, [0.0, 1.0], [1.0, 1.0], n_bins=256)
    assert tok.offset == 44
    ids = tok.tokenize(np.array([5.0, 1.0]))
    assert ids.tolist() == [44 + 255, 44 + 128]  # beyond q99 saturates; constant dim -> middle bin
    assert tok.detokenize(ids)[1] == 1.0  # a constant dimension decodes to its value
    assert tok.tokenize(np.array([-5.0, 0.0]))[0] == 44


def test_bad_input_is_refused(tok):
    with pytest.raises(ValueError, match="not action tokens"):
        tok.detokenize(np.array([255, 256, 256, 256, 256, 256, 256]))
    with pytest.raises(ValueError, match="not action tokens"):
        tok.detokenize(np.full(7, 512))
    with pytest.raises(ValueError, match="expected 7 action dimensions"):
        tok.detokenize(np.full(6, 300))
    with pytest.raises(ValueError, match="q01 must be <= q99"):
        ActionTokenizer(512, [1.0], [0.0])
    with pytest.raises(ValueError, match="equally long"):
        ActionTokenizer(512, [0.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="n_bins"):
        ActionTokenizer(100, [0.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        ActionTokenizer(512, [np.nan], [1.0])


def test_from_config():
    cfg = ModelConfig.from_json(tiny_default_dict())
    tok = from_config(cfg)
    assert tok.offset == cfg.action_token_offset and tok.action_dims == 7
    assert tok.q99.tolist() == list(cfg.action_q99)
