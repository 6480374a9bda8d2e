"""The Engine contract the runtime relies on (engine/interface.py): action names, prefix tokens and live KV
changes, defined once for both backends and applied through the inference loop's one queue of live changes."""
import numpy as np
import pytest

from vla_edge_ros import params
from vla_edge_ros.core.admission import AdmissionController
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.inference_loop import InferenceLoop
from vla_edge_ros.engine.factory import make_engine


@pytest.fixture(scope="module")
def engine():
    eng = make_engine({"backend": "numpy", "kv_budget_tokens": 0}, log=lambda s: None)
    yield eng
    eng.close()


def test_names_prefix_and_the_backend_default_budget(engine):
    assert engine.action_names == ("x", "y", "z", "roll", "pitch", "yaw", "gripper")
    assert engine.prefix_tokens == len(params.BY_NAME["instruction"].default.encode("utf-8"))
    assert engine.kv.budget_tokens == params.KV_BUDGET_BY_BACKEND["numpy"]


def test_kv_changes_go_through_the_loop_queue_and_apply_between_chunks(engine):
    loop = InferenceLoop(engine, DoubleBuffer(), AdmissionController(), 33.3, on_action=lambda *a: None)
    tok = engine.encode_frame(np.zeros((64, 128, 3), np.uint8))
    for f in range(12):
        engine.run_chunk(tok, f)
    loop.update(eviction_policy="fifo", kv_budget_tokens=256)
    assert engine.kv.policy != "fifo" or engine.kv.budget_tokens != 256  # queued, not applied yet
    loop.apply_pending_updates()
    assert engine.kv.policy == "fifo" and engine.kv.budget_tokens == 256
    assert engine.kv.occupancy_tokens <= 256 and loop.kv_last_evicted and loop.kv_changes_applied == 1
    loop.update(kv_budget_tokens=0)  # back to the backend's default
    loop.apply_pending_updates()
    assert engine.kv.budget_tokens == params.KV_BUDGET_BY_BACKEND["numpy"]
    with pytest.raises(ValueError, match="multiple of tokens_per_frame"):
        loop.update(kv_budget_tokens=250)
    with pytest.raises(ValueError, match="eviction_policy"):
        loop.update(eviction_policy="lru")
    with pytest.raises(ValueError, match="not a live KV setting"):
        engine.apply_kv_changes({"deadline_ms": 10.0})
