"""bench/edge_table.py (issue 23's edge prediction): bytes per chunk from the model geometry and weight type, the
floor and the expected time on each GPU, and the verdicts, without a GPU."""
from __future__ import annotations

import pytest

from vla_edge_ros.bench import edge_table as E


def measured(fractions):
    return {"rows": [{"shape": "seed", "weight_dtype": "bf16", "floor_fraction": 0.99}]
            + [{"shape": "7-pass", "weight_dtype": wd, "floor_fraction": f} for wd, f in fractions.items()]}


def test_the_floor_is_the_bytes_over_the_bandwidth_and_smaller_types_read_fewer_bytes():
    rs = E.rows(measured({"bf16": 0.5, "int8": 0.25, "fp8": 0.25, "int4": 0.1}))
    assert len(rs) == len(E.GEOMETRIES) * len(E.WEIGHT_DTYPES) * len(E.GPUS)
    for r in rs:
        bw = E.GPUS[r["gpu"]][0]
        assert r["floor_ms"] == pytest.approx(r["bytes_per_chunk"] / bw * 1e3)
        assert r["expected_ms"] == pytest.approx(r["floor_ms"] / r["h200_fraction"])
    by = {(r["geometry"], r["weight_dtype"]): r["bytes_per_chunk"] for r in rs}
    for g in E.GEOMETRIES:
        assert by[(g, "int4")] < by[(g, "int8")] == by[(g, "fp8")] < by[(g, "bf16")]
        assert by[(g, "int8")] < 0.6 * by[(g, "bf16")]  # weights halve; the K/V rows and head stay bf16


def test_the_verdicts_follow_the_budget_and_the_memory():
    rs = E.rows(measured({"bf16": 1.0, "int8": 1.0, "fp8": 1.0, "int4": 1.0}))
    for r in rs:  # at 100 % efficiency the expected time is the floor: both verdicts agree
        assert r["fits"] == r["fits_at_floor"] == (r["floor_ms"] <= 31.0 and r["fits_memory"])
    orin = {(r["geometry"], r["weight_dtype"]): r for r in rs if r["gpu"].startswith("Jetson")}
    assert not orin[("1.5b", "bf16")]["fits"] and orin[("1.5b", "int4")]["fits_at_floor"]  # 93.5 vs 28.1 ms
    slow = E.rows(measured({"bf16": 0.01}), deadline_ms=33.0)
    assert not any(r["fits"] for r in slow)  # 100x the floor fits nowhere; unmeasured types are never "fits"
    assert all(r["expected_ms"] is None for r in slow if r["weight_dtype"] != "bf16")


def test_the_table_prints_a_row_per_setting_and_says_why_not(capsys):
    assert E.main([]) == 0  # no measured JSON: floors only
    out = capsys.readouterr().out
    assert "floors only" in out and out.count("| 1.5b |") == 8 and "| - | - |" in out
