"""`vla_demo --sim` (bench/demo_sim.py): the closed-loop demo for real, short, and its pure parts.

The real run: vla_runtime (embedded random weights) + vla_sim as processes in their own ROS domain, one short
episode at 5 Hz through `python -m vla_edge_ros.bench.demo --sim`. It asserts what the demo promises a user: the
per-episode line, the summary, the closed_loop section of the JSON (the other sections kept) agreeing with the
sim's own episode record, and a GIF of the episode with one frame per control step. Not how well random weights
do: success is only checked for consistency.

The pure parts: the deploy settings come from the checkpoint's training record when it has them, a flag wins,
the CPU-safe settings fill the rest, and a bad record is an error, not a silent fallback."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vla_edge_ros.bench import demo_sim


def _record(tmp_path: Path, deploy) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / demo_sim.RECORD).write_text(json.dumps({"deploy": deploy}))
    return ckpt


def test_deploy_settings_from_the_checkpoint_record_then_flags_then_cpu_safe(tmp_path):
    ckpt = _record(tmp_path, {"image_hw": [48, 96], "eviction_policy": "fifo", "window_frames": 3,
                              "tokens_per_frame": 16, "camera_hz": 15, "max_retained_frames": 3})
    values, sources = demo_sim.deploy_settings(str(ckpt), {"control_hz": 7.0, "deadline_ms": None})
    assert (values["image_width"], values["image_height"]) == (96, 48)
    assert values["eviction_policy"] == "fifo" and values["window_frames"] == 3 and values["tokens_per_frame"] == 16
    assert values["camera_hz"] == 15.0 and isinstance(values["camera_hz"], float)  # a rate the record carries
    assert values["control_hz"] == 7.0 and sources["control_hz"] == "flag"
    assert values["deadline_ms"] == demo_sim.CPU_SAFE["deadline_ms"] and sources["deadline_ms"] == "CPU-safe default"
    assert sources["image_width"].startswith("checkpoint") and sources["camera_hz"].startswith("checkpoint")
    plain, plain_sources = demo_sim.deploy_settings("")
    assert plain == demo_sim.CPU_SAFE and set(plain_sources.values()) == {"CPU-safe default"}


@pytest.mark.parametrize("deploy, match", [
    ({"window_frames": 0}, "window_frames=0 is below the minimum"),
    ({"eviction_policy": "lru"}, "eviction_policy='lru' is not one of"),
    ({"image_hw": [64]}, r"image_hw must be \[H, W\]"),
])
def test_bad_deploy_values_are_errors(tmp_path, deploy, match):
    with pytest.raises(ValueError, match=match):
        demo_sim.deploy_settings(str(_record(tmp_path, deploy)))


def test_unreadable_record_is_an_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / demo_sim.RECORD).write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON training record"):
        demo_sim.deploy_settings(str(ckpt))


def test_merge_keeps_the_other_sections_and_an_unreadable_file(tmp_path):
    out = tmp_path / "demo.json"
    out.write_text(json.dumps({"ticks": {"fresh": 3}, "closed_loop": {"old": True}}))
    demo_sim.merge_into(out, {"success_rate": 0.5})
    assert json.loads(out.read_text()) == {"ticks": {"fresh": 3}, "closed_loop": {"success_rate": 0.5}}
    out.write_text("[1, 2")
    demo_sim.merge_into(out, {"success_rate": 1.0})
    assert json.loads(out.read_text()) == {"closed_loop": {"success_rate": 1.0}}
    assert (tmp_path / "demo.json.unreadable").read_text() == "[1, 2"


def test_the_summary_says_why_the_runtime_repeated_and_that_chunk_steps_are_planned():
    """The publisher's repeat reasons (core/executor.py, from the runtime's stats via eval_grid.runtime_figures): with
    a chunk policy the later steps of each chunk are 'repeat' with reason next_step, which the summary must not
    let pass for re-sent actions; a single-step policy's summary has no such note."""
    from vla_edge_ros.bench.eval_grid import runtime_figures
    stats = {"ticks": {"fresh": 5, "repeat": 9, "hold": 0},
             "action": {"arbiter": {"repeat_reasons": {"next_step": 6, "same_step": 3}}}}
    figures = runtime_figures(stats, 1)
    assert figures["repeat_reasons"] == {"next_step": 6, "same_step": 3}
    assert runtime_figures({"ticks": {}}, 1)["repeat_reasons"] == {}
    sec = {"applied_shares": {"fresh": 0.5, "repeat": 0.5, "hold": 0.0, "sim_hold": 0.0}, "chunks": {},
           "chunk_latency_ms": {}, "success_ci95": None, "video": None, "task": "push", "instruction": "push it",
           "checkpoint": "metaworld_mt3_p4", "successes": 1, "episodes": 1, "success_rate": 1.0,
           "episode_s": {"mean": 5.0}, "steps_mean": 50, "runtime_fresh_share": 0.36, "deadline_miss_rate": 0.0,
           "status": "ok", "runtime_repeat_reasons": figures["repeat_reasons"]}
    text = demo_sim.summary_text(sec)
    assert re.search(r"^runtime repeats by reason\s+next_step 6, same_step 3$", text, re.M), text
    assert "reason next_step): the arm plays the plan" in text
    single = demo_sim.summary_text({**sec, "runtime_repeat_reasons": {"no_new_action": 9}})
    assert "no_new_action 9" in single and "the arm plays the plan" not in single


EPISODE_LINE = re.compile(r"^episode 0 seed 0: (SUCCESS|failed \(horizon\)) after (\d+) steps, [\d.]+ s \| "
                          r"applied fresh (\d+)% repeat (\d+)% hold (\d+)%", re.M)
HORIZON = 12


def test_closed_loop_demo_runs_for_real(tmp_path, ros_domain, capsys):
    pytest.importorskip("rclpy")
    import vla_edge_ros.sim  # noqa: F401  selects MUJOCO_GL before mujoco is imported

    pytest.importorskip("metaworld")
    pytest.importorskip("PIL")
    from PIL import Image

    from vla_edge_ros.bench import demo

    out, gif = tmp_path / "demo.json", tmp_path / "episode.gif"
    out.write_text(json.dumps({"ticks": {"fresh": 1, "repeat": 0, "hold": 0}}))  # an open-loop demo's figures
    rc = demo.main(["--sim", "--episodes", "1", "--horizon", str(HORIZON), "--task", "reach", "--backend", "numpy",
                    "--camera-hz", "5", "--control-hz", "5", "--action-rate-hz", "5", "--out", str(out),
                    "--video", str(gif), "--workdir", str(tmp_path / "work"), "--domain-id", str(ros_domain)])
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    sec = doc["closed_loop"]
    assert rc == 0, (sec["error"], text[-3000:])
    assert doc["ticks"] == {"fresh": 1, "repeat": 0, "hold": 0}  # the open-loop section was kept

    m = EPISODE_LINE.search(text)
    assert m, text[-3000:]
    steps = int(m.group(2))
    episodes = [json.loads(x) for x in (Path(sec["logs"]) / "episodes.jsonl").read_text().splitlines() if x.strip()]
    assert len(episodes) == 1 and episodes[0]["steps"] == steps <= HORIZON
    assert (m.group(1) == "SUCCESS") == episodes[0]["success"]
    assert int(m.group(3)) == round(100 * episodes[0]["fresh"] / steps)
    assert re.search(r"^success\s+[01]/1 ", text, re.M) and "chunk latency p50 / p99 (ms)" in text

    assert sec["status"] == "ok" and sec["task"] == "reach" and sec["episodes"] == 1
    assert sec["successes"] == int(episodes[0]["success"]) and sec["success_rate"] == sec["successes"]
    assert sec["per_episode"][0]["steps"] == steps and sec["per_episode"][0]["seed"] == 0
    assert sec["fresh_share"] == pytest.approx(episodes[0]["fresh"] / steps)
    assert sec["chunks"]["admitted"] > 0 and sec["chunk_latency_ms"]["p50"] > 0
    assert sec["settings"]["control_hz"] == 5.0 and sec["settings"]["sources"]["control_hz"] == "flag"
    assert sec["settings"]["image_width"] == demo_sim.CPU_SAFE["image_width"]

    video = sec["video"]
    assert video["written"] and video["path"] == str(gif.resolve()) and str(gif.resolve()) in text
    im = Image.open(gif)
    # one frame per control step of episode 0 (a step before the first camera frame would be counted, not drawn)
    assert im.n_frames == video["frames"] == steps - video["steps_without_frame"] > 1
    assert video["result"].startswith("SUCCESS" if episodes[0]["success"] else f"FAILED at step {steps}")
    if video["steps_without_frame"] == 0:  # every step drawn: the banners count the kinds the sim applied
        from vla_edge_ros.sim.episode_video import KIND_COLOURS

        by_colour = {c: k for k, c in KIND_COLOURS.items()}
        drawn = {"fresh": 0, "repeat": 0, "hold": 0}
        for k in range(im.n_frames):
            im.seek(k)
            drawn[by_colour[im.convert("RGB").getpixel((im.width - 1, 0))]] += 1
        ep = episodes[0]
        assert drawn == {"fresh": ep["fresh"], "repeat": ep["repeat"],
                         "hold": ep["hold"] + sum(ep["sim_hold"].values())}, (drawn, ep)
