"""Deterministic patch embedder: resize, patch order, projection, seeded init, pooled embedding."""
from __future__ import annotations

import numpy as np
import pytest

from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict
from vla_edge_ros.engine.interface import EngineError
from vla_edge_ros.engine.vision import PatchEmbedder, check_image, pooled, resize, seeded_vision_weights


@pytest.fixture
def cfg():
    return ModelConfig.from_json(tiny_default_dict())


def test_resize_identity_and_downscale():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (64, 128, 3), dtype=np.uint8)
    assert np.array_equal(resize(img, (64, 128)), img.astype(np.float32))  # same size: untouched
    big = np.kron(img, np.ones((4, 4, 1), dtype=np.uint8))  # 256 x 512, each pixel a 4x4 block
    assert np.array_equal(resize(big, (64, 128)), img.astype(np.float32))
    # 2x2 supersampling averages a 2x2 checkerboard cell to its mean
    checker = (np.indices((128, 256)).sum(axis=0) % 2 * 255).astype(np.uint8)[..., None].repeat(3, axis=2)
    assert np.allclose(resize(checker, (64, 128)), 127.5)


def test_upscale_and_odd_sizes():
    img = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    out = resize(img, (64, 128))
    assert out.shape == (64, 128, 3)
    assert np.array_equal(out[0, 0], img[0, 0].astype(np.float32)) and np.array_equal(out[-1, -1], img[-1, -1])
    assert out.min() >= img.min() and out.max() <= img.max()  # an average of source pixels, no overshoot
    # each output pixel averages 4 source samples: halves or quarters of integer sums
    assert np.allclose(out * 4, np.round(out * 4))


def test_patch_layout(cfg):
    emb = PatchEmbedder(cfg)
    img = np.zeros((64, 128, 3), np.uint8)
    img[16:32, 32:48, 1] = 255  # patch row 1, col 2 -> index 1*8 + 2 = 10, green channel
    p = emb.patches(img)
    assert p.shape == (32, 768) and p.dtype == np.float32
    assert np.all(p[10].reshape(16, 16, 3)[:, :, 1] == 0.5) and np.all(p[10].reshape(16, 16, 3)[:, :, 0] == -0.5)
    others = np.delete(p, 10, axis=0)
    assert np.all(others == -0.5)


def test_tokens_are_the_documented_linear_map(cfg):
    w = seeded_vision_weights(cfg)
    emb = PatchEmbedder(cfg)
    assert not emb.from_checkpoint
    img = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    tokens = emb(img)
    assert tokens.shape == (32, 256) and tokens.dtype == np.float32
    expect = emb.patches(img).astype(np.float64) @ w["vision.patch_embed.weight"].T.astype(np.float64) \
        + w["vision.patch_embed.bias"] + w["vision.pos_embed"]
    np.testing.assert_allclose(tokens, expect, rtol=1e-4, atol=1e-5)
    # the documented seeded init: default_rng(0), W then pos_embed, normal std 0.02
    rng = np.random.default_rng(0)
    assert np.array_equal(w["vision.patch_embed.weight"], rng.normal(0, 0.02, (256, 768)).astype(np.float32))
    assert np.array_equal(w["vision.pos_embed"], rng.normal(0, 0.02, (32, 256)).astype(np.float32))
    assert np.array_equal(PatchEmbedder(cfg)(img), tokens)  # deterministic


def test_checkpoint_weights_are_used(cfg):
    rng = np.random.default_rng(2)
    w = {"vision.patch_embed.weight": rng.standard_normal((256, 768)).astype(np.float32),
         "vision.patch_embed.bias": rng.standard_normal(256).astype(np.float32),
         "vision.pos_embed": rng.standard_normal((32, 256)).astype(np.float32)}
    emb = PatchEmbedder(cfg, w)
    assert emb.from_checkpoint
    img = np.full((10, 10, 3), 255, np.uint8)
    expect = (np.full((32, 768), 0.5) @ w["vision.patch_embed.weight"].T + w["vision.patch_embed.bias"]
              + w["vision.pos_embed"])
    np.testing.assert_allclose(emb(img), expect, rtol=1e-4, atol=1e-4)
    w["vision.pos_embed"] = np.zeros((31, 256), np.float32)
    with pytest.raises(EngineError, match=r"vision pos: expected shape \[32, 256\], found \[31, 256\]"):
        PatchEmbedder(cfg, w)


def test_greyscale_and_bad_images(cfg):
    emb = PatchEmbedder(cfg)
    grey = np.random.default_rng(3).integers(0, 256, (30, 40), dtype=np.uint8)
    assert np.array_equal(emb(grey), emb(np.repeat(grey[..., None], 3, axis=2)))
    for bad, msg in [(np.zeros((0, 10, 3), np.uint8), "empty"), (np.zeros((4, 4, 3), np.float32), "uint8"),
                     (np.zeros((4, 4, 4), np.uint8), "shape"), ([[1, 2]], "numpy array"),
                     (np.zeros((2, 2, 2, 3), np.uint8), "shape")]:
        with pytest.raises(ValueError, match=msg):
            emb(bad)


def test_pooled_is_the_token_mean(cfg):
    t = np.random.default_rng(4).standard_normal((32, 256)).astype(np.float32)
    p = pooled(t)
    assert p.shape == (256,) and p.dtype == np.float32
    np.testing.assert_allclose(p, t.mean(axis=0), rtol=1e-6)


def test_patches_gather_is_bit_identical_to_resize_then_the_grid(cfg):
    """patches() gathers the four supersamples straight into patch order (one numpy gather, cached indices); its
    values must be resize()'s + the patch grid's exactly, for any size, greyscale and non-contiguous images."""
    gh, gw = cfg.patch_grid
    p = cfg.patch_size

    def by_resize(img):
        x = resize(check_image(img), cfg.image_hw)
        x = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, p * p * 3)
        x *= 1.0 / 255.0
        x -= 0.5
        return x

    pe = PatchEmbedder(cfg)
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, s, dtype=np.uint8) for s in ((64, 64, 3), (480, 640, 3), (7, 13, 3), (200, 100),
                                                                 (120, 160, 1), tuple(cfg.image_hw) + (3,))]
    images.append(rng.integers(0, 256, (96, 256, 3), dtype=np.uint8)[:, ::2])  # a strided view
    for img in images:
        got, want = pe.patches(img), by_resize(img)
        assert got.dtype == np.float32 and got.shape == (cfg.n_patches, cfg.patch_dim)
        np.testing.assert_array_equal(got, want)
    for k in range(12):  # a stream of odd sizes keeps at most 8 index tables
        pe.patches(np.zeros((10 + k, 20, 3), np.uint8))
    assert len(pe._gather_cache) == 8
