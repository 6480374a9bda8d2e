"""bench/chunk_compare.py (issue 22's comparison of execution schemes) without running it: each scheme's vla_eval
command carries its runtime parameters and the checkpoint of the right horizon, a wrong checkpoint is refused by
name, and the table reads every (scheme, latency) row of the schemes' results, a missing scheme shown as such."""
from __future__ import annotations

import json

import pytest

from vla_edge_ros.bench import chunk_compare as C
from vla_edge_ros.bench.eval_grid import wilson_interval


@pytest.fixture
def checkpoints(tmp_path):
    paths = {}
    for name, h in (("single", 1), ("chunk", 4)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"vla": {"action_horizon": h}}))
        paths[name] = str(d)
    return paths


def test_each_scheme_runs_vla_eval_with_its_checkpoint_and_parameters(checkpoints, tmp_path):
    args = C.parse_args(["--single-checkpoint", checkpoints["single"], "--chunk-checkpoint", checkpoints["chunk"],
                         "--latencies", "0,100", "--episodes", "3"])
    cmds = {s: C.eval_command(s, args, tmp_path, 100 + i) for i, s in enumerate(C.SCHEMES)}
    assert cmds["single_step"][cmds["single_step"].index("--checkpoint") + 1] == checkpoints["single"]
    for s in ("sync_chunks", "async_latest", "async_temporal_ensemble", "async_blend", "async_receding"):
        assert cmds[s][cmds[s].index("--checkpoint") + 1] == checkpoints["chunk"]
    params = {s: [c[i + 1] for i, x in enumerate(c) if x == "--runtime-param"] for s, c in cmds.items()}
    assert "execution_horizon_steps:=4" in params["sync_chunks"]  # H of the chunk checkpoint: play it to its end
    assert {"execution_horizon_steps:=0", "chunk_merge:=blend", "force_committed_steps:=true"} <= set(
        params["async_blend"])
    assert "chunk_merge:=temporal_ensemble" in params["async_temporal_ensemble"]
    assert {"execution_horizon_steps:=1", "chunk_merge:=latest"} <= set(params["async_receding"])
    assert set(C.DEFAULT_SCHEMES) == set(C.SCHEMES) - {"async_receding"}  # the five by default
    assert C.parse_args(["--chunk-checkpoint", "x"]).schemes.split(",") == list(C.DEFAULT_SCHEMES)
    assert all("window_frames:=2" in p for p in params.values())
    assert all(c[c.index("--latencies") + 1] == "0,100" for c in cmds.values())
    assert len({c[c.index("--domain-id") + 1] for c in cmds.values()}) == len(C.SCHEMES)  # one domain each


def test_a_checkpoint_of_the_wrong_horizon_is_refused_by_name(checkpoints, tmp_path):
    args = C.parse_args(["--single-checkpoint", checkpoints["chunk"], "--chunk-checkpoint", checkpoints["single"]])
    with pytest.raises(ValueError, match=r"single_step needs a single-step \(H = 1\) checkpoint"):
        C.eval_command("single_step", args, tmp_path, 100)
    with pytest.raises(ValueError, match=r"async_latest needs a chunk \(H > 1\) checkpoint"):
        C.eval_command("async_latest", args, tmp_path, 100)


def test_single_step_schemes_need_no_chunk_checkpoint_and_chunk_schemes_are_refused_without_one(checkpoints, tmp_path,
                                                                                                 capsys):
    default = C.parse_args([])  # the shipped pair: a single-step policy and its chunk twin
    assert (C.horizon_of(default.single_checkpoint), C.horizon_of(default.chunk_checkpoint)) == (1, 4)
    args = C.parse_args(["--single-checkpoint", checkpoints["single"], "--chunk-checkpoint", "", "--latencies", "0"])
    cmd = C.eval_command("single_step+int8", args, tmp_path, 100)
    assert cmd[cmd.index("--checkpoint") + 1] == checkpoints["single"]
    with pytest.raises(ValueError, match="async_latest needs --chunk-checkpoint"):
        C.eval_command("async_latest", args, tmp_path, 100)
    with pytest.raises(ValueError, match=r"single_step needs --single-checkpoint \(an H = 1 policy\)"):
        C.eval_command("single_step", C.parse_args(["--single-checkpoint", ""]), tmp_path, 100)
    assert C.main(["--single-checkpoint", checkpoints["single"], "--chunk-checkpoint", "", "--schemes",
                   "single_step,async_blend", "--out", str(tmp_path / "out")]) == 2
    assert "async_blend needs --chunk-checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any run


def test_a_readout_suffix_adds_action_readout_and_bad_names_are_refused(checkpoints, tmp_path, capsys):
    args = C.parse_args(["--single-checkpoint", checkpoints["single"], "--chunk-checkpoint", checkpoints["chunk"],
                         "--jobs", "2", "--latencies", "0"])
    plain, mean = (C.eval_command(s, args, tmp_path / s, 100) for s in ("async_latest", "async_latest+expectation"))
    params = [[c[i + 1] for i, x in enumerate(c) if x == "--runtime-param"] for c in (plain, mean)]
    assert params[1] == params[0] + ["action_readout:=expectation"]
    assert not any(p.startswith("action_readout") for p in params[0])
    assert mean[mean.index("--checkpoint") + 1] == checkpoints["chunk"]
    outs = [c[c.index("--out") + 1] for c in C.cells(args, ["async_latest", "async_latest+expectation"], tmp_path)]
    assert outs == [str(tmp_path / "async_latest" / "inj0"), str(tmp_path / "async_latest+expectation" / "inj0")]
    assert C.split_scheme("single_step+argmax") == ("single_step", {"action_readout": "argmax"})
    assert C.split_scheme("single_step") == ("single_step", {})
    for bad, why in (("async_latest+mean", "unknown modifier 'mean'"), ("fast+expectation", "unknown scheme 'fast'"),
                     ("single_step+int8+int4", "sets weight_dtype twice")):
        with pytest.raises(ValueError, match=why):
            C.split_scheme(bad)
        assert C.main(["--chunk-checkpoint", checkpoints["chunk"], "--schemes", bad, "--out", str(tmp_path)]) == 2
        assert why in capsys.readouterr().err


def test_a_weight_type_suffix_adds_weight_dtype_next_to_a_readout(checkpoints, tmp_path):
    args = C.parse_args(["--single-checkpoint", checkpoints["single"], "--chunk-checkpoint", checkpoints["chunk"],
                         "--latencies", "0"])
    plain, quant, both = (C.eval_command(s, args, tmp_path / s, 100)
                          for s in ("single_step", "single_step+int4", "async_latest+int8+expectation"))
    params = [[c[i + 1] for i, x in enumerate(c) if x == "--runtime-param"] for c in (plain, quant, both)]
    assert params[1] == params[0] + ["weight_dtype:=int4"]
    assert not any(p.startswith("weight_dtype") for p in params[0])
    assert {"weight_dtype:=int8", "action_readout:=expectation"} <= set(params[2])
    assert both[both.index("--checkpoint") + 1] == checkpoints["chunk"]
    # every suffix value is a value the runtime's registry takes for its parameter
    from vla_edge_ros.params import validate
    for name in ("single_step+bf16", "single_step+fp8", "async_latest+expectation+int4"):
        assert all(validate(k, v) is None for k, v in C.split_scheme(name)[1].items()), name


def test_the_table_has_a_row_per_scheme_and_latency_and_shows_a_missing_scheme(tmp_path):
    def row(inject, successes):
        return {"setting": {"inject_ms": inject}, "status": "ok", "episodes": 10, "successes": successes,
                "success_rate": successes / 10, "success_ci95": [0.1, 0.9], "jerk_sq_mean": 0.25,
                "shares": {"fresh": 0.5, "repeat": 0.5, "hold": 0.0}, "success_steps_mean": 90.0,
                "runtime": {"latency_ms": {"p50": 40.0, "p99": 60.0},
                            "chunks": {"admitted": 100, "refused": 2, "deadline_misses": 1}}}
    (tmp_path / "single_step").mkdir()
    (tmp_path / "single_step" / "results.json").write_text(json.dumps({"rows": [row(0, 8), row(200, 6)]}))
    rows = C.collect(tmp_path, ["single_step", "async_blend"])
    assert [(r["scheme"], r["inject_ms"], r["status"]) for r in rows] == [
        ("single_step", 0, "ok"), ("single_step", 200, "ok"), ("async_blend", None, "missing")]
    md = C.table(rows)
    assert "| single_step | 0 | 8/10 = 80 % | 10-90 % |" in md and "| single_step | 200 | 6/10 = 60 %" in md
    assert "| async_blend | None | MISSING:" in md and "| 100 / 2 / 1 |" in md
    assert "| 50 / 50 / 0 |" in md  # no new-frame share in the results: no "(new ...)"


def test_jobs_split_every_scheme_and_latency_into_its_own_run_and_domain(checkpoints, tmp_path):
    base = ["--single-checkpoint", checkpoints["single"], "--chunk-checkpoint", checkpoints["chunk"],
            "--latencies", "0,100,200", "--backend", "cuda", "--domain-id", "20"]
    sequential = C.cells(C.parse_args(base), list(C.SCHEMES), tmp_path)
    assert len(sequential) == len(C.SCHEMES)
    assert all(c[c.index("--latencies") + 1] == "0,100,200" for c in sequential)
    cmds = C.cells(C.parse_args(base + ["--jobs", "15"]), list(C.SCHEMES), tmp_path)
    assert len(cmds) == 3 * len(C.SCHEMES)
    outs = [c[c.index("--out") + 1] for c in cmds]
    assert str(tmp_path / "async_blend" / "inj100") in outs and len(set(outs)) == len(outs)
    assert len({c[c.index("--domain-id") + 1] for c in cmds}) == len(cmds)
    assert all(c[c.index("--backends") + 1] == "cuda" for c in cmds)
    assert {c[c.index("--latencies") + 1] for c in cmds} == {"0", "100", "200"}


def test_cells_are_read_back_in_latency_order(tmp_path):
    for inj, successes in ((200, 1), (0, 9), (100, 5)):
        d = tmp_path / "async_latest" / f"inj{inj}"
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"rows": [
            {"setting": {"inject_ms": inj}, "status": "ok", "episodes": 10, "successes": successes}]}))
    rows = C.collect(tmp_path, ["async_latest"])
    assert [(r["inject_ms"], r["successes"]) for r in rows] == [(0, 9), (100, 5), (200, 1)]


def test_run_cells_runs_every_command_at_most_jobs_at_a_time(tmp_path, capsys):
    import sys
    import time

    # each command records its start and end time in its --out file; one fails and is reported, the rest still run
    prog = ("import sys, time; t0 = time.time(); time.sleep(0.6); "
            "open(sys.argv[2], 'w').write(f'{t0} {time.time()}'); sys.exit(int(sys.argv[3]))")
    cmds = [[sys.executable, "-c", prog, "--out", str(tmp_path / f"c{i}"), str(int(i == 1))] for i in range(3)]
    C.run_cells(cmds, 2, time.monotonic())
    spans = sorted(tuple(map(float, (tmp_path / f"c{i}").read_text().split())) for i in range(3))
    assert spans[2][0] >= min(spans[0][1], spans[1][1]) - 0.05  # the third started only after one had finished
    out = capsys.readouterr().out
    assert out.count(" done ") == 3 and "(exit 1): its row says why" in out


def test_splits_give_each_cell_seed_ranges_run_side_by_side_in_their_own_domains(checkpoints, tmp_path):
    assert C.seed_splits(0, 10, 3) == [(0, 4), (4, 4), (8, 2)]
    assert C.seed_splits(5, 2, 4) == [(5, 1), (6, 1)]  # never an empty range
    base = ["--single-checkpoint", checkpoints["single"], "--chunk-checkpoint", checkpoints["chunk"],
            "--latencies", "0,200", "--episodes", "10", "--seed-start", "100", "--domain-id", "20"]
    cmds = C.cells(C.parse_args(base + ["--jobs", "30", "--splits", "3"]), list(C.SCHEMES), tmp_path)
    assert len(cmds) == 2 * 3 * len(C.SCHEMES)
    blend0 = [c for c in cmds if str(tmp_path / "async_blend" / "inj0.s") in c[c.index("--out") + 1]]
    assert sorted((int(c[c.index("--seed-start") + 1]), int(c[c.index("--episodes") + 1])) for c in blend0) == [
        (100, 4), (104, 4), (108, 2)]
    assert len({c[c.index("--domain-id") + 1] for c in cmds}) == len(cmds)
    with pytest.raises(ValueError, match="--splits must be >= 1"):
        C.cells(C.parse_args(base + ["--jobs", "30", "--splits", "0"]), list(C.SCHEMES), tmp_path)
    with pytest.raises(ValueError, match="--splits needs --jobs"):
        C.cells(C.parse_args(base + ["--splits", "2"]), list(C.SCHEMES), tmp_path)
    with pytest.raises(ValueError, match="last domain id 232"):
        C.cells(C.parse_args(base + ["--jobs", "30", "--splits", "3", "--domain-id", "220"]), list(C.SCHEMES),
                tmp_path)


def test_a_cells_seed_ranges_add_up_into_one_row(tmp_path):
    def write(name, inj, episodes, successes, jerk, fresh, p99, admitted, status="ok", steps=100.0, new=None):
        d = tmp_path / "async_latest" / name
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"rows": [{
            "setting": {"inject_ms": inj}, "status": status, "error": None if status == "ok" else "sim died",
            "episodes": episodes, "successes": successes, "success_rate": successes / episodes,
            "success_ci95": [0, 1], "jerk_sq_mean": jerk, "success_steps_mean": 60.0 if successes else None,
            "steps_mean": steps, "new_plan_share": new,
            "shares": {"fresh": fresh, "repeat": 1 - fresh, "hold": 0.0},
            "runtime": {"latency_ms": {"p50": 5.0, "p99": p99},
                        "chunks": {"admitted": admitted, "refused": 1, "deadline_misses": 0}}}]}))
    write("inj0.s0", 0, 6, 3, 1.0, 0.5, 9.0, 100, new=1.0)
    write("inj0.s6", 0, 4, 4, 2.0, 0.0, 12.0, 50, steps=50.0, new=0.25)
    write("inj100.s0", 100, 6, 0, 1.0, 0.5, 9.0, 100)
    write("inj100.s6", 100, 4, 1, 1.0, 0.5, 9.0, 100, status="failed")
    rows = C.collect(tmp_path, ["async_latest"])
    assert [(r["inject_ms"], r["status"]) for r in rows] == [(0, "ok"), (100, "failed")]
    ok = rows[0]
    assert (ok["episodes"], ok["successes"], ok["success_rate"]) == (10, 7, 0.7)
    assert ok["ci95"] == pytest.approx(list(wilson_interval(7, 10)))
    assert ok["jerk_sq_mean"] == pytest.approx((6 * 1.0 + 4 * 2.0) / 10)
    # shares weigh each range's control steps: 6 x 100 steps at 0.5, 4 x 50 at 0
    assert ok["shares"]["fresh"] == pytest.approx(300 / 800) and ok["chunk_ms"]["p99"] == 12.0
    assert ok["new_plan_share"] == pytest.approx((600 * 1.0 + 200 * 0.25) / 800)  # steps from a newer frame, alike
    assert ok["chunks"] == {"admitted": 150, "refused": 2, "deadline_misses": 0}
    assert "1 of 2 seed ranges failed: sim died" in rows[1]["error"]
    assert "| async_latest | 0 | 7/10 = 70 % |" in C.table(rows) and "| 38 / 62 / 0 (new 81) |" in C.table(rows)
