"""The checkpoint's action-chunk keys (``vla.action_horizon``, ``vla.chunk_decode``): parsed, validated with the
key named, written back by ``to_dict``; the numpy backend decodes both modes (the CUDA backend's refusal of
parallel: test/test_chunk_horizon.py); the parameter registry's merge choices are the executor's."""
import numpy as np
import pytest

from vla_edge_ros import params
from vla_edge_ros.core.executor import MERGES
from vla_edge_ros.engine.config import ModelConfig, ModelConfigError, tiny_default_dict
from vla_edge_ros.engine.numpy_backend import NumpyEngine


def cfg_with(**vla):
    d = tiny_default_dict()
    d["vla"] = {**d["vla"], **vla}
    return ModelConfig.from_json(d)


def test_defaults_are_single_step_autoregressive():
    d = tiny_default_dict()
    d["vla"].pop("action_horizon", None)
    d["vla"].pop("chunk_decode", None)
    cfg = ModelConfig.from_json(d)
    assert (cfg.action_horizon, cfg.chunk_decode) == (1, "autoregressive")


def test_horizon_and_decode_parse_and_round_trip():
    cfg = cfg_with(action_horizon=8, chunk_decode="parallel")
    assert (cfg.action_horizon, cfg.chunk_decode) == (8, "parallel")
    back = cfg.to_dict()
    assert (back["vla"]["action_horizon"], back["vla"]["chunk_decode"]) == (8, "parallel")
    assert ModelConfig.from_json(back) == cfg


@pytest.mark.parametrize("vla, match", [
    ({"action_horizon": 0}, "action_horizon=0 must be >= 1"),
    ({"action_horizon": -3}, "action_horizon=-3 must be >= 1"),
    ({"action_horizon": 2.0}, "action_horizon must be an integer"),
    ({"action_horizon": "8"}, "action_horizon must be an integer"),
    ({"action_horizon": True}, "action_horizon must be an integer"),
    ({"chunk_decode": "beam"}, "chunk_decode='beam' is not one of autoregressive, parallel"),
    ({"chunk_decode": None}, "chunk_decode=None"),
    ({"chunk_decode": ["parallel"]}, "chunk_decode"),
])
def test_bad_values_are_refused_naming_the_key(vla, match):
    with pytest.raises(ModelConfigError, match=match):
        cfg_with(**vla)


class _Backend(NumpyEngine):
    """Only what chunk_support_problem reads: a name and a config (no weights are built)."""

    def __init__(self, cfg):
        self.cfg = cfg


@pytest.mark.parametrize("vla", [{}, {"action_horizon": 4}, {"chunk_decode": "parallel"},
                                 {"action_horizon": 4, "chunk_decode": "parallel"}])
def test_the_numpy_backend_decodes_every_chunk_mode(vla):
    assert _Backend(cfg_with(**vla)).chunk_support_problem() is None  # issue 22: H > 1, parallel


def test_registry_merge_choices_are_the_executors():
    assert params.BY_NAME["chunk_merge"].choices == MERGES == params.CHUNK_MERGES
    assert params.BY_NAME["chunk_merge"].default == "latest"
    assert params.validate("execution_horizon_steps", -1) and params.validate("execution_horizon_steps", 0) is None


def test_the_tiny_default_still_decodes_one_action_per_chunk():
    from vla_edge_ros.engine.factory import make_engine

    engine = make_engine({**params.defaults(params.INFERENCE), "backend": "numpy"}, lambda *_: None)
    try:
        assert engine.chunk_support_problem() is None and engine.cfg.action_horizon == 1
        r = engine.run_chunk(engine.encode_frame(np.zeros((64, 128, 3), np.uint8)), 1)
        assert r.chunk.shape == (1, engine.cfg.action_dims) and np.array_equal(r.chunk[0], r.action)
    finally:
        engine.close()
