"""engine/quant_gptq.py: calibrated (GPTQ) quantisation in engine/quant.py's layouts. With nothing to correct (a
diagonal Hessian) it gives round-to-nearest's codes exactly; on correlated inputs it lowers the layer's output
error, also on inputs it was not calibrated on; the lazy block updates equal the column-by-column sweep; the
recorder sees exactly the inputs of the linear layers; calibration is sequential (layer L on layers < L quantised)
and its result is a model the pre-quantised checkpoint and the numpy engine take as they are."""
from __future__ import annotations

import numpy as np
import pytest

from vla_edge_ros.engine import quant as Q
from vla_edge_ros.engine import quant_checkpoint as QC
from vla_edge_ros.engine import quant_gptq as G
from vla_edge_ros.engine import reference as R
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict

from test_numpy_engine import random_weights

DTYPES = ["int8", "fp8", "int4"]


def correlated_inputs(n: int, k: int, seed: int) -> np.ndarray:
    """Rows x (n, k) with strongly correlated features, as activations are: a few shared directions plus noise."""
    rng = np.random.default_rng(seed)
    mix = np.random.default_rng(99).standard_normal((16, k))  # the same directions for every seed
    return rng.standard_normal((n, 16)) @ mix + 0.3 * rng.standard_normal((n, k))


def weight(out: int, k: int, seed: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((out, k)) / np.sqrt(k)).astype(np.float32)


def parts(q: Q.QuantizedLinear):
    return q.codes, q.scales, q.zeros


# ---- one weight -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_a_diagonal_hessian_gives_exactly_the_round_to_nearest_codes(weight_dtype):
    w = weight(24, 320)  # 320 = two int4 groups of 128 and a short one of 64
    h = np.diag(np.random.default_rng(2).uniform(0.5, 2.0, 320))
    g = G.gptq_linear(w, h, weight_dtype, int4_clip_grid=(1.0,))
    r = Q.quantize_linear(w, weight_dtype)
    assert g.layout == r.layout and g.shape == r.shape
    for a, b in zip(parts(g), parts(r)):
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_gptq_lowers_the_output_error_also_on_inputs_it_did_not_see(weight_dtype):
    w = weight(64, 256)
    x_cal, x_new = correlated_inputs(2000, 256, seed=3), correlated_inputs(2000, 256, seed=4)
    h_cal, h_new = x_cal.T @ x_cal, x_new.T @ x_new
    g = G.gptq_linear(w, h_cal, weight_dtype)
    r = Q.quantize_linear(w, weight_dtype)
    for h in (h_cal, h_new):
        assert G.output_error(w, g, h) < 0.6 * G.output_error(w, r, h)
    # ... while the weights themselves are further from the originals: the error went where the inputs are not
    assert np.linalg.norm(g.dequantize() - w) > np.linalg.norm(r.dequantize() - w)


@pytest.mark.parametrize("weight_dtype,blocks", [("int8", (1, 128)), ("fp8", (1, 96)), ("int4", (128, 256))])
def test_the_lazy_block_updates_equal_the_column_by_column_sweep(weight_dtype, blocks):
    w = weight(32, 512)
    x = correlated_inputs(1500, 512, seed=5)
    a, b = (G.gptq_linear(w, x.T @ x, weight_dtype, block=n) for n in blocks)
    assert np.mean(a.dequantize() == b.dequantize()) > 0.999  # float rounding may flip a code at a near tie
    ea, eb = G.output_error(w, a, x.T @ x), G.output_error(w, b, x.T @ x)
    assert abs(ea - eb) <= 1e-3 * ea


def test_the_int4_clip_search_never_does_worse_per_group_than_the_full_range():
    g = np.random.default_rng(6).standard_t(3, (40, 128)).astype(np.float32)  # heavy tails: clipping pays
    wts = np.ones(128)
    s1, z1 = G._int4_group_params(g, wts, (1.0,))
    s, z = G._int4_group_params(g, wts, G.INT4_CLIP_GRID)

    def err(s, z):
        q = np.clip(np.rint(g / Q._safe(s)[:, None]) + z[:, None], 0, 15)
        return (((q - z[:, None]) * s[:, None] - g) ** 2).sum(axis=1)
    assert np.all(err(s, z) <= err(s1, z1)) and np.any(err(s, z) < err(s1, z1))
    assert np.all((z >= 0) & (z <= 15) & (z == np.rint(z)))


@pytest.mark.parametrize("weight_dtype", ["int8", "fp8"])
def test_columns_no_input_reached_are_rounded_and_nothing_is_nan(weight_dtype):
    w = weight(16, 128)
    x = correlated_inputs(800, 128, seed=7)
    x[:, 40:60] = 0.0  # never driven during calibration
    g = G.gptq_linear(w, x.T @ x, weight_dtype)
    r = Q.quantize_linear(w, weight_dtype)
    assert np.all(np.isfinite(g.dequantize()))
    assert np.array_equal(g.codes[:, 40:60], r.codes[:, 40:60])  # no error was carried into them
    zero = G.gptq_linear(w, np.zeros((128, 128)), weight_dtype)  # nothing measured at all: plain rounding
    assert np.array_equal(zero.codes, r.codes)


def test_bad_input_is_refused_by_name():
    w = weight(8, 128)
    with pytest.raises(ValueError, match="Hessian must be finite"):
        G.gptq_linear(w, np.eye(64), "int8")
    with pytest.raises(ValueError, match="Hessian must be finite"):
        G.gptq_linear(w, np.full((128, 128), np.nan), "int8")
    with pytest.raises(ValueError, match="damp"):
        G.gptq_linear(w, np.eye(128), "int8", damp=0.0)
    with pytest.raises(ValueError, match="weight_dtype"):
        G.gptq_linear(w, np.eye(128), "int3")
    with pytest.raises(ValueError, match="int4_clip_grid"):
        G.gptq_linear(w, np.eye(128), "int4", int4_clip_grid=(1.2,))
    assert G.gptq_linear(w, np.eye(128), "bf16").weight_dtype == "bf16"


# ---- recording and calibrating a model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    d = tiny_default_dict()
    d.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=192, max_position_embeddings=1024, rope_theta=10000.0)
    cfg = ModelConfig.from_json(d)
    return cfg, d, random_weights(cfg, seed=3)


def frames(n: int, seed: int) -> list[np.ndarray]:
    """Camera-like frames: a flat background and a disc of another colour somewhere (pixels are correlated, as a
    camera's are; i.i.d. noise frames give inputs with no structure for calibration to find)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:32, 0:48]
    out = []
    for _ in range(n):
        img = np.empty((32, 48, 3))
        img[...] = rng.uniform(40, 200, 3)
        img[(xx - rng.uniform(5, 43)) ** 2 + (yy - rng.uniform(5, 27)) ** 2 < 40] = rng.uniform(0, 255, 3)
        out.append(img.astype(np.uint8))
    return out


def test_the_recorder_adds_exactly_the_inputs_of_the_wrapped_weights_and_changes_no_output(tiny):
    cfg, _, w = tiny
    wf = R.load_weights(cfg, w)
    x = np.random.default_rng(8).standard_normal((5, cfg.hidden_size))
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    rec = G.HessianRecorder(wf, names)
    h_rec, _ = R.forward(cfg, rec, x)
    h_plain, _ = R.forward(cfg, wf, x)
    assert np.array_equal(h_rec, h_plain)
    normed = R.rms_norm(x, wf["model.layers.0.input_layernorm.weight"], cfg.rms_norm_eps)  # q_proj's input
    np.testing.assert_allclose(rec.hessians[names[0]], normed.T @ normed, rtol=1e-12)
    assert rec.rows == {names[0]: 5, names[1]: 5}
    assert rec.hessians[names[1]].shape == (cfg.intermediate_size, cfg.intermediate_size)
    with pytest.raises(ValueError, match="no weight named"):
        G.HessianRecorder(wf, ["model.layers.9.mlp.up_proj.weight"])


def test_calibration_streams_every_prefill_and_decode_row(tiny):
    cfg, _, w = tiny
    seqs = [("push the puck", frames(3, 1)), ("close the drawer", frames(2, 2))]
    streams = G.CalibrationStreams(cfg, seqs, window_frames=2, decode_tokens=8)
    name = "model.layers.0.mlp.up_proj.weight"
    _, rows = streams.hessians(w, [name])
    steps = R.chunk_decode_steps(cfg, 8)  # one row per decode pass of each chunk, one per frame token
    assert rows[name] == 5 * (cfg.n_patches + steps)  # the instruction prefix (once per episode) is not recorded
    with pytest.raises(ValueError, match="at least one frame"):
        G.CalibrationStreams(cfg, [("x", [])])


def test_calibrate_is_sequential_and_gives_the_layouts_the_checkpoint_and_engine_take(tiny, tmp_path):
    cfg, d, w = tiny
    streams = G.CalibrationStreams(cfg, [("push the puck", frames(4, 3))], window_frames=2)
    seen = []
    hessians = streams.hessians

    def spy(weights, names):
        seen.append(({n: np.array(a) for n, a in weights.items() if Q.is_quantized_name(n)}, list(names)))
        return hessians(weights, names)
    streams.hessians = spy
    lines = []
    m = G.calibrate(cfg, w, "int4", streams, progress=lines.append)
    r = Q.quantize_weights(w, "int4")
    assert set(m.linear) == set(r.linear) and set(m.dense) == set(r.dense) and m.group_size == r.group_size
    assert len(lines) == cfg.num_hidden_layers and "layer 2/2" in lines[-1]
    assert "WARNING" in lines[0] and "mlp.down_proj" in lines[0]  # 4 frames x 40 rows < 4 x 192 inputs
    with pytest.raises(ValueError, match="no tensor model.layers.1.mlp.down_proj.weight"):
        G.calibrate(cfg, {n: a for n, a in w.items() if n != "model.layers.1.mlp.down_proj.weight"}, "int8",
                    streams, progress=None)
    # four stages per layer, in order; each recorded with every earlier weight quantised and itself still original
    order = [[n.split(".", 3)[3].rsplit(".", 1)[0] for n in names] for _, names in seen]
    assert order == [list(stage) for stage in G.STAGES] * cfg.num_hidden_layers
    done: list[str] = []
    for weights, names in seen:
        assert all(np.array_equal(weights[n], m.linear[n].dequantize()) for n in done)
        assert all(np.array_equal(weights[n], w[n]) for n in weights if n not in done)
        done += names
    assert sorted(done) == sorted(m.linear)
    QC.write_quantized_checkpoint(tmp_path, d, m)
    _, back = QC.read_quantized_checkpoint(tmp_path, "int4")
    assert all(np.array_equal(back.linear[n].codes, q.codes) for n, q in m.linear.items())


def hidden_error(cfg, w_ref, w_q, seqs, window=2):
    """Sum over every chunk of the final hidden state's squared error, streamed as an engine runs it."""
    total = 0.0
    for instruction, fr in seqs:
        out = []
        for weights in (w_ref, w_q):
            s = R.start_stream(cfg, weights, G.kv_manager(cfg, instruction, window), instruction, 8)
            toks = [R.patch_embed(cfg, s.w, f) for f in fr]
            out.append(np.stack([R.forward(cfg, s.w, t)[0][-1] for t in toks]))
        total += float(((out[0] - out[1]) ** 2).sum())
    return total


@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_a_calibrated_model_is_closer_to_the_original_than_rounding_on_frames_it_did_not_see(tiny, weight_dtype):
    cfg, _, w = tiny
    cal = [("push the puck", frames(20, 10))]
    new = [("push the puck", frames(6, 11))]
    m = G.calibrate(cfg, w, weight_dtype, G.CalibrationStreams(cfg, cal, window_frames=2), progress=None)
    r = Q.quantize_weights(w, weight_dtype)
    assert hidden_error(cfg, w, m.dequantized(), new) < hidden_error(cfg, w, r.dequantized(), new)


def test_trained_window_frames_reads_the_training_record(tmp_path):
    assert G.trained_window_frames(tmp_path) == (G.DEFAULT_WINDOW_FRAMES, "default")
    (tmp_path / "training_record.json").write_text('{"deploy": {"window_frames": 2}}')
    assert G.trained_window_frames(tmp_path)[0] == 2
    (tmp_path / "training_record.json").write_text('{"deploy": {"window_frames": 0}}')
    with pytest.raises(ValueError, match="window_frames"):
        G.trained_window_frames(tmp_path)
