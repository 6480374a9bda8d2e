"""engine/quant.py and engine/quant_checkpoint.py (issue 23): the e4m3 codec against a brute-force table of all 256
codes, each layout's error bound, the int4 nibble order, dequantise / matmul against a per-element brute force
written from the documented formulas, the pre-quantised checkpoint's round trip and refusals, and the quality of
the tiny default model under each weight_dtype against the issue's cosine bars (bench/quant_report.py)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from vla_edge_ros.bench.quant_report import print_report, report
from vla_edge_ros.engine import quant as Q
from vla_edge_ros.engine import quant_checkpoint as QC
from vla_edge_ros.engine.checkpoint import expected_shapes, load_checkpoint
from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.tiny_default import ensure_tiny_default

F32_EPS = 2.0 ** -24  # float32 unit roundoff: the slack of one division and one multiply


# ---- e4m3 --------------------------------------------------------------------------------------------------------

def brute_e4m3_values() -> list[float]:
    """Each code's value from the e4m3fn definition, in plain Python: bias 7, subnormals, S.1111.111 = NaN."""
    vals = []
    for c in range(256):
        s, e, m = c >> 7, (c >> 3) & 0xF, c & 0x7
        if e == 15 and m == 7:
            vals.append(math.nan)
            continue
        mag = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals.append(-mag if s else mag)
    return vals


def brute_e4m3_encode(x: float) -> int:
    """Nearest finite code by exhaustive search, ties to the even code, saturating at 448."""
    table = brute_e4m3_values()
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a >= 448.0:
        return sign | 0x7E
    best = min(range(127), key=lambda c: (abs(table[c] - a), c & 1))
    return sign | best


def test_e4m3_decode_matches_the_definition_for_all_256_codes():
    want = np.array(brute_e4m3_values(), dtype=np.float64)
    got = Q.e4m3_decode(np.arange(256, dtype=np.uint8)).astype(np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want).sum() == 2  # 0x7F, 0xFF
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok], want[ok]) and np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))
    assert np.nanmax(got) == 448.0 and not np.isinf(got).any()


def test_e4m3_encode_matches_the_brute_force_on_codes_ties_and_neighbours():
    pos = np.array(brute_e4m3_values()[:127], dtype=np.float32)  # the non-negative finite values, ascending
    mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)  # exact in float32: ties
    rng = np.random.default_rng(1)
    xs = np.concatenate([
        pos, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf)),
        np.exp2(rng.uniform(-14, 10, 400)).astype(np.float32),  # subnormal .. saturating
        np.array([0.0, 1e-45, 2.0 ** -10, 447.9, 448.0, 448.1, 464.0, 480.0, 1e6, 3e38, np.inf], np.float32),
    ])
    xs = np.concatenate([xs, -xs])
    got = Q.e4m3_encode(xs)
    want = np.array([brute_e4m3_encode(float(x)) for x in xs], dtype=np.uint8)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(float(xs[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    assert np.array_equal(Q.e4m3_encode(Q.e4m3_decode(codes)), codes)  # every finite code round-trips


def test_e4m3_encode_refuses_nan():
    with pytest.raises(ValueError, match="NaN"):
        Q.e4m3_encode(np.array([1.0, np.nan], np.float32))


# ---- error bounds ------------------------------------------------------------------------------------------------

def awkward_matrix(out: int, k: int, seed: int) -> np.ndarray:
    """Rows of very different scales, a zero row, an outlier, a one-signed row: the cases a scale gets wrong."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out, k)) * np.exp2(rng.uniform(-12, 4, (out, 1)))).astype(np.float32)
    w[1] = 0.0
    w[2, 7] *= 50.0
    w[3] = np.abs(w[3])
    return w


def test_int8_error_is_at_most_half_a_step_and_every_row_reaches_127():
    w = awkward_matrix(8, 300, seed=2)
    q = Q.quantize_int8(w)
    s = q.scales[:, None].astype(np.float64)
    err = np.abs(w - q.dequantize()).astype(np.float64)
    assert (err <= s / 2 * (1 + 1e-4) + 1e-45).all(), float((err / np.maximum(s, 1e-30)).max())
    nz = np.abs(w).max(axis=1) > 0
    assert (np.abs(q.codes.astype(int)).max(axis=1)[nz] == 127).all() and not q.codes[1].any()
    assert q.codes.min() >= -127


def test_fp8_error_is_at_most_half_an_e4m3_ulp_of_the_scaled_value():
    w = awkward_matrix(8, 300, seed=3)
    q = Q.quantize_fp8(w)
    s = q.scales[:, None].astype(np.float64)
    scaled = np.abs(w / np.where(s > 0, s, 1))
    half_ulp = np.where(scaled >= 2.0 ** -6, 2.0 ** (np.floor(np.log2(np.maximum(scaled, 2.0 ** -6))) - 4), 2.0 ** -10)
    err = np.abs(w - q.dequantize()).astype(np.float64)
    assert (err <= s * half_ulp * (1 + 1e-4) + s * 448 * 4 * F32_EPS).all()
    nz = np.abs(w).max(axis=1) > 0
    assert ((q.codes[nz] & 0x7F).max(axis=1) == 0x7E).all()  # each row's largest weight lands on +-448


def test_int4_error_is_at_most_half_a_step_in_every_group_including_a_short_last_one():
    w = awkward_matrix(6, 300, seed=4)  # 300 = 2 groups of 128 + a group of 44
    w[4, 128:256] = np.abs(w[4, 128:256]) + 1.0  # a group with no negative weight: its range still holds 0
    q = Q.quantize_int4(w)
    assert q.scales.shape == (6, 3) and q.zeros.shape == (6, 3) and q.codes.shape == (6, 150)
    g = np.arange(300) // 128
    s = q.scales[:, g].astype(np.float64)
    err = np.abs(w - q.dequantize()).astype(np.float64)
    assert (err <= s / 2 * (1 + 1e-4) + s * 16 * 4 * F32_EPS).all(), float((err / np.maximum(s, 1e-30)).max())
    assert q.zeros[4, 1] == 0 and q.zeros.max() <= 15 and not q.dequantize()[1].any()


# ---- int4 packing and the brute-force dequantise -----------------------------------------------------------------

def test_int4_packs_element_2j_into_the_low_nibble_and_pads_an_odd_row():
    assert Q.pack_int4(np.array([[1, 2, 3]])).tolist() == [[0x21, 0x03]]
    assert Q.pack_int4(np.array([[15, 0, 0, 15]])).tolist() == [[0x0F, 0xF0]]
    rng = np.random.default_rng(5)
    for k in (1, 2, 7, 128, 131):
        codes = rng.integers(0, 16, (3, k))
        assert np.array_equal(Q.unpack_int4(Q.pack_int4(codes), k), codes), k
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        Q.pack_int4(np.array([[16]]))


def test_int4_container_refuses_a_nonzero_padding_nibble():
    q = Q.quantize_int4(np.ones((2, 3), np.float32), group_size=2)
    codes = q.codes.copy()
    codes[0, -1] |= 0x50
    with pytest.raises(ValueError, match="padding nibble"):
        Q.QuantizedLinear("int4", codes, q.scales, (2, 3), q.zeros, 2)


def brute_dequantize(q: Q.QuantizedLinear) -> np.ndarray:
    """Element by element from docs/QUANTIZATION.md's formulas, no vectorised helper of quant.py."""
    out, k = q.shape
    w = np.zeros((out, k), np.float32)
    table = np.array(brute_e4m3_values(), np.float32)
    for r in range(out):
        for c in range(k):
            if q.weight_dtype == "int8":
                w[r, c] = np.float32(int(q.codes[r, c])) * q.scales[r]
            elif q.weight_dtype == "fp8":
                w[r, c] = table[int(q.codes[r, c])] * q.scales[r]
            else:
                byte = int(q.codes[r, c // 2])
                nib = byte & 0xF if c % 2 == 0 else byte >> 4
                g = c // q.group_size
                w[r, c] = np.float32(nib - int(q.zeros[r, g])) * q.scales[r, g]
    return w


@pytest.mark.parametrize("weight_dtype", ["int8", "fp8", "int4"])
def test_dequantize_and_matmul_equal_the_per_element_brute_force(weight_dtype):
    w = awkward_matrix(5, 261, seed=6)  # odd in_features, a short last int4 group
    q = Q.quantize_linear(w, weight_dtype)
    want = brute_dequantize(q)
    assert np.array_equal(q.dequantize(), want)  # bit for bit: what a kernel's dequantise step must produce
    x = np.random.default_rng(7).standard_normal((3, 261)).astype(np.float32)
    assert np.array_equal(q.matmul(x), x @ want.T)
    assert q.matmul(x[0]).shape == (5,)
    with pytest.raises(ValueError, match="features"):
        q.matmul(x[:, :260])
    assert q.bytes() == Q.quantized_nbytes(w.shape, weight_dtype) == {
        "int8": 5 * 261 + 5 * 4, "fp8": 5 * 261 + 5 * 4, "int4": 5 * 131 + 5 * 3 * 5}[weight_dtype]


# ---- a whole model -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ckpt = ensure_tiny_default(tmp_path_factory.mktemp("cache"))
    cfg = ModelConfig.from_json(ckpt)
    return cfg, json.loads((ckpt / "config.json").read_text()), load_checkpoint(ckpt, cfg)


def test_quantize_weights_touches_exactly_the_seven_projections_of_every_layer(tiny):
    cfg, _, w = tiny
    m = Q.quantize_weights(w, "int4")
    want = {f"model.layers.{i}.{p}.weight" for i in range(cfg.num_hidden_layers)
            for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(m.linear) == want == set(m.stats) and set(m.dense) == set(w) - want
    assert all(np.array_equal(m.dense[n], w[n]) for n in m.dense)
    assert m.linear_bytes() == sum(Q.quantized_nbytes(s, "int4") for n, s in expected_shapes(cfg).items()
                                   if Q.is_quantized_name(n))
    assert all(0 < s.rel_frobenius_error < 0.2 and s.bytes < s.bf16_bytes / 3 for s in m.stats.values())
    bf16 = Q.quantize_weights(w, "bf16")  # the tiny default is bf16 on disk: its bf16 container is exact
    assert max(s.max_abs_error for s in bf16.stats.values()) == 0.0


def test_quantize_weights_refuses_bad_input():
    with pytest.raises(ValueError, match="weight_dtype"):
        Q.quantize_weights({"model.layers.0.mlp.up_proj.weight": np.ones((2, 2))}, "int3")
    with pytest.raises(ValueError, match="no q/k/v/o"):
        Q.quantize_weights({"model.norm.weight": np.ones(4)}, "int8")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: .*non-finite"):
        Q.quantize_weights({"model.layers.0.mlp.up_proj.weight": np.array([[1.0, np.nan]])}, "int8")


# ---- the pre-quantised checkpoint --------------------------------------------------------------------------------

@pytest.mark.parametrize("weight_dtype", ["int8", "fp8", "int4"])
def test_quantized_checkpoint_round_trip(tiny, tmp_path, weight_dtype):
    cfg, cfg_dict, w = tiny
    m = Q.quantize_weights(w, weight_dtype)
    QC.write_quantized_checkpoint(tmp_path, cfg_dict, m)
    assert QC.is_quantized_checkpoint(tmp_path)
    cfg2, m2 = QC.read_quantized_checkpoint(tmp_path, weight_dtype)
    assert cfg2 == cfg and m2.weight_dtype == weight_dtype and m2.group_size == m.group_size
    assert set(m2.linear) == set(m.linear) and set(m2.dense) == set(m.dense)
    for n, q in m.linear.items():
        for part in ("codes", "scales", "zeros"):
            a, b = getattr(q, part), getattr(m2.linear[n], part)
            assert (a is None and b is None) or np.array_equal(a, b), (n, part)
    assert all(np.array_equal(m.dense[n], m2.dense[n]) for n in m.dense)
    assert m2.total_bytes() == m.total_bytes()


def write_int4(tiny, path):
    _, cfg_dict, w = tiny
    QC.write_quantized_checkpoint(path, cfg_dict, Q.quantize_weights(w, "int4"))
    return path


DROP = object()


def edit_block(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is DROP:
            cfg["quantization"].pop(key, None)
        else:
            cfg["quantization"][key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path, change):
    with safe_open(str(path / QC.QUANT_FILE), framework="numpy") as f:
        tensors, meta = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()
    change(tensors)
    save_file(tensors, str(path / QC.QUANT_FILE), metadata=meta)


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("edit, match", [
    (lambda p: edit_block(p, format_version=2), "format_version"),
    (lambda p: edit_block(p, act_order=True), "unknown key"),
    (lambda p: edit_block(p, layout="int4-asym-g128-highnibble"), "layout"),
    (lambda p: edit_block(p, group_size=64), "group_size"),
    (lambda p: edit_block(p, scale_dtype=DROP), "scale_dtype"),
    (lambda p: edit_block(p, weight_dtype="int2"), "weight_dtype"),
    (lambda p: edit_block(p, weight_dtype="int8", layout=Q.LAYOUTS["int8"], group_size=None), "metadata"),
    (lambda p: edit_tensors(p, lambda t: t.pop(Q_PROJ + ".zeros")), "missing tensor"),
    (lambda p: edit_tensors(p, lambda t: t.update({Q_PROJ: np.zeros((256, 256), np.float32)})), "unexpected"),
    (lambda p: edit_tensors(p, lambda t: t.update({Q_PROJ + ".scales": t[Q_PROJ + ".scales"].astype(np.float16)})),
     "expected F32"),
    (lambda p: edit_tensors(p, lambda t: t.update({Q_PROJ + ".zeros": t[Q_PROJ + ".zeros"] + 16})), "zero points"),
    (lambda p: (p / QC.QUANT_FILE).write_bytes((p / QC.QUANT_FILE).read_bytes()[:1000]), "not a readable"),
    (lambda p: (p / QC.QUANT_FILE).unlink(), "missing"),
])
def test_a_quantized_checkpoint_not_in_the_documented_layout_is_refused(tiny, tmp_path, edit, match):
    path = write_int4(tiny, tmp_path)
    QC.read_quantized_checkpoint(path)  # the unedited checkpoint reads
    edit(path)
    with pytest.raises(QC.QuantCheckpointError, match=match):
        QC.read_quantized_checkpoint(path)


def test_reader_refuses_the_wrong_weight_dtype_and_a_plain_checkpoint(tiny, tmp_path):
    path = write_int4(tiny, tmp_path / "q")
    with pytest.raises(QC.QuantCheckpointError, match="pre-quantised as int4, weight_dtype='int8'"):
        QC.read_quantized_checkpoint(path, "int8")
    plain = ensure_tiny_default(tmp_path / "cache")
    assert not QC.is_quantized_checkpoint(plain)
    with pytest.raises(QC.QuantCheckpointError, match="no 'quantization' block"):
        QC.read_quantized_checkpoint(plain)


def test_int8_code_minus_128_in_a_checkpoint_is_refused(tiny, tmp_path):
    _, cfg_dict, w = tiny
    QC.write_quantized_checkpoint(tmp_path, cfg_dict, Q.quantize_weights(w, "int8"))

    def poke(t):
        codes = t[Q_PROJ + ".qweight"].copy()
        codes[0, 0] = -128
        t[Q_PROJ + ".qweight"] = codes
    edit_tensors(tmp_path, poke)
    with pytest.raises(QC.QuantCheckpointError, match=rf"{Q_PROJ}: int8: code -128"):
        QC.read_quantized_checkpoint(tmp_path)


# ---- quality on the tiny default (issue 23's bars) ---------------------------------------------------------------

@pytest.fixture(scope="module")
def quality(tiny):
    cfg, _, w = tiny
    return report(cfg, w, frames=3, decode_tokens=8, seed=0)


def test_bf16_against_itself_is_exact_so_the_measurement_can_tell(quality):
    r = quality["bf16"]
    assert min(r["hidden_cos"] + r["logits_cos"]) > 1 - 1e-12
    assert r["token_agreement"] == r["bin_agreement"] == 1.0


@pytest.mark.parametrize("weight_dtype", ["int8", "fp8", "int4"])
def test_the_frame_step_meets_the_issue_bar(quality, weight_dtype):
    r = quality[weight_dtype]
    assert min(r["hidden_cos"][0], r["logits_cos"][0]) >= r["threshold"], (r["hidden_cos"][0], r["logits_cos"][0])


# Measured on the tiny default (random N(0, 0.02) weights, 2 layers; bench/quant_report.py): at the decode steps
# the input is a small token embedding, so the hidden state is almost all decoder output and carries the whole
# weight error. fp8 e4m3 has ~2.6 % relative weight error (3 mantissa bits), int4 g128 ~10 %; 1 - cos came out
# at ~3 x that squared: fp8 min 0.99773, int4 min 0.96671. The issue's bars are not met there; not loosened.
DECODE_MISS = "the issue's bar is not met at decode steps on random weights (measured fp8 0.9977, int4 0.967)"


@pytest.mark.parametrize("weight_dtype", ["int8", pytest.param("fp8", marks=pytest.mark.xfail(strict=True,
                                          reason=DECODE_MISS)),
                                          pytest.param("int4", marks=pytest.mark.xfail(strict=True,
                                                                                      reason=DECODE_MISS))])
def test_every_decode_step_meets_the_issue_bar(quality, weight_dtype):
    r = quality[weight_dtype]
    worst = min(r["hidden_cos"] + r["logits_cos"])
    assert worst >= r["threshold"], f"{weight_dtype}: worst cosine {worst:.6f} < {r['threshold']}"


def test_output_error_tracks_the_weight_error(quality):
    """Quantisation noise as independent noise: 1 - cos within a few times the squared relative weight error,
    and more bits never worse. A scale, group or nibble mix-up breaks this by orders of magnitude."""
    for wd in ("int8", "fp8", "int4"):
        r = quality[wd]
        bound = 5 * r["mean_rel_frobenius_error"] ** 2
        assert max(1 - c for c in r["hidden_cos"] + r["logits_cos"]) <= bound, wd
    worst = {wd: min(quality[wd]["hidden_cos"] + quality[wd]["logits_cos"]) for wd in quality}
    assert worst["int8"] > worst["fp8"] > worst["int4"]
    assert quality["int4"]["linear_vs_bf16"] < 0.3 and quality["int8"]["linear_vs_bf16"] < 0.51


def test_the_report_prints_every_dtype_side_by_side_with_its_verdict(quality, capsys):
    print_report(quality)
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == list(quality)
    assert sum(line.startswith("logits_cos step") for line in out.splitlines()) == 9
    for wd, r in quality.items():
        verdict = "meets" if min(r["hidden_cos"] + r["logits_cos"]) >= r["threshold"] else "MISSES"
        assert f"{wd}: worst hidden/logits cosine" in out and f"{verdict} the {r['threshold']} bar" in out


def test_the_deadline_advice_names_the_weight_type_and_the_smaller_ones():
    """The start-up deadline_fit warning's weight-type advice (inference_node): the smaller types by their bytes."""
    a = Q.fit_advice("bf16")
    assert "smaller than bf16" in a and "int8: 0.50x" in a and "fp8: 0.50x" in a and "int4: 0.27x" in a
    assert Q.fit_advice("int8") == "weights smaller than int8 (weight_dtype int4: 0.54x the bytes)"
    assert "fp8" not in Q.fit_advice("int8") and Q.fit_advice("int4") == "weight_dtype int4 is already the smallest type"
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        Q.fit_advice("int2")
