// Persistent decode step: every layer of one decode token in ONE launch (issue 4, docs/KERNEL_NOTES.md v5).
//
// Why: the layered decode runs 6 kernels per layer (QKV, attention, combine, o_proj, gate/up, down), 168 per
// token; each boundary costs a launch gap plus a ramp and a tail, ~4-5 us per small kernel against 1-13 us of
// useful weight streaming. Here a grid of exactly as many 128-thread blocks as fit on the GPU at once loops over
// the layers and separates the six phases with grid-wide barriers. Weights stream through a cp.async
// ring per warp in shared memory (3 x 6 KB in flight per warp, no registers held); each phase's first items are
// requested before the barrier that opens it (weights never depend on activations), o_proj's already before
// the attention phase, so barrier and attention latencies overlap the weight fetch.
// Measured (docs/KERNEL_NOTES.md v5): correct, but no faster than the layered kernels: each phase still pays
// ~5 us of barrier + input round trip + reduction, so it is an opt-in (tuning decode_kernel: persistent).
//
// Phases of layer l (the barrier count is the same in every block; every block passes every barrier):
//   QKV     rmsnorm(x) . Wqkv + b -> q (fp32, pre-RoPE), this token's K/V -> cache slot (bf16, pre-RoPE)
//   attn    split-K tensor-core attention over the retained keys (attn_core.cuh), partials per (split, head)
//   combine merge the partials -> attn (fp32, [Hq * HD])
//   o_proj  x += Wo . attn (atomics)
//   gate/up act = silu(g) * u of rmsnorm(x)
//   down    x += Wd . act (column segments of 1536, atomics)
// Data written in one phase and read in a later one (x, q, K/V, partials, attn, act) is read with ld.global.cg
// (L2), never through the non-coherent read-only path or a possibly stale L1 line.
//
// Grid residency: the host sizes the grid from cuOccupancyMaxActiveBlocksPerMultiprocessor, so every block is
// resident and the spin barrier cannot deadlock; a spin longer than ~1 s (a grid that is not resident after all)
// sets *err and lets the block go on, so a misconfiguration yields a flagged chunk, never a hung GPU.
#include "common.cuh"
#include "attn_core.cuh"

#define PD_THREADS 128
#define PD_WARPS 4
#define PD_PTRS 9  // row of the per-layer pointer table: ln1, wqkv, bqkv, wo, ln2, wgu, wd, kc, vc
#define PD_SEG 1536  // columns per GEMV item: 2 rows x 1536 bf16 = 6 KB
#define PD_NBUF 3     // GEMV items in flight per warp (cp.async ring in shared memory)
#define PD_WSM_BYTES (PD_WARPS * PD_NBUF * 2 * PD_SEG * 2)

// Grid-wide barrier state of one block. prof (optional, block 0 only): clock64 at the kernel start and at every
// barrier exit, for the per-phase profile of the benchmark.
struct GridBar {
    unsigned* count;  // zeroed by the host before the launch
    int* err;
    unsigned target;
    unsigned long long* prof;
    int nprof;
};

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void pd_stamp(GridBar& b) {
    if (b.prof != nullptr && blockIdx.x == 0 && threadIdx.x == 0) b.prof[b.nprof] = clock64();
    ++b.nprof;
}

__device__ __forceinline__ void grid_sync(GridBar& b) {
    __syncthreads();
    b.target += gridDim.x;
    if (threadIdx.x == 0) {
        // release: this block's writes (cumulative over the __syncthreads) are visible before its arrival
        asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(b.count), "r"(1u) : "memory");
        const long long t0 = clock64();
        while (ld_acquire_gpu(b.count) < b.target) {
            if (*reinterpret_cast<volatile int*>(b.err) != 0) break;
            if (clock64() - t0 > 2000000000LL) { atomicExch(b.err, 1); break; }
        }
    }
    __syncthreads();
    pd_stamp(b);
}

// sx[0..K) = v[0..K) for K <= PD_SEG (L2 loads, all in flight at once), optionally replaced by
// rmsnorm(v) * snorm (the norm weights already in shared memory). K % 4 == 0, v 16-byte aligned.
__device__ __forceinline__ void pd_load_vec(float* sx, const float* v, int K, const bf16_t* snorm, float eps) {
    __shared__ float red[33];
    constexpr int NV = PD_SEG / (4 * PD_THREADS);
    float4 a[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int i = (threadIdx.x + j * PD_THREADS) * 4;
        a[j] = i < K ? __ldcg(reinterpret_cast<const float4*>(v + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int i = (threadIdx.x + j * PD_THREADS) * 4;
        if (i < K) *reinterpret_cast<float4*>(sx + i) = a[j];
        ss = fmaf(a[j].x, a[j].x, fmaf(a[j].y, a[j].y, fmaf(a[j].z, a[j].z, fmaf(a[j].w, a[j].w, ss))));
    }
    if (snorm != nullptr) {
        const float r = rsqrtf(block_sum(ss, red) / (float)K + eps);  // block_sum's barriers publish sx, snorm
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int i = (threadIdx.x + j * PD_THREADS) * 4;
            if (i < K) {
                const uint2 w = *reinterpret_cast<const uint2*>(snorm + i);
                *reinterpret_cast<float4*>(sx + i) = make_float4(bf16_lo(w.x) * (a[j].x * r), bf16_hi(w.x) * (a[j].y * r),
                                                                 bf16_lo(w.y) * (a[j].z * r), bf16_hi(w.y) * (a[j].w * r));
            }
        }
    }
    __syncthreads();
}

// One GEMV phase: warp items of two weight rows x one column segment (<= PD_SEG = 1536 columns, 6 KB), landed
// in the warp's own shared-memory ring by cp.async (no registers held while in flight): PD_NBUF items per warp in
// flight, the first PD_NBUF requested BEFORE the barrier that opens the phase (weights never depend on it).
// Lane l copies and later reads only its own 16-byte chunks (columns 8l + 256u), so no warp sync is needed.
// The input vector (RMSNorm'ed when normw) is loaded into shared memory once per phase, after the barrier.
// Modes: QKV (rows = q | k | v, bias, K/V to the cache slot), GATEUP (item = output o: gate row and up row,
// SiLU(gate) * up), RESID (x[row] += partial dot, atomics: o_proj and down, split into column segments).
enum { PD_QKV = 0, PD_GATEUP = 1, PD_RESID = 2 };

struct PdGemv {
    const bf16_t* W;
    int N, K, nseg;       // rows (outputs for GATEUP), columns, column segments per row pair
    const float* v;       // input vector (K floats)
    const bf16_t* normw;  // RMSNorm weight (nullptr: none)
    float eps;
    float* out;           // QKV: q; GATEUP: act; RESID: x
    const float* bias;    // QKV
    bf16_t* kc;           // QKV: this token's K/V go to row new_slot
    bf16_t* vc;
    int nq, nkv, new_slot;
};

// Items of this warp: it = first, first + stride, ... < nitems. QKV: row pairs; GATEUP: outputs; RESID: row pairs
// of ONE column segment per block (seg = blockIdx % nseg), so a block loads only its segment of the input.
struct PdItems {
    int first, stride, nitems, seg;
};

template <int MODE>
__device__ __forceinline__ PdItems pd_items(const PdGemv& g) {
    const int warp = threadIdx.x >> 5;
    PdItems r;
    if (MODE == PD_RESID) {
        const int bps = gridDim.x / g.nseg;  // blocks per segment (host: grid >= nseg)
        const int b = blockIdx.x / g.nseg;
        r.seg = blockIdx.x - b * g.nseg;
        r.nitems = (g.N + 1) >> 1;
        r.first = b < bps ? b * PD_WARPS + warp : r.nitems;  // the last gridDim % nseg blocks sit this phase out
        r.stride = bps * PD_WARPS;
    } else {
        r.seg = 0;
        r.first = blockIdx.x * PD_WARPS + warp;
        r.stride = gridDim.x * PD_WARPS;
        r.nitems = MODE == PD_GATEUP ? g.N : (g.N + 1) >> 1;
    }
    return r;
}

// Request item `it` (if it exists) into ring slot `slot` (2 rows x PD_SEG bf16), then commit a group (always,
// so that every lane keeps the same count of groups in flight).
template <int MODE>
__device__ __forceinline__ void pd_issue(const PdGemv& g, int it, int nitems, int seg, bf16_t* slot) {
    if (it < nitems) {
        const bf16_t* r0;
        const bf16_t* r1;
        int klen;
        if (MODE == PD_GATEUP) {
            const int gr = gateup_gate_row(it);
            r0 = g.W + (size_t)gr * g.K;
            r1 = r0 + 8 * (size_t)g.K;
            klen = g.K;
        } else {
            const int n0 = 2 * it, c0 = seg * PD_SEG;
            r0 = g.W + (size_t)min(n0, g.N - 1) * g.K + c0;
            r1 = g.W + (size_t)min(n0 + 1, g.N - 1) * g.K + c0;
            klen = min(PD_SEG, g.K - c0);
        }
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int u = 0; u < PD_SEG / 256; ++u) {
            const int c = lane * 8 + 256 * u;
            if (c < klen) {
                cp_async16(slot + c, r0 + c);
                cp_async16(slot + PD_SEG + c, r1 + c);
            }
        }
    }
    cp_async_commit();
}

// sx holds the item's column segment (RESID: the block's segment; else the whole vector, K <= PD_SEG).
template <int MODE>
__device__ __forceinline__ void pd_consume(const PdGemv& g, int it, int seg, const float* sx, const bf16_t* slot) {
    const int lane = threadIdx.x & 31;
    const int klen = min(PD_SEG, g.K - seg * PD_SEG);
    const int n = 2 * it + lane;
    const float bias = MODE == PD_QKV && lane < 2 && n < g.N ? g.bias[n] : 0.f;  // in flight during the dot
    float acc0, acc1;
    dot2_rows_smem<PD_SEG>(slot, slot + PD_SEG, sx, klen, acc0, acc1);
    if (MODE == PD_GATEUP) {
        if (lane == 0) g.out[it] = silu(acc0) * acc1;
    } else if (MODE == PD_QKV) {
        if (lane < 2 && n < g.N) {
            const float y = (lane == 0 ? acc0 : acc1) + bias;
            if (n < g.nq) g.out[n] = y;
            else if (n < g.nq + g.nkv) g.kc[(size_t)g.new_slot * g.nkv + (n - g.nq)] = f32_to_bf16(y);
            else g.vc[(size_t)g.new_slot * g.nkv + (n - g.nq - g.nkv)] = f32_to_bf16(y);
        }
    } else {
        if (lane < 2 && n < g.N) atomicAdd(g.out + n, lane == 0 ? acc0 : acc1);
    }
}

// The first PD_NBUF items of this warp for phase g and the phase's RMSNorm weights (call before the barrier
// that opens the phase). The norm weights ride in the first group, which pd_gemv_run waits for first.
template <int MODE>
__device__ __forceinline__ void pd_gemv_prefetch(const PdGemv& g, bf16_t* ring, bf16_t* snorm) {
    const PdItems q = pd_items<MODE>(g);
    if (g.normw != nullptr)
        for (int c = threadIdx.x * 8; c < g.K; c += PD_THREADS * 8) cp_async16(snorm + c, g.normw + c);
#pragma unroll
    for (int b = 0; b < PD_NBUF; ++b) pd_issue<MODE>(g, q.first + b * q.stride, q.nitems, q.seg, ring + b * 2 * PD_SEG);
}

// The rest of the phase (after the barrier): input vector, then consume item k from slot k % PD_NBUF and refill
// that slot with item k + PD_NBUF.
template <int MODE>
__device__ __forceinline__ void pd_gemv_run(const PdGemv& g, float* sx, bf16_t* ring, const bf16_t* snorm) {
    const PdItems q = pd_items<MODE>(g);
    cp_async_wait<PD_NBUF - 1>();  // the first group: this thread's norm-weight chunks (and first item)
    const int c0 = q.seg * PD_SEG;
    pd_load_vec(sx, g.v + c0, min(PD_SEG, g.K - c0), g.normw != nullptr ? snorm : nullptr, g.eps);
    int b = 0;
#pragma unroll 1
    for (int it = q.first; it < q.nitems; it += q.stride) {
        cp_async_wait<PD_NBUF - 1>();
        bf16_t* slot = ring + b * 2 * PD_SEG;
        pd_consume<MODE>(g, it, q.seg, sx, slot);
        pd_issue<MODE>(g, it + PD_NBUF * q.stride, q.nitems, q.seg, slot);
        b = b + 1 == PD_NBUF ? 0 : b + 1;
    }
    cp_async_wait<0>();  // drain the empty trailing groups: the ring is free for the next phase
}

// Merge the attention partials of one (head, 32 dims) virtual block: each warp takes every 4th split, 8 splits'
// loads in flight at a time, online (max, sum) merge; then the 4 warps merge in shared memory.
__device__ __forceinline__ void pd_combine(int vb, const float* part_o, const float2* part_ml, int Hq, int HD,
                                           int nsplit, float* out) {
    __shared__ float s_m[PD_WARPS], s_num[PD_WARPS][32], s_den[PD_WARPS];
    const int per_row = HD >> 5;
    const int r = vb / per_row;
    const int lane = threadIdx.x & 31, sg = threadIdx.x >> 5;
    const int d = (vb - r * per_row) * 32 + lane;
    float M = -INFINITY, num = 0.f, den = 0.f;
    for (int s0 = sg; s0 < nsplit; s0 += 8 * PD_WARPS) {
        float2 ml[8];
        float o[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int s = s0 + j * PD_WARPS;
            ml[j] = s < nsplit ? __ldcg(part_ml + (size_t)s * Hq + r) : make_float2(-INFINITY, 0.f);
            o[j] = s < nsplit ? __ldcg(part_o + ((size_t)s * Hq + r) * HD + d) : 0.f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (ml[j].x == -INFINITY) continue;
            const float nm = fmaxf(M, ml[j].x);
            const float a = M == -INFINITY ? 0.f : exp2f(M - nm), e = exp2f(ml[j].x - nm);
            num = fmaf(num, a, e * o[j]);
            den = fmaf(den, a, e * ml[j].y);
            M = nm;
        }
    }
    __syncthreads();  // s_* of the previous virtual block are consumed
    s_num[sg][lane] = num;
    if (lane == 0) { s_m[sg] = M; s_den[sg] = den; }
    __syncthreads();
    if (sg == 0)
        out[(size_t)r * HD + d] = merge_split_groups<PD_WARPS>(s_m, s_den, [&](int i) { return s_num[i][lane]; });
}

template <int HD>
__device__ __forceinline__ void decode_layers_body(const unsigned long long* __restrict__ lp, int nl, float* x,
        float* qv, float* part_o, float2* part_ml, float* attn, float* act, const int* __restrict__ key_slots,
        const int* __restrict__ meta, int step, const float2* __restrict__ rope_cs, int H, int I, int Hq,
        int n_kvh, float eps, float qscale, int kps, unsigned* bar_count, int* err, unsigned long long* prof) {
    // dynamic shared memory: the warps' weight rings (PD_WSM_BYTES), then the GEMV input vector or the attention
    // staging buffer (they are never live at once)
    extern __shared__ __align__(16) unsigned char dsm[];
    __shared__ int sSlot[ATT_KC];
    __shared__ __align__(16) bf16_t snorm[PD_SEG];  // the phase's RMSNorm weights (H <= PD_SEG)
    __shared__ float2 q_cs[HD / 2];  // RoPE (cos, sin) at this token's position: the same in every layer
    bf16_t* ring = reinterpret_cast<bf16_t*>(dsm) + (threadIdx.x >> 5) * PD_NBUF * 2 * PD_SEG;
    unsigned char* vec = dsm + PD_WSM_BYTES;
    float* sx = reinterpret_cast<float*>(vec);
    GridBar bar{bar_count, err, 0u, prof, 0};
    pd_stamp(bar);
    const int L = meta[3] + step;  // keys seen by this token, itself included
    const int nsplit = (L + kps - 1) / kps;
    const int new_slot = key_slots[L - 1];
    for (int d = threadIdx.x; d < HD / 2; d += PD_THREADS) q_cs[d] = rope_cs[(size_t)(L - 1) * (HD / 2) + d];
    // (published by the barriers inside the QKV phase before the attention phase reads it)
#pragma unroll 1
    for (int l = 0; l < nl; ++l) {
        const unsigned long long* P = lp + (size_t)l * PD_PTRS;
        PdGemv g{};
        // ---- QKV ----
        g.W = reinterpret_cast<const bf16_t*>(P[1]); g.N = Hq * HD + 2 * n_kvh * HD; g.K = H; g.nseg = 1;
        g.v = x; g.normw = reinterpret_cast<const bf16_t*>(P[0]); g.eps = eps; g.out = qv;
        g.bias = reinterpret_cast<const float*>(P[2]); g.kc = reinterpret_cast<bf16_t*>(P[7]);
        g.vc = reinterpret_cast<bf16_t*>(P[8]); g.nq = Hq * HD; g.nkv = n_kvh * HD; g.new_slot = new_slot;
        pd_gemv_prefetch<PD_QKV>(g, ring, snorm);
        if (l == 0) pdl_wait();  // the token's x comes from the embedding kernel
        else grid_sync(bar);
        pd_gemv_run<PD_QKV>(g, sx, ring, snorm);
        // ---- o_proj items fly during attention and combine (the ring is not used by them) ----
        PdGemv go{};
        go.W = reinterpret_cast<const bf16_t*>(P[3]); go.N = H; go.K = Hq * HD;
        go.nseg = (Hq * HD + PD_SEG - 1) / PD_SEG; go.v = attn; go.out = x;
        pd_gemv_prefetch<PD_RESID>(go, ring, snorm);
        // ---- attention partials: virtual block = (key split, KV head). When every block has at most one
        // single-chunk virtual block, its keys (all but this token's, written in the QKV phase) are staged BEFORE the
        // barrier: the cache rows are old, only the newest key is added after it ----
        const bool prestage = kps == ATT_KC && nsplit * n_kvh <= (int)gridDim.x;
        if (prestage && (int)blockIdx.x < nsplit * n_kvh) {
            const int bx = blockIdx.x % nsplit, kvh = blockIdx.x / nsplit;
            __syncthreads();  // sx of the QKV phase is consumed
            stage_kv_chunk<HD, true>(reinterpret_cast<bf16_t*>(vec), reinterpret_cast<bf16_t*>(vec) + ATT_KC * (HD + 8),
                               sSlot, reinterpret_cast<const bf16_t*>(P[7]), reinterpret_cast<const bf16_t*>(P[8]),
                               key_slots, rope_cs, kvh, n_kvh * HD, bx * kps, min(L - 1, bx * kps + kps),
                               min(L, bx * kps + kps));
        }
        grid_sync(bar);
#pragma unroll 1
        for (int vb = blockIdx.x; vb < nsplit * n_kvh; vb += gridDim.x) {
            if (!prestage) __syncthreads();  // the staging buffer of the previous virtual block is consumed
            attn_decode_mma_body<HD, false, true>(qv, reinterpret_cast<const bf16_t*>(P[7]),
                                            reinterpret_cast<const bf16_t*>(P[8]), key_slots, meta, step, rope_cs,
                                            Hq / n_kvh, n_kvh, kps, qscale, part_o, part_ml, vec, sSlot, vb % nsplit,
                                            vb / nsplit, q_cs, prestage ? L - 1 : -1);
        }
        // ---- combine: virtual block = (query head, 32 dims) ----
        grid_sync(bar);
#pragma unroll 1
        for (int vb = blockIdx.x; vb < Hq * (HD >> 5); vb += gridDim.x) pd_combine(vb, part_o, part_ml, Hq, HD, nsplit, attn);
        // ---- o_proj + residual ----
        grid_sync(bar);
        pd_gemv_run<PD_RESID>(go, sx, ring, snorm);
        // ---- gate/up + SiLU * up ----
        g = PdGemv{};
        g.W = reinterpret_cast<const bf16_t*>(P[5]); g.N = I; g.K = H; g.nseg = 1;
        g.v = x; g.normw = reinterpret_cast<const bf16_t*>(P[4]); g.eps = eps; g.out = act;
        pd_gemv_prefetch<PD_GATEUP>(g, ring, snorm);
        grid_sync(bar);
        pd_gemv_run<PD_GATEUP>(g, sx, ring, snorm);
        // ---- down + residual ----
        g = PdGemv{};
        g.W = reinterpret_cast<const bf16_t*>(P[6]); g.N = H; g.K = I; g.nseg = (I + PD_SEG - 1) / PD_SEG;
        g.v = act; g.out = x;
        pd_gemv_prefetch<PD_RESID>(g, ring, snorm);
        grid_sync(bar);
        pd_gemv_run<PD_RESID>(g, sx, ring, snorm);
    }
    __syncthreads();
    pd_stamp(bar);
}

#define PD_PARAMS const unsigned long long* __restrict__ lp, int nl, float* x, float* qv, float* part_o, \
    float2* part_ml, float* attn, float* act, const int* __restrict__ key_slots, const int* __restrict__ meta, \
    int step, const float2* __restrict__ rope_cs, int H, int I, int Hq, int n_kvh, float eps, float qscale, \
    int kps, unsigned* bar_count, int* err, unsigned long long* prof
#define PD_ARGS lp, nl, x, qv, part_o, part_ml, attn, act, key_slots, meta, step, rope_cs, H, I, Hq, n_kvh, eps, \
    qscale, kps, bar_count, err, prof

extern "C" __global__ void __launch_bounds__(PD_THREADS, 2) decode_layers_hd128(PD_PARAMS) {
    decode_layers_body<128>(PD_ARGS);
}
extern "C" __global__ void __launch_bounds__(PD_THREADS, 2) decode_layers_hd64(PD_PARAMS) {
    decode_layers_body<64>(PD_ARGS);
}
