"""The trained policy shipped in the package (engine/shipped.py): found by name, verified, and a policy.

The quality check runs it as the runtime does (numpy engine, its sliding window of 2 frames) on this machine's
renders of a held-out push episode and compares with the scripted expert; it skips where MetaWorld or EGL is
missing (the sim extra, which `make test` installs)."""
import json
import shutil

import numpy as np
import pytest

from vla_edge_ros.bench import demo_sim
from vla_edge_ros.engine import shipped
from vla_edge_ros.engine.factory import EngineError, make_engine, resolve_checkpoint

NAME = "metaworld_mt3"
CHUNKS = "metaworld_mt3_p4"  # the action-chunk policy (issue 22): H = 4, parallel decoding


def test_the_shipped_policy_is_found_by_name_and_verified():
    assert NAME in shipped.shipped_names()
    d = shipped.shipped_policy(NAME)
    assert d is not None and (d / "model.safetensors").stat().st_size < 20 * 2 ** 20  # issue 21: <= 20 MB
    assert resolve_checkpoint(NAME) == d
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vla"]["action_horizon"] == 1 and cfg["vla"]["patch_grid"] == [4, 8]
    assert shipped.shipped_policy("no_such_policy") is None and shipped.shipped_policy("../x") is None
    with pytest.raises(EngineError, match="nor a shipped policy .*metaworld_mt3"):
        resolve_checkpoint("no_such_policy")


def test_a_changed_copy_is_refused_and_a_user_directory_wins(tmp_path, monkeypatch):
    copy = tmp_path / "policies"
    shutil.copytree(shipped.POLICIES_DIR / NAME, copy / NAME)
    raw = bytearray((copy / NAME / "model.safetensors").read_bytes())
    raw[-1] ^= 0x01  # one bit of one weight
    (copy / NAME / "model.safetensors").write_bytes(bytes(raw))
    monkeypatch.setattr(shipped, "POLICIES_DIR", copy)
    with pytest.raises(EngineError, match="SHA-256"):
        resolve_checkpoint(NAME)
    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).mkdir()  # a directory of the same name, made by the user
    assert resolve_checkpoint(NAME).resolve() == (tmp_path / NAME).resolve()


def test_the_demo_takes_the_cpu_deploy_settings_from_the_manifest():
    values, sources = demo_sim.deploy_settings(str(shipped.shipped_policy(NAME)), {"deadline_ms": 250.0})
    assert values["camera_hz"] == 5.0 and values["control_hz"] == 5.0 and values["camera_after_control"] is True
    assert "manifest.json" in sources["camera_hz"]
    assert values["image_width"] == 128 and values["image_height"] == 64 and "training_record" in sources["image_width"]
    assert values["deadline_ms"] == 250.0 and sources["deadline_ms"] == "flag"


def test_the_chunk_policy_is_shipped_with_its_chunk_geometry_and_cpu_settings():
    d = shipped.shipped_policy(CHUNKS)
    assert d is not None and CHUNKS in shipped.shipped_names()
    assert (d / "model.safetensors").stat().st_size < 20 * 2 ** 20
    vla = json.loads((d / "config.json").read_text())["vla"]
    assert vla["action_horizon"] == 4 and vla["chunk_decode"] == "parallel" and vla["patch_grid"] == [4, 8]
    deploy = json.loads((d / "training_record.json").read_text())["deploy"]
    assert deploy["frame_stride_control_steps"] == 2 and deploy["window_frames"] == 2
    values, sources = demo_sim.deploy_settings(str(d), {})
    assert values["control_hz"] == 10.0 and values["deadline_ms"] == 400.0
    assert "manifest.json" in sources["deadline_ms"] and "training_record" in sources["image_width"]


@pytest.mark.parametrize("name, every", [(NAME, 1), (CHUNKS, 2)])
def test_the_shipped_policy_pushes_like_the_expert_on_this_machines_renders(name, every):
    """Run as the runtime does (numpy engine, sliding window of 2 frames; the chunk policy's frames ``every`` 2
    control steps apart, as it was trained and as the closed loop plays 2 steps of each chunk) along the expert's
    trajectory of a held-out push seed: the sign of x y z in the chunk's first step, where the expert moves."""
    pytest.importorskip("metaworld")
    from vla_edge_ros.sim.expert import ScriptedExpert
    from vla_edge_ros.sim.metaworld_env import MetaWorldSim
    from vla_edge_ros.sim.tasks import task_spec
    try:
        sim = MetaWorldSim("push", width=128, height=64)
        sim.reset(3)  # a held-out seed (demonstrations start at 1 000 000)
        sim.render()
    except RuntimeError as exc:
        pytest.skip(f"no offscreen GL here: {exc}")
    expert = ScriptedExpert(sim)
    eng = make_engine({"backend": "numpy", "checkpoint": name, "instruction": task_spec("push").instruction,
                       "eviction_policy": "sliding_window", "window_frames": 2}, log=lambda *_: None)
    horizon = json.loads((shipped.shipped_policy(name) / "config.json").read_text())["vla"]["action_horizon"]
    agree, moving = 0, 0
    try:
        for step in range(40 * every):
            want = expert.action7()
            if step % every == 0:
                chunk = eng.run_chunk(eng.encode_frame(sim.render()), step).chunk
                assert chunk.shape == (horizon, 7) and np.isfinite(chunk).all()
                for d in (0, 1, 2):  # x y z: down to the puck, then the push
                    if abs(want[d]) > 0.002:  # 20 % of the action range
                        moving += 1
                        agree += int(np.sign(chunk[0, d]) == np.sign(want[d]))
            sim.step_env(expert.env_action())  # along the expert's trajectory
    finally:
        eng.close()
        sim.close()
    assert moving >= 10
    assert agree >= 0.8 * moving, f"{name}: x y z signs agree with the expert's on {agree} of {moving}"
