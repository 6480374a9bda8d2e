"""gpu_quant_bench's --tuning (a measured alternative of the split-K GEMVs) parses into plan.Tuning, without a GPU."""
import argparse

import pytest

from vla_edge_ros.bench.gpu_quant_bench import tuning_arg
from vla_edge_ros.engine.cuda.plan import Tuning
from vla_edge_ros.engine.interface import EngineError


def test_tuning_pairs_become_plan_tuning_fields():
    t = Tuning.from_mapping(tuning_arg("gemv_target_blocks=528, gemv_min_ks=256"))
    assert (t.gemv_target_blocks, t.gemv_min_ks) == (528, 256)
    assert tuning_arg("") == {}


def test_bad_tuning_is_refused_by_name():
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        tuning_arg("gemv_min_ks")
    with pytest.raises(EngineError, match="unknown tuning key"):
        Tuning.from_mapping(tuning_arg("gemv_min_kz=3"))
    with pytest.raises(EngineError, match="positive integer"):
        Tuning.from_mapping(tuning_arg("gemv_min_ks=-4"))
