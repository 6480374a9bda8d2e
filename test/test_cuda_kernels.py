"""Each CUDA kernel (cuda/*.cu) against a float64 numpy reference on fresh random inputs (GPU only).

Outputs are poisoned (all bits set: NaN in fp32 and bf16) before every launch, so an element the kernel fails
to write shows up as NaN. Skips cleanly without PyCUDA or a GPU.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from vla_edge_ros.engine.cuda.buffers import interleave_gate_up
from vla_edge_ros.engine.cuda.kernels import KERNEL_FILES
from vla_edge_ros.engine.cuda.pass_meta import meta_record
from vla_edge_ros.engine.cuda.plan import LaunchConstants, gemm4_grid
from vla_edge_ros.engine.cuda.probe import CUDA_DIR, cuda_status

pytestmark = pytest.mark.gpu

LOG2E = math.log2(math.e)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def bits_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def rand_bf16(rng, shape, std=1.0):
    """(bits, float64 values) of a random bf16 tensor."""
    b = bf16_bits(rng.standard_normal(shape).astype(np.float32) * std)
    return b, bits_f32(b).astype(np.float64)


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    assert np.all(np.isfinite(out)), f"{np.count_nonzero(~np.isfinite(out))} outputs not written / not finite"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def rope_table(npos: int, hd: int, theta: float) -> np.ndarray:
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    ang = np.arange(npos, dtype=np.float64)[:, None] * inv[None, :]
    cs = np.empty((npos, hd // 2, 2), np.float32)
    cs[..., 0], cs[..., 1] = np.cos(ang), np.sin(ang)
    return cs


def rope_ref(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """x (..., n, hd) float64 rotated at positions (n,) (HF rotate_half)."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    ang = pos.astype(np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang), np.sin(ang)
    lo, hi = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1)


class Dev:
    def __init__(self, cuda, mods):
        self.cuda, self.mods = cuda, mods
        self.bufs = []

    def fn(self, name):
        for m in self.mods.values():
            try:
                return m.get_function(name)
            except self.cuda.LogicError:
                continue
        raise KeyError(name)

    def up(self, a: np.ndarray):
        a = np.ascontiguousarray(a)
        buf = self.cuda.mem_alloc(max(a.nbytes, 4))
        self.cuda.memcpy_htod(buf, a)
        self.bufs.append(buf)
        return buf

    def poisoned(self, nbytes: int):
        buf = self.cuda.mem_alloc(nbytes)
        self.cuda.memset_d8(buf, 0xFF, nbytes)
        self.bufs.append(buf)
        return buf

    def down(self, buf, shape, dtype):
        out = np.empty(shape, dtype)
        self.cuda.Context.synchronize()
        self.cuda.memcpy_dtoh(out, buf)
        return out

    def free(self):
        for b in self.bufs:
            b.free()
        self.bufs = []


def open_dev(files):
    """A Dev over ``files`` of cuda/ compiled for the GPU present, in the primary context (a generator for a
    fixture to yield from; skips without a usable GPU). $VLA_CUDA_DEFINES (the engine's measuring knobs) apply
    here too, so a knob's build meets the same float64 references."""
    ok, why = cuda_status()
    if not ok:
        pytest.skip(f"no usable GPU: {why}")
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule
    knobs = ["-D" + d for d in os.environ.get("VLA_CUDA_DEFINES", "").split()]
    ctx = cuda.Device(0).retain_primary_context()
    ctx.push()
    try:
        mods = {f: SourceModule((CUDA_DIR / f).read_text(), no_extern_c=True, include_dirs=[str(CUDA_DIR)],
                                options=["-O3", "-std=c++17", *knobs]) for f in files}
        d = Dev(cuda, mods)
        yield d
        d.free()
    finally:
        ctx.pop()


@pytest.fixture(scope="module")
def dev():
    yield from open_dev(KERNEL_FILES)


@pytest.fixture
def rng():
    return np.random.default_rng()


I32, F32 = np.int32, np.float32
G4_SMEM = LaunchConstants().G4_SMEM


def set_smem(dev, f, nbytes):
    if nbytes > 48 * 1024:
        f.set_attribute(dev.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)


@pytest.mark.parametrize("N,K,ks", [(2048, 1536, 256), (1536, 8960, 832), (1152, 896, 896), (1536, 1536, 1536)])
def test_gemm32_atomic(dev, rng, N, K, ks):
    a_b, a = rand_bf16(rng, (32, K))
    w_b, w = rand_bf16(rng, (N, K), 0.05)
    c0 = rng.standard_normal((32, N)).astype(np.float32)
    C = dev.up(c0)
    dev.fn("gemm32_atomic")(dev.up(a_b), I32(K), dev.up(w_b), I32(N), I32(K), I32(ks), C, I32(N), block=(256, 1, 1),
                            grid=(math.ceil(N / 128), math.ceil(K / ks)))
    assert rel_err(dev.down(C, (32, N), np.float32), c0 + a @ w.T) < 1e-5


@pytest.mark.parametrize("I,K", [(8960, 1536), (704, 256), (4864, 896)])
def test_gemm32_silu(dev, rng, I, K):
    a_b, a = rand_bf16(rng, (32, K))
    g_b, g = rand_bf16(rng, (I, K), 0.05)
    u_b, u = rand_bf16(rng, (I, K), 0.05)
    act = dev.poisoned(2 * 32 * I)
    dev.fn("gemm32_silu")(dev.up(a_b), I32(K), dev.up(interleave_gate_up(g_b, u_b)), I32(2 * I), I32(K), act,
                          block=(256, 1, 1), grid=(math.ceil(2 * I / 128), 1))
    gg, uu = a @ g.T, a @ u.T
    assert rel_err(bits_f32(dev.down(act, (32, I), np.uint16)), gg / (1 + np.exp(-gg)) * uu) < 1e-2


@pytest.mark.parametrize("N,K,grid", [(2048, 1536, None), (1536, 8960, None), (1536, 1536, None), (896, 4864, None),
                                      (1152, 896, None), (1536, 8960, (7, 13)), (48, 1536, (5, 1)), (64, 96, (3, 2))])
def test_gemm32v4_atomic(dev, rng, N, K, grid):
    """gemm32v4: the engine's grids (gemm4_grid on 132 SMs) and odd ones (more blocks than row groups, splits of
    uneven K ranges, warps without a k32 step: K = 96 has 3 steps for 8 warps)."""
    a_b, a = rand_bf16(rng, (32, K))
    w_b, w = rand_bf16(rng, (N, K), 0.05)
    c0 = rng.standard_normal((32, N)).astype(np.float32)
    C = dev.up(c0)
    grid = grid or gemm4_grid(N, K, 132)
    f = dev.fn("gemm32v4_atomic")
    set_smem(dev, f, G4_SMEM)
    f(dev.up(a_b), I32(K), dev.up(w_b), I32(N), I32(K), C, I32(N), block=(256, 1, 1), grid=grid, shared=G4_SMEM)
    assert rel_err(dev.down(C, (32, N), np.float32), c0 + a @ w.T) < 1e-5


@pytest.mark.parametrize("I,K,grid", [(8960, 1536, None), (4864, 896, None), (704, 256, None), (704, 256, (200, 1)),
                                      (8960, 1536, (17, 1))])
def test_gemm32v4_silu(dev, rng, I, K, grid):
    a_b, a = rand_bf16(rng, (32, K))
    g_b, g = rand_bf16(rng, (I, K), 0.05)
    u_b, u = rand_bf16(rng, (I, K), 0.05)
    act = dev.poisoned(2 * 32 * I)
    grid = grid or gemm4_grid(2 * I, K, 132, max_splits=1)
    f = dev.fn("gemm32v4_silu")
    set_smem(dev, f, G4_SMEM)
    f(dev.up(a_b), I32(K), dev.up(interleave_gate_up(g_b, u_b)), I32(2 * I), I32(K), act, block=(256, 1, 1),
      grid=grid, shared=G4_SMEM)
    gg, uu = a @ g.T, a @ u.T
    assert rel_err(bits_f32(dev.down(act, (32, I), np.uint16)), gg / (1 + np.exp(-gg)) * uu) < 1e-2


@pytest.mark.parametrize("H,G,nkv_heads,hd", [(1536, 6, 2, 128), (896, 7, 2, 64)])
def test_gemv_qkv(dev, rng, H, G, nkv_heads, hd):
    """Also asks L2 for the older keys' cache rows (meta[3] = 40 of them): that must not change a result (nor
    fault); only the token's slot is written in the cache."""
    nq, nkv = H, nkv_heads * hd
    N = nq + 2 * nkv
    x = rng.standard_normal(H).astype(np.float32)
    nw_b, nw = rand_bf16(rng, H)
    w_b, w = rand_bf16(rng, (N, H), 0.05)
    bias = rng.standard_normal(N).astype(np.float32)
    slots_n = 64
    key_slots = rng.permutation(slots_n).astype(np.int32)
    meta = np.array([0, 0, 0, 40], np.int32)
    step = 3
    slot = key_slots[meta[3] + step - 1]
    q = dev.poisoned(4 * nq)
    kc, vc = dev.poisoned(2 * slots_n * nkv), dev.poisoned(2 * slots_n * nkv)
    dev.fn("gemv_qkv")(dev.up(x), dev.up(nw_b), F32(1e-6), dev.up(w_b), dev.up(bias), I32(H), I32(nq), I32(nkv), q,
                       kc, vc, dev.up(key_slots), dev.up(meta), I32(step), block=(256, 1, 1),
                       grid=(math.ceil(N / 16), 1), shared=4 * H)
    xd = x.astype(np.float64)
    h = xd / np.sqrt(np.mean(xd * xd) + 1e-6) * nw
    y = w @ h + bias
    assert rel_err(dev.down(q, nq, np.float32), y[:nq]) < 1e-5
    K, V = dev.down(kc, (slots_n, nkv), np.uint16), dev.down(vc, (slots_n, nkv), np.uint16)
    kout, vout = bits_f32(K[slot]), bits_f32(V[slot])
    assert (np.delete(K, slot, axis=0) == 0xFFFF).all() and (np.delete(V, slot, axis=0) == 0xFFFF).all()
    assert rel_err(kout, y[nq:nq + nkv]) < 1e-2
    assert rel_err(vout, y[nq + nkv:]) < 1e-2


@pytest.mark.parametrize("N,K,ks", [(1536, 1536, 1536), (1536, 8960, 4608), (896, 4864, 1024), (1536, 1536, 768)])
def test_gemv_resid(dev, rng, N, K, ks):
    v = rng.standard_normal(K).astype(np.float32)
    w_b, w = rand_bf16(rng, (N, K), 0.05)
    x0 = rng.standard_normal(N).astype(np.float32)
    x = dev.up(x0)
    dev.fn("gemv_resid")(dev.up(v), dev.up(w_b), I32(N), I32(K), I32(ks), x, block=(256, 1, 1),
                         grid=(math.ceil(N / 16), math.ceil(K / ks)), shared=4 * ks)
    assert rel_err(dev.down(x, N, np.float32), x0 + w @ v.astype(np.float64)) < 1e-5


def test_gemv_gateup(dev, rng):
    I, K = 8960, 1536
    x = rng.standard_normal(K).astype(np.float32)
    nw_b, nw = rand_bf16(rng, K)
    g_b, g = rand_bf16(rng, (I, K), 0.05)
    u_b, u = rand_bf16(rng, (I, K), 0.05)
    act = dev.poisoned(4 * I)
    dev.fn("gemv_gateup")(dev.up(x), dev.up(nw_b), F32(1e-6), dev.up(interleave_gate_up(g_b, u_b)), I32(I), I32(K),
                          act, block=(256, 1, 1), grid=(I // 8, 1), shared=4 * K)
    xd = x.astype(np.float64)
    h = xd / np.sqrt(np.mean(xd * xd) + 1e-6) * nw
    gg, uu = g @ h, u @ h
    assert rel_err(dev.down(act, I, np.float32), gg / (1 + np.exp(-gg)) * uu) < 1e-5


@pytest.mark.parametrize("use_norm", [True, False])
def test_gemv_logits(dev, rng, use_norm):
    """One row (meta[2] - 1), normed or not."""
    K, N, T = 1536, 256, 32
    x = rng.standard_normal((T, K)).astype(np.float32)
    nw_b, nw = rand_bf16(rng, K)
    w_b, w = rand_bf16(rng, (N, K), 0.05)
    meta = np.array([0, 0, 17, 0], np.int32)  # row meta[2]-1 = 16
    logits = dev.poisoned(4 * N)
    norm_out = dev.poisoned(4 * K)
    dev.fn("gemv_logits")(dev.up(x), dev.up(meta), I32(2), dev.up(nw_b) if use_norm else np.intp(0), F32(1e-6),
                          dev.up(w_b), I32(N), I32(K), logits, norm_out if use_norm else np.intp(0),
                          block=(256, 1, 1), grid=(N // 8, 1), shared=4 * K)
    xd = x[16].astype(np.float64)
    h = xd / np.sqrt(np.mean(xd * xd) + 1e-6) * nw if use_norm else xd
    assert rel_err(dev.down(logits, N, np.float32), w @ h) < 1e-5
    if use_norm:
        assert rel_err(dev.down(norm_out, K, np.float32), h) < 1e-6


def test_gemv_logits_rows_of_grid_y(dev, rng):
    """grid.y = 28 rows from row 0 (row_meta -1: the parallel pass's heads): row y -> logits[y * N ..]; the
    rows after them stay unwritten (poisoned)."""
    K, N, T, A = 1536, 256, 32, 28
    x = rng.standard_normal((T, K)).astype(np.float32)
    w_b, w = rand_bf16(rng, (N, K), 0.05)
    logits = dev.poisoned(4 * N * (A + 1))
    dev.fn("gemv_logits")(dev.up(x), dev.up(np.zeros(8, np.int32)), I32(-1), np.intp(0), F32(1e-6), dev.up(w_b),
                          I32(N), I32(K), logits, np.intp(0), block=(256, 1, 1), grid=(N // 8, A), shared=4 * K)
    got = dev.down(logits, (A + 1, N), np.float32)
    assert rel_err(got[:A], x[:A].astype(np.float64) @ w.T) < 1e-5
    assert np.all(np.isnan(got[A]))


@pytest.mark.parametrize("H", [1536, 896, 2500])  # 2500 > 8 x 256: the kernel's loop path instead of registers
def test_rmsnorm_rows(dev, rng, H):
    T, nb = 32, 2048
    x = (rng.standard_normal((T, H)) * rng.uniform(0.1, 10, (T, 1))).astype(np.float32)
    w_b, w = rand_bf16(rng, H)
    bias = rng.standard_normal(nb).astype(np.float32)
    out = dev.poisoned(2 * T * H)
    bout = dev.poisoned(4 * T * nb)
    xb = dev.up(x)
    dev.fn("rmsnorm_rows_bf16")(xb, dev.up(w_b), out, I32(H), F32(1e-6), dev.up(bias), bout, I32(nb),
                                block=(256, 1, 1), grid=(T, 1))
    xd = x.astype(np.float64)
    ref = xd / np.sqrt(np.mean(xd * xd, axis=1, keepdims=True) + 1e-6) * w
    assert rel_err(bits_f32(dev.down(out, (T, H), np.uint16)), ref) < 1e-2
    np.testing.assert_array_equal(dev.down(bout, (T, nb), np.float32), np.broadcast_to(bias, (T, nb)))
    out32 = dev.poisoned(4 * T * H)
    dev.fn("rmsnorm_rows_f32")(xb, dev.up(w_b), out32, I32(H), F32(1e-6), block=(256, 1, 1), grid=(T, 1))
    assert rel_err(dev.down(out32, (T, H), np.float32), ref) < 1e-6


def test_embed_gather(dev, rng):
    V, H = 1000, 1536
    e_b, e = rand_bf16(rng, (V, H))
    toks = rng.integers(0, V, 5).astype(np.int32)
    x = dev.poisoned(4 * H)
    dev.fn("embed_gather")(dev.up(e_b), dev.up(toks), I32(3), x, I32(H), block=(256, 1, 1), grid=(6, 1))
    np.testing.assert_array_equal(dev.down(x, H, np.float32), e[toks[3]].astype(np.float32))


def test_argmax_tokens(dev, rng):
    n = 256
    free = dev.up(np.full(4, -1, np.int32))
    for trial in range(3):
        logits = rng.standard_normal(n).astype(np.float32)
        if trial == 2:  # a tie: the lowest index wins, like numpy.argmax
            i, j = sorted(rng.choice(n, 2, replace=False))
            logits[i] = logits[j] = logits.max() + 1.0
        tok = dev.up(np.full(4, -1, np.int32))
        dev.fn("argmax_tokens")(dev.up(logits), I32(n), I32(151680), tok, I32(2), free, block=(256, 1, 1),
                                grid=(1, 1))
        got = dev.down(tok, 4, np.int32)
        assert got[2] == 151680 + int(np.argmax(logits))
        assert got[0] == got[1] == got[3] == -1


def test_argmax_tokens_rows_and_forced_ids(dev, rng):
    """grid.x = 5 rows from out_index 1 (the parallel pass's): block b argmaxes logits[b * n ..] into tok_buf[1 + b],
    or writes forced[1 + b] where that is >= 0 (a forced prefix); nothing outside those entries is written."""
    n, rows, off = 256, 5, 151680
    logits = rng.standard_normal((rows, n)).astype(np.float32)
    forced = np.array([-1, off + 7, -1, off + 255, -1, -1, -1], np.int32)
    tok = dev.up(np.full(7, -2, np.int32))
    dev.fn("argmax_tokens")(dev.up(logits), I32(n), I32(off), tok, I32(1), dev.up(forced), block=(256, 1, 1),
                            grid=(rows, 1))
    want = np.full(7, -2, np.int32)
    want[1:1 + rows] = np.argmax(logits, axis=1) + off
    want[[1, 3]] = forced[[1, 3]]
    np.testing.assert_array_equal(dev.down(tok, 7, np.int32), want)


def test_kv_move(dev, rng):
    """Relocation of K/V rows over 2 layers (a budget shrink): rows src -> dst in every layer, nothing else moves."""
    nkv, S = 256, 100
    K, Vv = rand_bf16(rng, (S, nkv))[0], rand_bf16(rng, (S, nkv))[0]
    # relocation over 2 layers
    L2 = np.stack([K, K[::-1]]), np.stack([Vv, Vv[::-1]])
    kc2, vc2 = dev.up(L2[0]), dev.up(L2[1])
    src = np.array([90, 91, 95], np.int32)
    dst = np.array([3, 4, 7], np.int32)
    dev.fn("kv_move")(kc2, vc2, I32(2), I32(S), I32(nkv), dev.up(src), dev.up(dst), I32(3), block=(256, 1, 1),
                      grid=(8, 1))
    Kn = dev.down(kc2, (2, S, nkv), np.uint16)
    Vn = dev.down(vc2, (2, S, nkv), np.uint16)
    expK, expV = L2[0].copy(), L2[1].copy()
    expK[:, dst] = L2[0][:, src]
    expV[:, dst] = L2[1][:, src]
    np.testing.assert_array_equal(Kn, expK)
    np.testing.assert_array_equal(Vn, expV)


def attention_ref(q, kc, vc, key_slots, n_keys, qpos, theta, G, causal=True):
    """q (T, Hq, hd) pre-RoPE at positions qpos (T,); keys j < n_keys at slot key_slots[j], position j; causal:
    key j visible to row t iff j <= qpos[t], else every key (the parallel pass)."""
    T, Hq, hd = q.shape
    n_kvh = Hq // G
    keys = kc[key_slots[:n_keys]].reshape(n_keys, n_kvh, hd).transpose(1, 0, 2)
    vals = vc[key_slots[:n_keys]].reshape(n_keys, n_kvh, hd).transpose(1, 0, 2)
    kr = rope_ref(keys, np.arange(n_keys), theta)
    qr = rope_ref(q.transpose(1, 0, 2), qpos, theta)  # (Hq, T, hd)
    out = np.empty((T, Hq, hd))
    for h in range(Hq):
        s = qr[h] @ kr[h // G].T / math.sqrt(hd)
        if causal:
            s[np.arange(n_keys)[None, :] > qpos[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[:, h] = p @ vals[h // G]
    return out.reshape(T, Hq * hd)


KPS = 64  # keys per split of both attention kernels (cuda/attn_core.cuh ATT_KC)
MERGES = (("attn_combine", 1), ("attn_combine_v2", 2), ("attn_combine_v4", 4))  # (kernel, dims per thread)


# p0 = L - 32 at a split boundary (4064 = 63 x 64), inside a split (146), and a cache with no older keys (L = 32).
# groups > 0: the head-group kernel attn_prefill_hd*_hg with that many groups of ceil(G / groups) heads: Qwen2.5-3B
# (8 heads per KV head, 2 x 4), 7B (7: 4 + 3, a group with an idle warp pair), 16 heads on one KV head at 64.
# bidir: meta[4] set, the parallel pass (28 valid rows = H 4 x 7 slots, at a split boundary and inside a split; a
# row must see the slots after it, which a causal mask would hide).
@pytest.mark.parametrize("hd,G,n_kvh,L,groups,valid,bidir", [
    (128, 6, 2, 4096, 0, 32, False), (128, 6, 2, 178, 0, 32, False), (64, 7, 2, 1000, 0, 32, False),
    (64, 2, 2, 32, 0, 32, False), (128, 8, 2, 4096, 2, 32, False), (128, 7, 4, 178, 2, 32, False),
    (64, 16, 1, 300, 2, 32, False), (128, 6, 1, 100, 3, 32, False),
    (128, 6, 2, 4092, 0, 28, True), (64, 7, 2, 178, 0, 28, True), (128, 8, 2, 1000, 2, 28, True)])
def test_attention_prefill(dev, rng, hd, G, n_kvh, L, groups, valid, bidir):
    """Keys j < p0 from the cache (staged before the PDL wait), this chunk's keys j >= p0 from the QKV output, which
    the kernel also stores in the cache (bf16, pre-RoPE); every other cache row stays as it was. Every merge whose
    dims per thread divide the head. ``valid`` rows of the 32 carry keys (L = p0 + valid)."""
    T, theta = 32, 1e6
    Hq = G * n_kvh
    nq, nkv = Hq * hd, n_kvh * hd
    ld = nq + 2 * nkv
    S = L + 40
    key_slots = rng.permutation(S).astype(np.int32)
    kc_b, _ = rand_bf16(rng, (S, nkv))
    vc_b, _ = rand_bf16(rng, (S, nkv))
    qkv = rng.standard_normal((T, ld)).astype(np.float32)
    p0 = L - valid
    kc_exp, vc_exp = kc_b.copy(), vc_b.copy()
    fresh = key_slots[p0:L]
    kc_exp[fresh] = bf16_bits(qkv[:valid, nq:nq + nkv])
    vc_exp[fresh] = bf16_bits(qkv[:valid, nq + nkv:])
    meta = np.array(meta_record(L, p0, valid, p0, bidirectional=bidir), np.int32)
    cs = rope_table(S + 64, hd, theta)
    nsplit = math.ceil(L / KPS)
    rows = Hq * T
    part_o, part_ml = dev.poisoned(4 * nsplit * rows * hd), dev.poisoned(8 * nsplit * rows)
    meta_d = dev.up(meta)
    kc_d, vc_d = dev.up(kc_b), dev.up(vc_b)
    name, per = (f"attn_prefill_hd{hd}_hg", -(-G // groups)) if groups else (f"attn_prefill_hd{hd}", G)
    dev.fn(name)(dev.up(qkv), I32(ld), kc_d, vc_d, dev.up(key_slots), meta_d, dev.up(cs), I32(G), I32(n_kvh),
                 F32(LOG2E / math.sqrt(hd)), part_o, part_ml, block=(64 * per, 1, 1),
                 grid=(nsplit + 2, n_kvh, max(groups, 1)))  # extra blocks must exit
    np.testing.assert_array_equal(dev.down(kc_d, (S, nkv), np.uint16), kc_exp)
    np.testing.assert_array_equal(dev.down(vc_d, (S, nkv), np.uint16), vc_exp)
    ref = attention_ref(qkv[:, :nq].astype(np.float64).reshape(T, Hq, hd), bits_f32(kc_exp), bits_f32(vc_exp),
                        key_slots, L, p0 + np.arange(T), theta, G, causal=not bidir)
    for combine, vec in MERGES:
        if hd % (32 * vec):
            continue
        out_b, out_f = dev.poisoned(2 * T * nq), dev.poisoned(4 * T * nq)
        dev.fn(combine)(part_o, part_ml, I32(rows), I32(hd), I32(T), I32(Hq), meta_d, I32(0), I32(0), I32(KPS),
                        out_f, out_b, block=(256, 1, 1), grid=(rows * hd // (32 * vec), 1))
        assert rel_err(dev.down(out_f, (T, nq), np.float32), ref) < 2e-2, combine
        assert rel_err(bits_f32(dev.down(out_b, (T, nq), np.uint16)), ref) < 2e-2, combine


# (128, 6, 2, 8000): 126 splits, more than one round of the one-pass merge's loads (8 groups x 12 = 96).
# groups > 0: attn_decode_hd*_hg (more than DEC_MAXG = 8 heads per KV head): 16 heads (8 + 8), 9 (5 + 4), 12 (6 + 6).
@pytest.mark.parametrize("hd,G,n_kvh,nctx,groups", [
    (128, 6, 2, 4082, 0), (64, 7, 2, 300, 0), (64, 2, 2, 50, 0), (128, 6, 2, 8000, 0), (128, 8, 2, 4082, 0),
    (64, 16, 1, 300, 2), (128, 9, 1, 200, 2), (128, 12, 2, 4082, 2)])
def test_attention_decode(dev, rng, hd, G, n_kvh, nctx, groups):
    theta, step = 1e6, 5
    Hq = G * n_kvh
    nkv = n_kvh * hd
    S = nctx + 20
    key_slots = rng.permutation(S).astype(np.int32)
    kc_b, kc = rand_bf16(rng, (S, nkv))
    vc_b, vc = rand_bf16(rng, (S, nkv))
    q = rng.standard_normal(Hq * hd).astype(np.float32)
    meta = np.array([0, 0, 0, nctx], np.int32)
    L = nctx + step
    cs = rope_table(S + 64, hd, theta)
    nsplit = math.ceil(L / KPS)
    part_o, part_ml = dev.poisoned(4 * nsplit * Hq * hd), dev.poisoned(8 * nsplit * Hq)
    meta_d = dev.up(meta)
    dev.fn(f"attn_decode_hd{hd}" + ("_hg" if groups else ""))(
        dev.up(q), dev.up(kc_b), dev.up(vc_b), dev.up(key_slots), meta_d, I32(step), dev.up(cs), I32(G), I32(n_kvh),
        F32(LOG2E / math.sqrt(hd)), part_o, part_ml, block=(128, 1, 1),
        grid=(nsplit + 3, n_kvh, max(groups, 1)))  # extra blocks must exit
    ref = attention_ref(q.astype(np.float64).reshape(1, Hq, hd), kc, vc, key_slots, L, np.array([L - 1]), theta, G)
    for combine, vec in MERGES:
        if hd % (32 * vec):
            continue
        out = dev.poisoned(4 * Hq * hd)
        dev.fn(combine)(part_o, part_ml, I32(Hq), I32(hd), I32(1), I32(Hq), meta_d, I32(3), I32(step), I32(KPS),
                        out, np.intp(0), block=(256, 1, 1), grid=(Hq * hd // (32 * vec), 1))
        # bf16 Q, rotated K and P on the tensor cores
        assert rel_err(dev.down(out, Hq * hd, np.float32), ref[0]) < 2e-2, combine


@pytest.mark.parametrize("T,Hq,hd,nsplit", [(1, 12, 128, 130), (32, 14, 64, 100), (32, 12, 128, 7), (1, 4, 64, 1)])
def test_merges_on_random_partials(dev, rng, T, Hq, hd, nsplit):
    """Each split merge against the exact merge of random partials (log2-domain maxima spread over +-12, a split
    with -inf max and zero sum), more splits than one round of the one-pass loads included; fp32 out only."""
    rows = Hq * T
    po = rng.standard_normal((nsplit, rows, hd)).astype(np.float32)
    m = (rng.standard_normal((nsplit, rows)) * 4).astype(np.float32)
    lsum = rng.uniform(0.5, 3.0, (nsplit, rows)).astype(np.float32)
    if nsplit > 1:
        m[0, 0], lsum[0, 0], po[0, 0] = -np.inf, 0.0, 0.0  # a split that saw no key of row 0
    e = np.exp2(m.astype(np.float64) - m.max(axis=0, keepdims=True))  # (nsplit, rows)
    merged = (e[..., None] * po).sum(0) / (e * lsum).sum(0)[:, None]  # (rows, hd), row = head * T + token
    ref = merged.reshape(Hq, T, hd).transpose(1, 0, 2).reshape(T, Hq * hd)
    meta = dev.up(np.array([nsplit * KPS, 0, T, 0], np.int32))
    po_d, ml_d = dev.up(po), dev.up(np.stack([m, lsum], axis=-1).astype(np.float32))
    for combine, vec in MERGES:
        if hd % (32 * vec):
            continue
        out = dev.poisoned(4 * T * Hq * hd)
        dev.fn(combine)(po_d, ml_d, I32(rows), I32(hd), I32(T), I32(Hq), meta, I32(0), I32(0), I32(KPS), out,
                        np.intp(0), block=(256, 1, 1), grid=(rows * hd // (32 * vec), 1))
        assert rel_err(dev.down(out, (T, Hq * hd), np.float32), ref) < 1e-5, combine
