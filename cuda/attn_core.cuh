// Attention building blocks of rope_attention.cu: K/V chunk staging with RoPE at the key's logical position, the
// query fragments, and the pieces of the tensor-core decode block (conventions: the header of rope_attention.cu).
#pragma once
#include "common.cuh"

#define DEC_WARPS 4
#define DEC_KB 8      // keys per warp whose K/V loads are in flight together
#define DEC_MAXG 8    // query heads per KV head supported by the decode kernel

#define ATT_KC 64  // keys per shared-memory chunk = keys per split of both attention kernels

// Stage keys [kc0, kc0 + ATT_KC) (those >= kend as zeros) of KV head kvh: keys RoPE-rotated at their logical
// position j into sK [key][HD + 8] (bf16), values transposed into sVt [dim][ATT_KC + 8] (bf16).
// Latency: the chunk's slot indices go to shared memory first (one coalesced load), then each thread issues the
// loads of STAGE_B items before using any of them, so a chunk costs ~2 memory round trips, not one per item.
// V items run key-fastest across a warp so the transposed 2-byte stores hit consecutive addresses.
#define STAGE_B 4

// Cache and query loads through the read-only path (const __restrict__). Through L2 only (ld.global.cg) measured
// ~0.5 ms per chunk slower in the decode attention.
template <typename T>
__device__ __forceinline__ T ld_ro(const T* __restrict__ p) {
    return *p;
}

// One staged item: dims (d, d+1) of the low half and (HALF+d, HALF+d+1) of key row `key` (bf16 pairs klo / khi,
// values vlo / vhi, pre-RoPE), cs = (cos, sin) at d and d+1: rotated K into sK, V transposed into sVt.
template <int HD>
__device__ __forceinline__ void put_kv_pair(bf16_t* sK, bf16_t* sVt, int key, int d, uint32_t klo, uint32_t khi,
                                            uint32_t vlo, uint32_t vhi, float4 cs) {
    constexpr int HALF = HD / 2, KSTR = HD + 8, VSTR = ATT_KC + 8;
    const float l0 = bf16_lo(klo), l1 = bf16_hi(klo), h0 = bf16_lo(khi), h1 = bf16_hi(khi);
    *reinterpret_cast<uint32_t*>(sK + key * KSTR + d) =
        pack_bf16x2(l0 * cs.x - h0 * cs.y, l1 * cs.z - h1 * cs.w);
    *reinterpret_cast<uint32_t*>(sK + key * KSTR + HALF + d) =
        pack_bf16x2(h0 * cs.x + l0 * cs.y, h1 * cs.z + l1 * cs.w);
    sVt[d * VSTR + key] = (bf16_t)(vlo & 0xffffu);
    sVt[(d + 1) * VSTR + key] = (bf16_t)(vlo >> 16);
    sVt[(HALF + d) * VSTR + key] = (bf16_t)(vhi & 0xffffu);
    sVt[(HALF + d + 1) * VSTR + key] = (bf16_t)(vhi >> 16);
}

// One K item of a staged chunk: dims d .. d + 3 of each half of key `key` (raw bf16 lo / hi), rotated by the
// (cos, sin) pairs c01 (dims d, d + 1) and c23 (d + 2, d + 3), stored into sK.
template <int HD>
__device__ __forceinline__ void put_k_rot4(bf16_t* sK, int key, int d, uint2 lo, uint2 hi, float4 c01, float4 c23) {
    constexpr int HALF = HD / 2, KSTR = HD + 8;
    const float l[4] = {bf16_lo(lo.x), bf16_hi(lo.x), bf16_lo(lo.y), bf16_hi(lo.y)};
    const float hv[4] = {bf16_lo(hi.x), bf16_hi(hi.x), bf16_lo(hi.y), bf16_hi(hi.y)};
    const float c[4] = {c01.x, c01.z, c23.x, c23.z};
    const float sn[4] = {c01.y, c01.w, c23.y, c23.w};
    float rl[4], rh[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) { rl[i] = l[i] * c[i] - hv[i] * sn[i]; rh[i] = hv[i] * c[i] + l[i] * sn[i]; }
    *reinterpret_cast<uint2*>(sK + key * KSTR + d) = make_uint2(pack_bf16x2(rl[0], rl[1]), pack_bf16x2(rl[2], rl[3]));
    *reinterpret_cast<uint2*>(sK + key * KSTR + HALF + d) = make_uint2(pack_bf16x2(rh[0], rh[1]), pack_bf16x2(rh[2], rh[3]));
}

// One V item of a staged chunk: dims d .. d + 7 of key `key` (bf16), transposed into sVt.
__device__ __forceinline__ void put_vt8(bf16_t* sVt, int key, int d, uint4 v) {
    constexpr int VSTR = ATT_KC + 8;
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        sVt[(d + 2 * i) * VSTR + key] = (bf16_t)(w[i] & 0xffffu);
        sVt[(d + 2 * i + 1) * VSTR + key] = (bf16_t)(w[i] >> 16);
    }
}

// Rows of keys kc0 .. kc0 + nrow - 1 (slot indices in sSlot[0 .. nrow)) into a staged chunk: rotated K in sK,
// transposed V in sVt; rows nrow .. ATT_KC - 1 are zero (masked keys must not meet NaN garbage in P V). The K and V
// loads of a batch of B items each are in flight together (one round trip per batch; ~64 registers: the stagings
// run before the PDL wait, when nothing else is live).
template <int HD, int B>
__device__ __forceinline__ void stage_kv_pass(bf16_t* sK, bf16_t* sVt, const int* sSlot, const bf16_t* __restrict__ kc,
        const bf16_t* __restrict__ vc, const float2* __restrict__ rope_cs, int kvh, int nkv, int kc0, int nrow) {
    constexpr int HALF = HD / 2;
    constexpr int NI = ATT_KC * (HD / 8);  // items of each kind: K (key, 4 dims of each half), V (key, 8 dims)
    for (int base = threadIdx.x; base < NI; base += B * blockDim.x) {
        uint2 lo[B], hi[B];
        float4 c01[B], c23[B];
        uint4 v[B];
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int it = base + b * blockDim.x;
            {
                const int key = it / (HALF / 4), d = (it - key * (HALF / 4)) * 4;
                const int slot = it < NI && key < nrow ? sSlot[key] : -1;
                lo[b] = hi[b] = make_uint2(0u, 0u);
                c01[b] = c23[b] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (slot >= 0) {
                    const bf16_t* kr = kc + (size_t)slot * nkv + kvh * HD;
                    lo[b] = ld_ro(reinterpret_cast<const uint2*>(kr + d));
                    hi[b] = ld_ro(reinterpret_cast<const uint2*>(kr + HALF + d));
                    c01[b] = *reinterpret_cast<const float4*>(rope_cs + (size_t)(kc0 + key) * HALF + d);
                    c23[b] = *reinterpret_cast<const float4*>(rope_cs + (size_t)(kc0 + key) * HALF + d + 2);
                }
            }
            {  // V items run key-fastest across a warp (the transposed 2-byte stores hit consecutive addresses)
                const int key = it % ATT_KC, d = (it / ATT_KC) * 8;
                const int slot = it < NI && key < nrow ? sSlot[key] : -1;
                v[b] = make_uint4(0u, 0u, 0u, 0u);
                if (slot >= 0) v[b] = ld_ro(reinterpret_cast<const uint4*>(vc + (size_t)slot * nkv + kvh * HD + d));
            }
        }
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int it = base + b * blockDim.x;
            if (it >= NI) break;
            const int key = it / (HALF / 4), d = (it - key * (HALF / 4)) * 4;
            put_k_rot4<HD>(sK, key, d, lo[b], hi[b], c01[b], c23[b]);
            put_vt8(sVt, it % ATT_KC, (it / ATT_KC) * 8, v[b]);
        }
    }
}

// Stage keys [kc0, kc0 + ATT_KC) of KV head kvh: slot indices to sSlot (one coalesced load), then the rows of keys
// < kend. kslot > kend (the pre-wait staging): sSlot also gets the slot indices of keys [kend, kslot), whose rows
// are staged later (stage_kv_keys) without a dependent slot lookup; their rows are zero here.
template <int HD>
__device__ __forceinline__ void stage_kv_chunk(bf16_t* sK, bf16_t* sVt, int* sSlot, const bf16_t* __restrict__ kc,
        const bf16_t* __restrict__ vc, const int* __restrict__ key_slots, const float2* __restrict__ rope_cs,
        int kvh, int nkv, int kc0, int kend, int kslot = -1) {
    if (threadIdx.x < ATT_KC)
        sSlot[threadIdx.x] = kc0 + (int)threadIdx.x < max(kend, kslot) ? key_slots[kc0 + threadIdx.x] : -1;
    __syncthreads();
    stage_kv_pass<HD, STAGE_B>(sK, sVt, sSlot, kc, vc, rope_cs, kvh, nkv, kc0, kend - kc0);
}

// Items (key j in [j0, j1), dims d, d+1 of each half) of keys staged after the PDL wait, in one memory round trip:
// every thread issues the K, V and RoPE loads of NB items before using any. src(j, k, v) points k / v at key j's K
// and V values of this KV head, as E = uint32_t (two bf16: the cache) or float2 (two fp32: the QKV output), read
// through L2 (__ldcg: the preceding kernel wrote them); put(j, d, klo, khi, vlo, vhi, cs) consumes one item.
template <int HD, int NB, typename E, typename Src, typename Put>
__device__ __forceinline__ void stage_kv_items(int j0, int j1, const float2* __restrict__ rope_cs, Src src, Put put) {
    constexpr int HALF = HD / 2, P = HALF / 2;
    const int n = (j1 - j0) * P;
    for (int base = threadIdx.x; base < n; base += NB * blockDim.x) {
        E klo[NB], khi[NB], vlo[NB], vhi[NB];
        float4 cs[NB];
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const int it = base + b * blockDim.x;
            if (it < n) {
                const int j = j0 + it / P, d = (it % P) * 2;
                const E* k;
                const E* v;
                src(j, k, v);
                klo[b] = __ldcg(k + d / 2);
                khi[b] = __ldcg(k + (HALF + d) / 2);
                vlo[b] = __ldcg(v + d / 2);
                vhi[b] = __ldcg(v + (HALF + d) / 2);
                cs[b] = *reinterpret_cast<const float4*>(rope_cs + (size_t)j * HALF + d);
            }
        }
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const int it = base + b * blockDim.x;
            if (it < n) put(j0 + it / P, (it % P) * 2, klo[b], khi[b], vlo[b], vhi[b], cs[b]);
        }
    }
}

// Keys [j0, j1) (logical positions, all in the chunk starting at kc0) into rows j - kc0 of a staged chunk: rotated
// K, transposed V, from the cache rows sSlot[j - kc0] (slot indices staged before the PDL wait).
template <int HD, int NB>
__device__ __forceinline__ void stage_kv_keys(bf16_t* sK, bf16_t* sVt, const int* sSlot, const bf16_t* kc,
        const bf16_t* vc, const float2* __restrict__ rope_cs, int kvh, int nkv, int j0, int j1, int kc0) {
    stage_kv_items<HD, NB, unsigned int>(j0, j1, rope_cs,
        [&](int j, const unsigned int*& k, const unsigned int*& v) {
            const size_t row = (size_t)sSlot[j - kc0] * nkv + kvh * HD;
            k = reinterpret_cast<const unsigned int*>(kc + row);
            v = reinterpret_cast<const unsigned int*>(vc + row);
        },
        [&](int j, int d, uint32_t klo, uint32_t khi, uint32_t vlo, uint32_t vhi, float4 cs) {
            put_kv_pair<HD>(sK, sVt, j - kc0, d, klo, khi, vlo, vhi, cs);
        });
}

// Shared memory of one decode-attention block: staged chunk (rotated K, transposed V) or the 4-warp merge.
template <int HD>
struct DecAttnSmem {
    static constexpr int STAGE_BYTES = (ATT_KC * (HD + 8) + HD * (ATT_KC + 8)) * 2;
    static constexpr int MERGE_BYTES = (4 * DEC_MAXG * HD + 2 * 4 * DEC_MAXG) * 4;
    static constexpr int BYTES = STAGE_BYTES > MERGE_BYTES ? STAGE_BYTES : MERGE_BYTES;
};

// Query fragments of a tensor-core attention warp (the prefill and decode kernels): lane (g = lane / 4, t = lane % 4)
// holds m16 rows g and g + 8 of the A operand; qv[r] = row g + 8 r, dims ks * 16 + hh * 8 + 2 t (+1).

// raw query loads (pre-RoPE; issued early, rotated later by q_frag_build) of rows row0 (m16 row g) and row1
// (row g + 8), HD floats each in global or shared memory; a row whose flag ok0 / ok1 is false is zero (a constant
// true folds away when inlined)
template <int HD>
__device__ __forceinline__ void q_frag_load(const float* row0, bool ok0, const float* row1, bool ok1,
                                            float (&qv)[2][HD / 16][4]) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float* row = r == 0 ? row0 : row1;
        const bool ok = r == 0 ? ok0 : ok1;
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int d = ks * 16 + hh * 8 + 2 * t;
                float2 a = make_float2(0.f, 0.f);
                if (ok) a = ld_ro(reinterpret_cast<const float2*>(row + d));
                qv[r][ks][2 * hh] = a.x;
                qv[r][ks][2 * hh + 1] = a.y;
            }
    }
}

// RoPE (cs0 / cs1: the (cos, sin) rows of the two rows' positions), scale, pack into bf16 A fragments
template <int HD>
__device__ __forceinline__ void q_frag_build(const float (&qv)[2][HD / 16][4], const float2* cs0, const float2* cs1,
                                             float qscale, uint32_t (&qa)[HD / 16][4]) {
    constexpr int KS = HD / 16;
    const int t = threadIdx.x & 3;
    float qr[2][KS][4];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int ks = 0; ks < KS / 2; ++ks)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int d = ks * 16 + (j >> 1) * 8 + 2 * t + (j & 1);  // < HD / 2
                const float2 cs = (r == 0 ? cs0 : cs1)[d];
                const float lo = qv[r][ks][j], hi = qv[r][ks + KS / 2][j];
                qr[r][ks][j] = (lo * cs.x - hi * cs.y) * qscale;
                qr[r][ks + KS / 2][j] = (hi * cs.x + lo * cs.y) * qscale;
            }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        qa[ks][0] = pack_bf16x2(qr[0][ks][0], qr[0][ks][1]);
        qa[ks][1] = pack_bf16x2(qr[1][ks][0], qr[1][ks][1]);
        qa[ks][2] = pack_bf16x2(qr[0][ks][2], qr[0][ks][3]);
        qa[ks][3] = pack_bf16x2(qr[1][ks][2], qr[1][ks][3]);
    }
}

// The pieces of the decode-attention block (attn_decode_* of rope_attention.cu): m16 row r = query head r of the KV
// head's group (rows >= G are zero: G <= 8).

// the G heads of one KV head, qg = its first head
template <int HD>
__device__ __forceinline__ void dec_load_q(const float* __restrict__ qg, int G, float (&qv)[2][HD / 16][4]) {
    const int g = (threadIdx.x & 31) >> 2;
    q_frag_load<HD>(qg + g * HD, g < G, qg + (g + 8) * HD, g + 8 < G, qv);
}

// S = Q K^T over NT n8 tiles of staged keys (rows row0 .. row0 + 8 NT - 1 of sK, rotated, [key][HD + 8] bf16)
template <int HD, int NT>
__device__ __forceinline__ void qk_tiles(const bf16_t* sK, int row0, const uint32_t (&qa)[HD / 16][4],
                                         float (&s)[NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        const bf16_t* kr = sK + (row0 + n * 8 + g) * (HD + 8) + 2 * t;
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks) {
            const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr + ks * 16);
            const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + ks * 16 + 8);
            mma_bf16_16816(s[n], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b0, b1);
        }
    }
}

// a warp's online-softmax state: unnormalised output (m16 x HD accumulators), row max m and sum l of rows g, g+8
template <int HD>
struct DecState {
    float o[HD / 8][4];
    float m0, m1, l0, l1;
    __device__ __forceinline__ void init() {
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
        m0 = m1 = -INFINITY;
        l0 = l1 = 0.f;
    }
};

// keys of staged rows row0 .. row0 + 15 (logical index j0 + row; j >= kend masked) into the warp's state
template <int HD>
__device__ __forceinline__ void dec_attend16(const bf16_t* sK, const bf16_t* sVt, int row0, int j0, int kend,
                                             const uint32_t (&qa)[HD / 16][4], DecState<HD>& st) {
    constexpr int NT_O = HD / 8, VSTR = ATT_KC + 8;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float s[2][4];
    qk_tiles<HD, 2>(sK, row0, qa, s);
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int j = j0 + row0 + n * 8 + 2 * t + (c & 1);
            if (j >= kend) s[n][c] = -INFINITY;
            if (c < 2) mx0 = fmaxf(mx0, s[n][c]); else mx1 = fmaxf(mx1, s[n][c]);
        }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(st.m0, mx0), mn1 = fmaxf(st.m1, mx1);
    const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
    const float cr0 = exp2f(st.m0 - mu0), cr1 = exp2f(st.m1 - mu1);
    st.m0 = mn0; st.m1 = mn1;
    st.l0 *= cr0; st.l1 *= cr1;
#pragma unroll
    for (int i = 0; i < NT_O; ++i) { st.o[i][0] *= cr0; st.o[i][1] *= cr0; st.o[i][2] *= cr1; st.o[i][3] *= cr1; }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        s[n][0] = exp2f(s[n][0] - mu0); s[n][1] = exp2f(s[n][1] - mu0);
        s[n][2] = exp2f(s[n][2] - mu1); s[n][3] = exp2f(s[n][3] - mu1);
        st.l0 += s[n][0] + s[n][1];
        st.l1 += s[n][2] + s[n][3];
    }
    const uint32_t a0 = pack_bf16x2(s[0][0], s[0][1]), a1 = pack_bf16x2(s[0][2], s[0][3]);
    const uint32_t a2 = pack_bf16x2(s[1][0], s[1][1]), a3 = pack_bf16x2(s[1][2], s[1][3]);
#pragma unroll
    for (int dn = 0; dn < NT_O; ++dn) {
        const bf16_t* vr = sVt + (dn * 8 + g) * VSTR + row0 + 2 * t;
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(vr);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(vr + 8);
        mma_bf16_16816(st.o[dn], a0, a1, a2, a3, b0, b1);
    }
}

// Merge the NW warps' states of the block in shared memory (merge: (NW * DEC_MAXG * HD + 2 * NW * DEC_MAXG) floats,
// free to overwrite: the caller synced after its last read of the staged keys... this function syncs first) and
// hand each (head h < G, dim d) to store(h, d, numerator, max, denominator) (den/max are the same for every d).
template <int HD, int NW, typename Store>
__device__ __forceinline__ void dec_merge(float* merge, int G, DecState<HD>& st, Store store) {
    constexpr int NT_O = HD / 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    st.l0 += __shfl_xor_sync(0xffffffffu, st.l0, 1);
    st.l0 += __shfl_xor_sync(0xffffffffu, st.l0, 2);
    st.l1 += __shfl_xor_sync(0xffffffffu, st.l1, 1);
    st.l1 += __shfl_xor_sync(0xffffffffu, st.l1, 2);
    __syncthreads();  // every warp is past its last read of the staged chunk that `merge` overlays
    float* s_o = merge;                       // [NW][DEC_MAXG][HD]
    float* s_m = s_o + NW * DEC_MAXG * HD;    // [NW][DEC_MAXG]
    float* s_l = s_m + NW * DEC_MAXG;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = g + 8 * r;
        if (h < G) {
#pragma unroll
            for (int dn = 0; dn < NT_O; ++dn) {
                s_o[(warp * DEC_MAXG + h) * HD + dn * 8 + 2 * t] = st.o[dn][2 * r];
                s_o[(warp * DEC_MAXG + h) * HD + dn * 8 + 2 * t + 1] = st.o[dn][2 * r + 1];
            }
            if (t == 0) {
                s_m[warp * DEC_MAXG + h] = r == 0 ? st.m0 : st.m1;
                s_l[warp * DEC_MAXG + h] = r == 0 ? st.l0 : st.l1;
            }
        }
    }
    __syncthreads();
    for (int it = threadIdx.x; it < G * HD; it += blockDim.x) {
        const int h = it / HD, d = it - h * HD;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < NW; ++w) M = fmaxf(M, s_m[w * DEC_MAXG + h]);
        float num = 0.f, den = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float mw = s_m[w * DEC_MAXG + h];
            const float e = mw == -INFINITY ? 0.f : exp2f(mw - M);
            num = fmaf(e, s_o[(w * DEC_MAXG + h) * HD + d], num);
            den = fmaf(e, s_l[w * DEC_MAXG + h], den);
        }
        store(h, d, num, M, den);
    }
}
