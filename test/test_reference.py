"""engine/reference.py: the plain Qwen2 forward is right on hand-checkable cases, rotates at the config's RoPE
base, and NumpyEngine (the optimised CPU engine) matches it chunk for chunk on the tiny default checkpoint
through a stream that evicts under every policy."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from vla_edge_ros.core.kv.manager import KVManager
from vla_edge_ros.engine import reference as R
from vla_edge_ros.engine.checkpoint import expected_shapes, load_checkpoint
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict
from vla_edge_ros.engine.numpy_backend import NumpyEngine
from vla_edge_ros.engine.tiny_default import ensure_tiny_default

INSTRUCTION = "pick up the red block"  # 21 byte tokens, pinned
TPF = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The embedded default checkpoint, through the real writer and loader (bf16 on disk, float32 here)."""
    ckpt = ensure_tiny_default(tmp_path_factory.mktemp("cache"))
    cfg = ModelConfig.from_json(ckpt)
    return cfg, load_checkpoint(ckpt, cfg)


def small_cfg(**overrides) -> ModelConfig:
    d = tiny_default_dict()
    d.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, **overrides)
    if "rope_parameters" in overrides:  # as transformers 5.x writes config.json: no top-level rope_theta
        d.pop("rope_theta")
    return ModelConfig.from_json(d)


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Unit-scale matrices: attention is sharp, so positions (RoPE) change the output visibly."""
    rng = np.random.default_rng(seed)
    w = {}
    for name, shape in expected_shapes(cfg).items():
        scale = 1.0 / math.sqrt(shape[-1]) if len(shape) == 2 else 0.2
        w[name] = (1.0 if name.endswith("norm.weight") else 0.0) + scale * rng.standard_normal(shape)
    return w


def make_kv(cfg: ModelConfig, policy: str, frames: int = 5, window: int = 3) -> KVManager:
    budget = -(-(len(INSTRUCTION) + frames * TPF) // TPF) * TPF  # a whole number of blocks
    kv = KVManager(budget, TPF, len(INSTRUCTION), policy=policy, window_frames=window, embed_dim=cfg.hidden_size)
    assert kv.capacity_frames == frames
    return kv


def camera_stream(n: int, seed: int):
    """Scenes that hold for a few frames (sensor noise on top), then cut: semantic evicts inside a scene."""
    rng = np.random.default_rng(seed)
    scene = rng.integers(0, 256, (120, 160, 3))
    for _ in range(n):
        if rng.random() < 0.25:
            scene = rng.integers(0, 256, (120, 160, 3))
        yield np.clip(scene + rng.normal(0.0, 12.0, scene.shape), 0, 255).astype(np.uint8)


# ---- hand-checkable cases --------------------------------------------------------------------------------------

def test_attention_with_one_key_returns_its_value_for_each_query_head_group():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 4, 8))  # 3 queries, 4 query heads
    k, v = rng.standard_normal((1, 2, 8)), rng.standard_normal((1, 2, 8))  # 1 key, 2 KV heads
    out = R.attention(q, k, v, np.ones((3, 1), bool)).reshape(3, 4, 8)
    for h in range(4):  # heads 0, 1 read KV head 0; heads 2, 3 read KV head 1
        np.testing.assert_allclose(out[:, h], np.broadcast_to(v[0, h // 2], (3, 8)), rtol=0, atol=1e-15)


def test_attention_follows_the_visibility_mask():
    rng = np.random.default_rng(1)
    k, v = rng.standard_normal((3, 1, 4)), rng.standard_normal((3, 1, 4))
    visible = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], bool)  # causal-like rows, then a non-causal one
    out = R.attention(np.zeros((3, 2, 4)), k, v, visible).reshape(3, 2, 4)  # q = 0: equal weights
    want = np.stack([v[0, 0], (v[0, 0] + v[1, 0]) / 2, (v[1, 0] + v[2, 0]) / 2])
    for h in range(2):
        np.testing.assert_allclose(out[:, h], want, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="sees no key"):
        R.attention(np.zeros((2, 2, 4)), k, v, np.array([[1, 0, 0], [0, 0, 0]], bool))


def test_rope_is_the_identity_at_position_0_and_rotates_pairs_of_halves():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 3, 4))
    np.testing.assert_array_equal(R.apply_rope(x, *R.rope_cos_sin([0], 4, 1e4)), x)
    # head_dim 4, theta 1e4: dims (0, 2) turn by p rad, dims (1, 3) by p / 100 rad (theta ** (-2/4) = 1/100)
    p = 7
    got = R.apply_rope(x, *R.rope_cos_sin([p], 4, 1e4))[0]
    for lo, hi, a in ((0, 2, p), (1, 3, p / 100)):
        np.testing.assert_allclose(got[:, lo], x[0, :, lo] * math.cos(a) - x[0, :, hi] * math.sin(a), atol=1e-15)
        np.testing.assert_allclose(got[:, hi], x[0, :, hi] * math.cos(a) + x[0, :, lo] * math.sin(a), atol=1e-15)
    # scores depend on the position difference only: the reason an evicted cache may be renumbered
    q, k = rng.standard_normal((1, 1, 8)), rng.standard_normal((1, 1, 8))
    dots = [np.sum(R.apply_rope(q, *R.rope_cos_sin([m], 8, 1e6)) * R.apply_rope(k, *R.rope_cos_sin([n], 8, 1e6)))
            for m, n in ((5, 3), (105, 103), (4005, 4003))]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-10)


def test_rms_norm_of_a_constant_vector_and_the_silu_gate():
    w = np.array([1.0, 2.0, -0.5, 3.0])
    np.testing.assert_allclose(R.rms_norm(np.full((1, 4), 3.0), w, 1e-6), [3.0 / math.sqrt(9.0 + 1e-6) * w])
    np.testing.assert_array_equal(R.rms_norm(np.zeros((1, 4)), w, 1e-6), np.zeros((1, 4)))  # eps: no 0 / 0
    eye = np.eye(2)
    w = {"mlp.gate_proj.weight": eye, "mlp.up_proj.weight": eye, "mlp.down_proj.weight": eye}
    # silu(1) * 1 = 1 / (1 + e^-1); silu(-2) * -2 = 4 / (1 + e^2)
    np.testing.assert_allclose(R.mlp(np.array([[1.0, -2.0]]), w, ""), [[1 / (1 + math.e ** -1), 4 / (1 + math.e ** 2)]])


def test_forward_is_causal_and_a_cache_continues_it_exactly():
    cfg = small_cfg()
    w = R.load_weights(cfg, random_weights(cfg, seed=3))
    x = np.random.default_rng(4).standard_normal((12, cfg.hidden_size))
    h, kv = R.forward(cfg, w, x)
    changed = x.copy()
    changed[8:] += 1.0
    np.testing.assert_allclose(R.forward(cfg, w, changed)[0][:8], h[:8], rtol=0, atol=1e-12)  # no peeking ahead
    assert np.abs(R.forward(cfg, w, changed)[0][8:] - h[8:]).max() > 0.1
    h5, kv5 = R.forward(cfg, w, x[:5])
    h_rest, _ = R.forward(cfg, w, x[5:], past=kv5)  # positions 5..11 after 5 cached tokens
    np.testing.assert_allclose(np.concatenate([h5, h_rest]), h, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(kv5[1][0], kv[1][0][:5], rtol=1e-12, atol=1e-12)  # cached keys: pre-RoPE


def test_bad_weights_and_geometry_are_refused_and_float32_is_an_option():
    cfg = small_cfg()
    raw = random_weights(cfg, seed=5)
    with pytest.raises(ValueError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        R.load_weights(cfg, {k: v for k, v in raw.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match=r"o_proj.weight: expected shape \[64, 64\]"):
        R.load_weights(cfg, {**raw, "model.layers.0.self_attn.o_proj.weight": np.zeros((64, 32))})
    with pytest.raises(ValueError, match="pins 21 prefix tokens, the instruction encodes to 7 bytes"):
        R.start_stream(cfg, raw, make_kv(cfg, "fifo"), instruction="pick up")
    x = np.random.default_rng(6).standard_normal((10, cfg.hidden_size))
    h64 = R.forward(cfg, R.load_weights(cfg, raw), x)[0]
    h32 = R.forward(cfg, R.load_weights(cfg, raw, np.float32), x)[0]
    assert h32.dtype == np.float32
    np.testing.assert_allclose(h32, h64, rtol=0, atol=1e-4 * np.abs(h64).max())


def test_forward_rotates_at_the_rope_base_of_a_transformers5_config(monkeypatch):
    """config.json as transformers 5.x writes it: the base only inside rope_parameters. 1e5 is neither HF's
    default for an absent base (1e4) nor the value the parser used to fall back to (1e6), so a parser that
    ignored rope_parameters, or a reference that did not rotate at cfg.rope_theta, fails here."""
    cfg = small_cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    w = R.load_weights(cfg, random_weights(cfg, seed=7))
    x = np.random.default_rng(8).standard_normal((96, cfg.hidden_size))

    def logits(c: ModelConfig) -> np.ndarray:
        return R.action_logits(c, w, R.forward(c, w, x)[0])

    got = logits(cfg)
    for theta in (1e4, 1e6):  # the input is sensitive to the base: a wrong one moves the logits a lot
        assert np.abs(logits(dataclasses.replace(cfg, rope_theta=theta)) - got).max() > 0.05 * np.abs(got).max()

    def literal_1e5(positions, head_dim, theta, dtype=np.float64):  # ignores theta: the number in the file
        inv = np.array([1e5 ** (-2 * j / head_dim) for j in range(head_dim // 2)])
        angles = np.asarray(positions, dtype=np.float64)[:, None] * np.concatenate([inv, inv])[None, :]
        return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)

    monkeypatch.setattr(R, "rope_cos_sin", literal_1e5)
    np.testing.assert_allclose(logits(cfg), got, rtol=1e-9, atol=1e-9)


# ---- the optimised engine against the reference -----------------------------------------------------------------

def test_patch_embed_matches_the_engines_encode_frame(tiny):
    cfg, weights = tiny
    w = R.load_weights(cfg, weights)
    eng = NumpyEngine(cfg, weights, make_kv(cfg, "fifo"), instruction=INSTRUCTION)
    rng = np.random.default_rng(9)
    for shape in ((240, 320, 3), (37, 53, 3), (64, 128, 3), (90, 70)):  # down, odd, exact, greyscale up
        img = rng.integers(0, 256, shape, dtype=np.uint8)
        # float32 engine vs float64 reference: tokens are ~1, a 768-term dot product rounds at ~1e-7
        np.testing.assert_allclose(eng.encode_frame(img), R.patch_embed(cfg, w, img), rtol=0, atol=1e-5)


# float32 engine vs float64 reference: the measured worst logit difference on this stream is ~1e-6 (logits up to
# ~2; four layers of dot products up to 704 long in float32, eps 6e-8). LOGIT_TOL leaves 20x headroom. Equal
# greedy tokens are only meaningful if no choice is closer than that: each chunk's top-two gap must exceed
# 4 * LOGIT_TOL (the smallest measured is ~2.5e-4), so a rounding difference cannot flip a bin.
LOGIT_TOL = 2e-5


@pytest.mark.parametrize("policy", ["fifo", "semantic", "sliding_window"])
def test_numpy_engine_matches_the_reference_through_evictions(tiny, policy):
    cfg, weights = tiny
    eng = NumpyEngine(cfg, weights, make_kv(cfg, policy), instruction=INSTRUCTION, decode_tokens=8)
    ref = R.start_stream(cfg, weights, make_kv(cfg, policy), INSTRUCTION, decode_tokens=8)
    evictions, inner_evictions, n = 0, 0, 14
    for fid, image in enumerate(camera_stream(n, seed=10)):
        tokens = eng.encode_frame(image)
        before = eng.kv.frames
        got, want = eng.run_chunk(tokens, fid), R.reference_chunk(ref, tokens, fid)
        assert got.evicted_frames == want.evicted and eng.kv.frames == ref.kv.frames, f"frame {fid}"
        evictions += len(want.evicted)
        inner_evictions += sum(f != before[0] for f in want.evicted)
        top2 = np.sort(want.logits, axis=1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 4 * LOGIT_TOL, f"frame {fid}: near tie, pick another stream"
        np.testing.assert_allclose(eng.last_logits, want.logits, rtol=0, atol=LOGIT_TOL, err_msg=f"frame {fid}")
        np.testing.assert_array_equal(got.token_ids, want.token_ids, err_msg=f"frame {fid}")
        np.testing.assert_array_equal(got.action_bins, want.action_bins)
        np.testing.assert_array_equal(got.action, want.action)
    if policy == "fifo":
        assert evictions == n - 5 and eng.kv.frames == list(range(n - 5, n))
    elif policy == "sliding_window":
        assert evictions == n - 3 and eng.kv.frames == list(range(n - 3, n))  # the window, not the budget
    else:
        assert evictions == n - 5 and inner_evictions > 0, "semantic never evicted inside the retained frames"


def test_numpy_engine_reads_the_same_rope_base_as_the_reference():
    """The engine on the transformers 5.x config (base only in rope_parameters) against the reference."""
    cfg = small_cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    assert cfg.rope_theta == 1e5
    weights = {k: v.astype(np.float32) for k, v in random_weights(cfg, seed=11).items()}
    eng = NumpyEngine(cfg, weights, make_kv(cfg, "fifo", frames=2), instruction=INSTRUCTION)
    ref = R.start_stream(cfg, weights, make_kv(cfg, "fifo", frames=2), INSTRUCTION)
    rng = np.random.default_rng(12)
    for fid in range(4):
        tokens = rng.standard_normal((TPF, cfg.hidden_size)).astype(np.float32)
        got, want = eng.run_chunk(tokens, fid), R.reference_chunk(ref, tokens, fid)
        scale = np.abs(want.logits).max()
        np.testing.assert_allclose(eng.last_logits, want.logits, rtol=0, atol=1e-5 * scale, err_msg=f"frame {fid}")
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
