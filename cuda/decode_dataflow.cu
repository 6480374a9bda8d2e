// Dataflow decode step (issue 4, docs/KERNEL_NOTES.md "Session 8"): every layer of one decode token in ONE
// launch of exactly one block per SM, the layers' weights streamed through ONE ring per block that runs ahead
// across phase and layer boundaries, the phases ordered by counters instead of kernel boundaries or grid barriers.
//
// Why (session 7's hop measurements): a kernel boundary that needs its predecessor's whole vector costs ~2.2 us
// with no work at all, six per decode layer >= 13 us per layer next to ~22 us of weight streaming, and in the
// layered form the weight stream stops at each of them. v5 (decode_persistent.cu) kept per-phase rings and grid
// barriers and lost. Here:
//   * the weight stream of a block is one fixed sequence of tiles (QKV rows, W_o rows of one head, gate/up rows,
//     down row segments, layer after layer) fetched with TMA bulk copies (cp.async.bulk, completion on a "full"
//     mbarrier per ring slot) into DF_NSLOT slots of DF_SLOT bytes by a producer warp, which refills a slot with
//     the next tile of the sequence as soon as the 4 consumer warps have arrived on its "empty" mbarrier, whatever
//     phase that tile belongs to. No block barrier per tile: each consumer warp runs at its own pace. While a
//     block waits for a dependency, its ring keeps DF_NSLOT x DF_SLOT bytes (96 KB) of later weights on their
//     way, ~3 us of the SM's share of the HBM bandwidth (4, 5 or 6 slots: the same chunk time, session 9);
//   * a phase waits only for the counter it needs (red.release / ld.acquire at gpu scope): qkv_done -> attention,
//     attn_done -> merge + o_proj, o_done -> gate/up, gu_done -> down, down_done -> next layer's QKV. Each block
//     adds 1 to each counter once per layer (also when it had no work in that phase), so layer l's target is
//     (l + 1) x gridDim.x. The host zeroes the counters before each decode step.
//
// Phases of layer l in block b (NB = gridDim.x blocks, one per SM, all resident; 4 consumer warps + 1 producer):
//   QKV    tiles of 8 rows (2 per warp): rmsnorm(x) . Wqkv + b -> q (fp32, pre-RoPE), this token's K/V -> cache
//   attn   split (b % nsplit) of KV head (b / nsplit): attn_core.cuh's tensor-core body on keys older than this
//          token copied raw by cp.async after the previous layer's attention (layer 0: at the start) and rotated /
//          transposed in shared memory before this layer's QKV, only this token's keys after qkv_done; partials per
//          (split, head)
//   o      head h = b / R, rows [r0, r1) (R = NB / Hq row ranges per head): merge head h's split partials, then
//          x[r] += Wo[r, h*HD : (h+1)*HD] . attn_h (atomics; W_o re-laid head-major by df_wo_head_major)
//   gate/up tiles of 4 outputs (4 gate rows + 4 up rows): act = silu(g) * u of rmsnorm(x)
//   down   tiles of 8 rows x one 1536-column segment: x[r] += Wd[r, seg] . act[seg] (atomics)
// Data written by other blocks in this launch (x, q, K/V, partials, act) is read with ld.global.cg (L2).
// A counter wait longer than ~1 s (a grid that is not resident) sets *err and goes on: a flagged chunk, no hang
// (the first check that fires names the cause; see mbar_wait).
#include "common.cuh"
// The attention body (attn_core.cuh) is written for DEC_WARPS = 4 warps: the 4 consumer warps run it, synchronised
// by named barrier 1 (the producer warp never joins a barrier after the start).
#define ATT_SYNC() asm volatile("bar.sync 1, 128;" ::: "memory")
#define ATT_NT 128
#include "attn_core.cuh"

#define DF_THREADS 128  // 4 consumer warps (the attention's 4): a GEMV tile of 8 rows is two rows per warp
#define DF_WARPS 4
#define DF_BLOCK (DF_THREADS + 32)  // + one producer warp that issues the tile copies (a 5th consumer warp set
                                    // would cap the attention body at 168 registers and spill)
static_assert(DF_THREADS == 32 * DEC_WARPS, "the consumer warps are the attention body's warps");
#define DF_PTRS 9        // per-layer pointer row: ln1, wqkv, bqkv, wo (head-major), ln2, wgu, wd, kc, vc
#define DF_MAXL 48       // layers: the pointer table is copied to shared memory (the tile issue must not wait
                         // for an L2 round trip: measured ~1.2 us per tile with the table in global memory)
#define DF_SLOT 24576    // bytes per ring slot: 8 rows x 1536 bf16
#ifndef DF_NSLOT         // (benchmark experiments may set it: VLA_CUDA_DEFINES)
#define DF_NSLOT 4  // (session 9 run 7: 4, 5 and 6 slots equally fast; the 2 slots' 48 KB hold the RoPE rows)
#endif
#define DF_RING_BYTES (DF_NSLOT * DF_SLOT)
#define DF_ROPE_BYTES (ATT_KC * 64 * 8)  // (cos, sin) fp32 rows of a block's ATT_KC keys, head_dim <= 128
#define DF_KMAX 1536     // hidden size and down column segment limit (8 rows x DF_KMAX bf16 = one slot)
#define DF_NCNT 8        // counters per decode step (5 used)
#define DF_MSPLIT 16     // split partials per thread in flight in the head merge

// What the host sizes the launch and its buffers by (CudaEngine._df_config reads it, so no constant is repeated on
// the host): dynamic shared memory before the vector area (the ring, the RoPE rows), threads per block, the hidden
// size limit, the layer limit, counters per decode step, pointers per layer-table row.
__constant__ int df_config[6] = {DF_RING_BYTES + DF_ROPE_BYTES, DF_BLOCK, DF_KMAX, DF_MAXL, DF_NCNT, DF_PTRS};

// ---- mbarrier + TMA bulk copy (sm_90) ----
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, unsigned parity) {
    unsigned ok;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n}" : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    return ok != 0;
}
// Wait for the phase of `parity`; false: gave up. A wait longer than `limit` clocks sets *err to `code` unless an
// earlier check set it first (the first cause is the one reported); a wait that finds *err set gives up too. *err
// is looked at only every ~0.5 ms of waiting: a global load in every poll delays each tile by its round trip (run 5
// of session 9: +0.4 ms per chunk).
__device__ __forceinline__ bool mbar_wait(uint64_t* bar, unsigned parity, int* err, long long limit, int code) {
    if (mbar_try_wait(bar, parity)) return true;
    const long long t0 = clock64();
    long long check = 1LL << 20;
    while (!mbar_try_wait(bar, parity)) {
        const long long dt = clock64() - t0;
        if (dt > check) {
            if (*reinterpret_cast<volatile int*>(err) != 0) return false;
            if (dt > limit) { atomicCAS(err, 0, code); return false; }
            check += 1LL << 20;
        }
    }
    return true;
}
// ~1 s at H200 clocks: a consumer's wait for a tile (code 2: a tile never landed) or for a phase counter (code 1).
// The producer's wait for a free slot gets twice that: a slot stays full because its consumers wait for a counter,
// whose own timeout must be the one reported.
#define DF_TIMEOUT 2000000000LL
__device__ __forceinline__ void mbar_arrive(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// The consumer warps' barrier (named barrier 2): the producer warp never joins a block-wide barrier after the start.
__device__ __forceinline__ void csync() { asm volatile("bar.sync 2, %0;" ::"n"(DF_THREADS) : "memory"); }
// global -> shared bulk copy of `bytes` (multiple of 16, both addresses 16-byte aligned), completing on bar
__device__ __forceinline__ void tma_load(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ unsigned df_ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// This block's share of every phase: fixed for the launch, the same in every layer.
struct DfPlan {
    int b, NB;
    int H, I, Hq, HD, n_kvh, nqkv;
    int nQ, nO, nG, nD, per_layer;  // tiles per layer of each phase
    int o_head, o_r0, o_r1, o_rows_per_tile;
    int nseg;                       // down column segments
};

__device__ __forceinline__ int df_share(int ntiles, int b, int NB) { return b < ntiles ? (ntiles - b + NB - 1) / NB : 0; }

__device__ __forceinline__ DfPlan df_plan(int H, int I, int Hq, int HD, int n_kvh) {
    DfPlan p;
    p.b = blockIdx.x; p.NB = gridDim.x;
    p.H = H; p.I = I; p.Hq = Hq; p.HD = HD; p.n_kvh = n_kvh;
    p.nqkv = (Hq + 2 * n_kvh) * HD;
    p.nQ = df_share(p.nqkv / 8, p.b, p.NB);
    const int R = p.NB / Hq;  // row ranges per head (host: NB >= Hq)
    p.nO = 0; p.o_head = 0; p.o_r0 = 0; p.o_r1 = 0; p.o_rows_per_tile = 1;
    if (p.b < R * Hq) {
        const int rpr = (H + R - 1) / R;
        p.o_head = p.b / R;
        p.o_r0 = min(H, (p.b % R) * rpr);
        p.o_r1 = min(H, p.o_r0 + rpr);
        const int n = p.o_r1 - p.o_r0, cap = DF_SLOT / (2 * HD);
        p.nO = n > 0 ? (n + cap - 1) / cap : 0;
        p.o_rows_per_tile = p.nO > 0 ? (n + p.nO - 1) / p.nO : 1;
    }
    p.nG = df_share(I / 4, p.b, p.NB);
    p.nseg = (I + DF_KMAX - 1) / DF_KMAX;
    p.nD = df_share((H / 8) * p.nseg, p.b, p.NB);
    p.per_layer = p.nQ + p.nO + p.nG + p.nD;
    return p;
}

// Issue tile k of this block's weight sequence into slot k % DF_NSLOT (one thread).
__device__ __forceinline__ void df_issue(const DfPlan& p, const unsigned long long* lp, int k,
                                         unsigned char* ring, uint64_t* full) {
#ifdef DF_NO_WEIGHTS  // benchmark bound (VLA_CUDA_DEFINES): every tile "lands" at once and no weight byte moves, so
    // the step takes what the dependency chain and the compute take alone (the results are garbage)
    mbar_arrive(full + k % DF_NSLOT, 1u);
    return;
#endif
    const int layer = k / p.per_layer;
    int r = k - layer * p.per_layer;
    const unsigned long long* P = lp + (size_t)layer * DF_PTRS;
    const int s = k % DF_NSLOT;
    unsigned char* dst = ring + (size_t)s * DF_SLOT;
    uint64_t* bar = full + s;
    if (r < p.nQ) {
        const int t = p.b + r * p.NB;
        const unsigned bytes = 8u * p.H * 2u;
        mbar_expect_tx(bar, bytes);
        tma_load(dst, reinterpret_cast<const bf16_t*>(P[1]) + (size_t)t * 8 * p.H, bytes, bar);
        return;
    }
    r -= p.nQ;
    if (r < p.nO) {
        const int r0 = p.o_r0 + r * p.o_rows_per_tile, n = min(p.o_rows_per_tile, p.o_r1 - r0);
        const unsigned bytes = (unsigned)n * p.HD * 2u;
        mbar_expect_tx(bar, bytes);
        tma_load(dst, reinterpret_cast<const bf16_t*>(P[3]) + ((size_t)p.o_head * p.H + r0) * p.HD, bytes, bar);
        return;
    }
    r -= p.nO;
    if (r < p.nG) {
        const int o0 = 4 * (p.b + r * p.NB);  // outputs o0 .. o0 + 3: gate rows g .. g + 3, up rows g + 8 .. g + 11
        const bf16_t* W = reinterpret_cast<const bf16_t*>(P[5]) + (size_t)gateup_gate_row(o0) * p.H;
        const unsigned half = 4u * p.H * 2u;
        mbar_expect_tx(bar, 2 * half);
        tma_load(dst, W, half, bar);
        tma_load(dst + half, W + (size_t)8 * p.H, half, bar);
        return;
    }
    r -= p.nG;
    {
        const int t = p.b + r * p.NB, rg = t / p.nseg, seg = t - rg * p.nseg;
        const int c0 = seg * DF_KMAX, klen = min(DF_KMAX, p.I - c0);
        const bf16_t* W = reinterpret_cast<const bf16_t*>(P[6]) + (size_t)rg * 8 * p.I + c0;
        const unsigned rb = (unsigned)klen * 2u;
        mbar_expect_tx(bar, 8 * rb);
#pragma unroll
        for (int j = 0; j < 8; ++j) tma_load(dst + j * rb, W + (size_t)j * p.I, rb, bar);
    }
}

#ifdef DF_TRACE
// Benchmark builds (VLA_CUDA_DEFINES="DF_TRACE"): %globaltimer when each tile of the LAST layer was issued and when
// its wait ended and when thread 0's dot product of it was done, in the first and the last block:
// [block 0 / last][issued, ready, dot done][tile of the layer].
__device__ unsigned long long df_trace[2][3][64];
__device__ __forceinline__ void df_trace_stamp(int kind, int k, int total, int per_layer) {
    const int i = k - (total - per_layer);
    const int row = blockIdx.x == 0 ? 0 : (blockIdx.x == gridDim.x - 1 ? 1 : -1);
    if (row >= 0 && i >= 0 && i < 64) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        df_trace[row][kind][i] = t;
    }
}
#else
__device__ __forceinline__ void df_trace_stamp(int, int, int, int) {}
#endif

// The ring as seen by a consumer warp: wait for tile k; after its last read, the warp's lanes are done with the
// slot and lane 0 arrives on its "empty" barrier (DF_WARPS arrivals per use), which the producer
// warp waits for before it copies tile k + DF_NSLOT there. No block barrier per tile: each warp runs at its pace.
struct DfRing {
    unsigned char* ring;
    uint64_t* full;
    uint64_t* empty;
    int next;   // next tile of the sequence
    int total;  // tiles in this launch
    int* err;
    int nl;
    __device__ __forceinline__ const unsigned char* acquire() {
        mbar_wait(full + next % DF_NSLOT, (unsigned)(next / DF_NSLOT) & 1u, err, DF_TIMEOUT, 2);
        if (threadIdx.x == 0) df_trace_stamp(1, next, total, total / nl);
        return ring + (size_t)(next % DF_NSLOT) * DF_SLOT;
    }
    __device__ __forceinline__ void release() {
        if (threadIdx.x == 0) df_trace_stamp(2, next, total, total / nl);
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(empty + next % DF_NSLOT, 1u);
        ++next;
    }
};

// The producer warp's loop (lane 0): every tile of the launch in sequence order, each as soon as its slot is free.
// (Session 9: the whole warp in the loop, lanes 1-31 waiting on lane 0 at a shuffle, made the step 0.8 ms slower.)
__device__ __forceinline__ void df_produce(const DfPlan& p, const unsigned long long* sP, unsigned char* ring,
                                           uint64_t* full, uint64_t* empty, int total, int nl, int* err) {
    int k = 0;
    for (; k < total; ++k) {
        const int s = k % DF_NSLOT;
        if (k >= DF_NSLOT) {
            // gave up (flagged launch): no copy into a slot that may still be in use
            if (!mbar_wait(empty + s, (unsigned)(k / DF_NSLOT - 1) & 1u, err, 2 * DF_TIMEOUT, 2)) break;
#ifndef DF_NO_PROXY_FENCE
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads before the async write
#endif
        }
        df_issue(p, sP, k, ring, full);
        df_trace_stamp(0, k, total, total / nl);
    }
    // the block's shared memory must outlive every copy into it: wait for the last tiles issued to land (at once
    // in a normal launch, where the consumers waited for them; bounded when the launch was flagged)
    for (int j = max(0, k - DF_NSLOT); j < k; ++j) {
        const long long t0 = clock64();
        while (!mbar_try_wait(full + j % DF_NSLOT, (unsigned)(j / DF_NSLOT) & 1u) && clock64() - t0 < DF_TIMEOUT) {}
    }
}

__device__ __forceinline__ void df_arrive(unsigned* c) {
    csync();  // this block's writes of the phase are done (cumulative with the release below)
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(c), "r"(1u) : "memory");
}

__device__ __forceinline__ void df_wait(const unsigned* c, unsigned target, int* err) {
#ifdef DF_NO_WAIT  // benchmark bound (VLA_CUDA_DEFINES): no block waits for another, so the step takes what the
    // weight stream and the compute take alone (the results are garbage)
    csync();
    return;
#endif
    if (threadIdx.x == 0) {  // (one global load per poll: *err only every ~0.5 ms, as in mbar_wait)
        const long long t0 = clock64();
        long long check = 1LL << 20;
        while (df_ld_acquire(c) < target) {
            const long long dt = clock64() - t0;
            if (dt > check) {
                if (*reinterpret_cast<volatile int*>(err) != 0) break;
                if (dt > DF_TIMEOUT) { atomicCAS(err, 0, 1); break; }
                check += 1LL << 20;
            }
        }
    }
    csync();
}

__device__ __forceinline__ void df_stamp(unsigned long long* prof, int& n) {
    if (prof != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        prof[n] = t;
    }
    ++n;
}

// sx[0..K) = v[0..K) (L2 loads, all in flight), times rsqrt(mean(v^2) + eps) * normw when normw != nullptr.
// K <= DF_KMAX with a norm; any multiple of 4 without.
__device__ __forceinline__ void df_load_vec(float* sx, const float* v, int K, const bf16_t* __restrict__ normw,
                                            float eps, float* red) {
    constexpr int NV = (DF_KMAX + 4 * DF_THREADS - 1) / (4 * DF_THREADS);
    if (normw == nullptr) {  // the act vector (8960 floats): cp.async through L2, all in flight, no registers held
        for (int i = threadIdx.x * 4; i < K; i += DF_THREADS * 4) cp_async16(sx + i, v + i);
        cp_async_commit();
        cp_async_wait<0>();
        csync();
        return;
    }
    float4 a[NV];
    uint2 w[NV];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int i = (threadIdx.x + j * DF_THREADS) * 4;
        a[j] = i < K ? __ldcg(reinterpret_cast<const float4*>(v + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
        w[j] = i < K ? *reinterpret_cast<const uint2*>(normw + i) : make_uint2(0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < NV; ++j)
        ss = fmaf(a[j].x, a[j].x, fmaf(a[j].y, a[j].y, fmaf(a[j].z, a[j].z, fmaf(a[j].w, a[j].w, ss))));
    const float r = rsqrtf(warps_sum(ss, red, DF_WARPS, csync) / (float)K + eps);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int i = (threadIdx.x + j * DF_THREADS) * 4;
        if (i < K)
            *reinterpret_cast<float4*>(sx + i) = make_float4(bf16_lo(w[j].x) * (a[j].x * r), bf16_hi(w[j].x) * (a[j].y * r),
                                                             bf16_lo(w[j].y) * (a[j].z * r), bf16_hi(w[j].y) * (a[j].w * r));
    }
    csync();
}

// A consumer lane's share of a GEMV input vector, held in registers for a whole phase: columns 8 lane + 256 u of a
// vector of klen <= DF_KMAX columns (zero from klen on). Loaded once per phase, so that a tile's pass reads only its
// weights from shared memory. Session 10 run 2: with the vector re-read from shared memory for every tile (three
// wavefronts of 16-byte loads for each of the weights' one, the x loads 2-way bank conflicted), a consumer warp
// took 0.81 us per 24 KB tile even with no weight byte moving (DF_NO_WEIGHTS): slower than the HBM pace (0.75 us),
// so the consumer, not the stream, set the MLP's time.
struct DfX {
    float4 a[DF_KMAX / 256], b[DF_KMAX / 256];
};
__device__ __forceinline__ void df_x_load(DfX& x, const float* sx, int klen) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < DF_KMAX / 256; ++u) {
        const int c = lane * 8 + 256 * u;
        x.a[u] = c < klen ? *reinterpret_cast<const float4*>(sx + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        x.b[u] = c < klen ? *reinterpret_cast<const float4*>(sx + c + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}
// This lane's partial dot products of two bf16 rows r0, r1 (shared memory, klen columns, a multiple of 8) with x:
// every load of both rows in flight first, then the FMAs. Columns from klen on are zero (not read).
__device__ __forceinline__ void df_dot2_partial(const bf16_t* r0, const bf16_t* r1, const DfX& x, int klen,
                                                float& p0, float& p1) {
    const int lane = threadIdx.x & 31;
    uint4 w0[DF_KMAX / 256], w1[DF_KMAX / 256];
#pragma unroll
    for (int u = 0; u < DF_KMAX / 256; ++u) {
        const int c = lane * 8 + 256 * u;
        w0[u] = c < klen ? *reinterpret_cast<const uint4*>(r0 + c) : make_uint4(0u, 0u, 0u, 0u);
        w1[u] = c < klen ? *reinterpret_cast<const uint4*>(r1 + c) : make_uint4(0u, 0u, 0u, 0u);
    }
    p0 = 0.f;
    p1 = 0.f;
#pragma unroll
    for (int u = 0; u < DF_KMAX / 256; ++u) {
        p0 += dot8_bf16(w0[u], x.a[u], x.b[u]);
        p1 += dot8_bf16(w1[u], x.a[u], x.b[u]);
    }
}
// Warp sums of two per-lane partials in five shuffles (not ten): row 0's sum in lanes 0-15, row 1's in 16-31.
__device__ __forceinline__ float df_sum2(float p0, float p1) {
    const bool hi = (threadIdx.x & 16) != 0;
    float v = (hi ? p1 : p0) + __shfl_xor_sync(0xffffffffu, hi ? p0 : p1, 16);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Merge head h's split partials (numerator, (max, denominator) per split, log2 domain) into so[0..HD).
template <int HD>
__device__ __forceinline__ void df_merge_head(const float* part_o, const float2* part_ml, int Hq, int h, int nsplit,
                                              float* so, float* s_m, float* s_den, float* s_num) {
    constexpr int TPH = HD / 4;               // threads per head row (4 dims each)
    constexpr int NG = DF_THREADS / TPH;      // split groups
    const int d = (threadIdx.x % TPH) * 4, g = threadIdx.x / TPH;
    float M = -INFINITY, den = 0.f;
    float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = g; s0 < nsplit; s0 += NG * DF_MSPLIT) {
        float2 ml[DF_MSPLIT];
        float4 o[DF_MSPLIT];
#pragma unroll
        for (int j = 0; j < DF_MSPLIT; ++j) {
            const int s = s0 + j * NG;
            ml[j] = s < nsplit ? __ldcg(part_ml + (size_t)s * Hq + h) : make_float2(-INFINITY, 0.f);
            o[j] = s < nsplit ? __ldcg(reinterpret_cast<const float4*>(part_o + ((size_t)s * Hq + h) * HD + d))
                              : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < DF_MSPLIT; ++j) {
            if (ml[j].x == -INFINITY) continue;
            const float nm = fmaxf(M, ml[j].x);
            const float a = M == -INFINITY ? 0.f : exp2f(M - nm), e = exp2f(ml[j].x - nm);
            num.x = fmaf(num.x, a, e * o[j].x);
            num.y = fmaf(num.y, a, e * o[j].y);
            num.z = fmaf(num.z, a, e * o[j].z);
            num.w = fmaf(num.w, a, e * o[j].w);
            den = fmaf(den, a, e * ml[j].y);
            M = nm;
        }
    }
    *reinterpret_cast<float4*>(s_num + g * HD + d) = num;
    if (d == 0) { s_m[g] = M; s_den[g] = den; }
    csync();
    if (threadIdx.x < HD) {
        const int dd = threadIdx.x;
        so[dd] = merge_split_groups<NG>(s_m, s_den, [&](int i) { return s_num[i * HD + dd]; });
    }
    csync();
}

template <int HD>
__device__ __forceinline__ void decode_df_body(const unsigned long long* __restrict__ lp_g, int nl, float* x,
        float* qv, float* part_o, float2* part_ml, float* act, const int* __restrict__ key_slots,
        const int* __restrict__ meta, int step, const float2* __restrict__ rope_cs, int H, int I, int Hq,
        int n_kvh, float eps, float qscale, int kps, unsigned* cnt, int* err, unsigned long long* prof) {
    // dynamic shared memory: the weight ring, then one vector area (GEMV input, attention staging or act;
    // never live at once)
    extern __shared__ __align__(128) unsigned char dsm[];
    __shared__ __align__(8) uint64_t full[DF_NSLOT];
    __shared__ __align__(8) uint64_t empty[DF_NSLOT];
    __shared__ int sSlot[ATT_KC];
    __shared__ float2 q_cs[HD / 2];
    __shared__ __align__(16) float so[HD];
    __shared__ __align__(16) float s_num[DF_THREADS * 4];
    __shared__ float s_m[DF_THREADS / (HD / 4)], s_den[DF_THREADS / (HD / 4)];
    __shared__ float red[33];
    if (blockDim.x != DF_BLOCK || nl > DF_MAXL) {  // a launch this kernel cannot run: flag, do nothing
        if (threadIdx.x == 0) atomicExch(err, 3);
        return;
    }
    // the split's keys' RoPE rows (the same positions in every layer: loaded once per launch)
    float2* const s_rope = reinterpret_cast<float2*>(dsm + DF_RING_BYTES);
    unsigned char* vec = dsm + DF_RING_BYTES + DF_ROPE_BYTES;
    float* sx = reinterpret_cast<float*>(vec);
    // the attention's staging buffer after the vector area, so that the old keys of a layer are staged before
    // its QKV phase, under the wait for x (host: the same sizes)
    unsigned char* stg = vec + ((size_t)max(I, H) * 4 + 127) / 128 * 128;
    const DfPlan p = df_plan(H, I, Hq, HD, n_kvh);
    DfRing ring{dsm, full, empty, 0, nl * p.per_layer, err, nl};
    __shared__ unsigned long long sP[DF_MAXL * DF_PTRS];  // the layer pointer table (read by every tile issue)
    for (int i = threadIdx.x; i < nl * DF_PTRS; i += DF_BLOCK) sP[i] = lp_g[i];
    int nprof = 0;
    df_stamp(prof, nprof);
    if (threadIdx.x == 0) {
        for (int s = 0; s < DF_NSLOT; ++s) {
            mbar_init(full + s, 1);
            mbar_init(empty + s, DF_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the last barrier of the whole block: from here the producer warp runs on its own
    if (threadIdx.x >= DF_THREADS) {  // weights never depend on activations: the stream starts at once
        if (threadIdx.x == DF_THREADS) df_produce(p, sP, dsm, full, empty, ring.total, nl, err);
        return;
    }
    const int L = meta[3] + step;  // keys seen by this token, itself included
    const int nsplit = (L + kps - 1) / kps;
    const int new_slot = key_slots[L - 1];
    const int nq = Hq * HD, nkv = n_kvh * HD, G = Hq / n_kvh;
    for (int d = threadIdx.x; d < HD / 2; d += DF_THREADS) q_cs[d] = rope_cs[(size_t)(L - 1) * (HD / 2) + d];
    const bool prestage = kps == ATT_KC && nsplit * n_kvh <= p.NB;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned NB = (unsigned)p.NB;
    // The keys [kbeg, L - 1) of this block's split (all but this token's, whose K/V come out of the QKV phase) are
    // the same in every layer: their slot indices and RoPE rows are read once, here. A layer's old keys are copied
    // raw by cp.async (issue_old: K rows into sK at its row stride, V rows into the sVt area) right after the
    // previous layer's attention, and nothing waits for them there; finish_old rotates K in place and transposes V
    // from shared memory (rows from s_nrow on, this token's key and beyond, zero). Session 8 staged them with
    // register loads after the attention: two dependent memory round trips, ~4 us on every block's path to o_proj.
    // Whatever a block does between two counters is on that path (every block reaches each counter wait at about
    // the same time), finish_old too, wherever it sits.
    const bool stages = prestage && p.b < nsplit * n_kvh;  // block-uniform
    const int s_kvh = stages ? p.b / nsplit : 0, s_kc0 = stages ? (p.b % nsplit) * kps : 0;
    const int s_nrow = stages ? min(L - 1, s_kc0 + kps) - s_kc0 : 0;
    if (stages && threadIdx.x < ATT_KC)
        sSlot[threadIdx.x] = s_kc0 + (int)threadIdx.x < min(L, s_kc0 + kps) ? key_slots[s_kc0 + threadIdx.x] : -1;
    if (stages)  // rows s_kc0 .. s_kc0 + s_nrow - 1 of the table are contiguous (completed with layer 0's keys)
        for (int i = threadIdx.x; i < s_nrow * (HD / 2) / 2; i += DF_THREADS)
            cp_async16(s_rope + 2 * i, rope_cs + (size_t)s_kc0 * (HD / 2) + 2 * i);
    csync();
    bf16_t* const sK = reinterpret_cast<bf16_t*>(stg);
    bf16_t* const sVt = sK + ATT_KC * (HD + 8);
    auto issue_old = [&](const bf16_t* kcl, const bf16_t* vcl) {
        if (!stages) return;
        csync();  // the staging area (also the attention's merge scratch) is no longer read
        constexpr int CPR = HD / 8;  // 16-byte pieces per row
        for (int it = threadIdx.x; it < s_nrow * CPR; it += DF_THREADS) {
            const int key = it / CPR, c = (it - key * CPR) * 8;
            const size_t row = (size_t)sSlot[key] * nkv + s_kvh * HD + c;
            cp_async16(sK + key * (HD + 8) + c, kcl + row);
            cp_async16(sVt + key * HD + c, vcl + row);  // raw [key][HD] rows in the sVt area until finish_old
        }
        cp_async_commit();
    };
    auto finish_old = [&]() {
        if (!stages) return;
        constexpr int HALF = HD / 2, KSTR = HD + 8, NI = ATT_KC * (HD / 8), NK = NI / DF_THREADS;
        cp_async_wait<0>();
        csync();
        // K items (key, 4 dims of each half), NK per thread
#pragma unroll
        for (int b = 0; b < NK; ++b) {
            const int it = threadIdx.x + b * DF_THREADS, key = it / (HALF / 4), d = (it - key * (HALF / 4)) * 4;
            uint2* plo = reinterpret_cast<uint2*>(sK + key * KSTR + d);
            uint2* phi = reinterpret_cast<uint2*>(sK + key * KSTR + HALF + d);
            if (key < s_nrow) {
                put_k_rot4<HD>(sK, key, d, *plo, *phi, *reinterpret_cast<const float4*>(s_rope + key * HALF + d),
                               *reinterpret_cast<const float4*>(s_rope + key * HALF + d + 2));
            } else {
                *plo = make_uint2(0u, 0u);
                *phi = make_uint2(0u, 0u);
            }
        }
        // V items (key, 8 dims), key-fastest across a warp: all raw rows read before the transposed layout
        // overwrites the area
        uint4 v[NK];
#pragma unroll
        for (int b = 0; b < NK; ++b) {
            const int it = threadIdx.x + b * DF_THREADS, key = it % ATT_KC, d = (it / ATT_KC) * 8;
            v[b] = key < s_nrow ? *reinterpret_cast<const uint4*>(sVt + key * HD + d) : make_uint4(0u, 0u, 0u, 0u);
        }
        csync();
#pragma unroll
        for (int b = 0; b < NK; ++b) {
            const int it = threadIdx.x + b * DF_THREADS, key = it % ATT_KC, d = (it / ATT_KC) * 8;
            put_vt8(sVt, key, d, v[b]);
        }
        // (the attention body's first barrier orders these stores before its reads)
    };
#pragma unroll 1
    for (int l = 0; l < nl; ++l) {
        const unsigned long long* P = sP + (size_t)l * DF_PTRS;
        const bf16_t* kc = reinterpret_cast<const bf16_t*>(P[7]);
        const bf16_t* vc = reinterpret_cast<const bf16_t*>(P[8]);
        // this layer's old keys, copied during the previous layer's (layer 0: here, before the PDL wait, as this
        // step writes no cache row of an older key), rotated / transposed under the wait for the other blocks' down
        // tiles (session 9 run 3: under the QKV counter wait instead, 0.16 ms slower)
        if (l == 0) issue_old(kc, vc);
        finish_old();
        // ---- QKV ----
        if (l == 0) pdl_wait();  // the token's x comes from the embedding kernel
        else df_wait(cnt + 4, NB * l, err);
        df_stamp(prof, nprof);
        df_load_vec(sx, x, H, reinterpret_cast<const bf16_t*>(P[0]), eps, red);
        {
            DfX xr;
            df_x_load(xr, sx, H);
            const float* bias = reinterpret_cast<const float*>(P[2]);
            bf16_t* kw = reinterpret_cast<bf16_t*>(P[7]);
            bf16_t* vw = reinterpret_cast<bf16_t*>(P[8]);
            const bool out = (lane & 15) == 0;  // lanes 0, 16: the warp's two rows (df_sum2)
#pragma unroll 1
            for (int i = 0; i < p.nQ; ++i) {
                const int n = (p.b + i * p.NB) * 8 + 2 * warp + (lane >> 4);
                const float bv = out ? bias[n] : 0.f;
                float a0, a1;
                const bf16_t* w = reinterpret_cast<const bf16_t*>(ring.acquire()) + (size_t)2 * warp * H;
                df_dot2_partial(w, w + H, xr, H, a0, a1);
                ring.release();  // (the slot's reads are done: the reduction below needs only registers)
                const float a = df_sum2(a0, a1);
                if (out) {
                    const float y = a + bv;
                    if (n < nq) qv[n] = y;
                    else if (n < nq + nkv) kw[(size_t)new_slot * nkv + (n - nq)] = f32_to_bf16(y);
                    else vw[(size_t)new_slot * nkv + (n - nq - nkv)] = f32_to_bf16(y);
                }
            }
        }
        df_arrive(cnt + 0);
        // ---- attention partials ----
        df_wait(cnt + 0, NB * (l + 1), err);
        df_stamp(prof, nprof);
#pragma unroll 1
        for (int vb = p.b; vb < nsplit * n_kvh; vb += p.NB) {
            if (!prestage) ATT_SYNC();  // the staging buffer of the previous virtual block is consumed
            attn_decode_mma_body<HD, false, true>(qv, kc, vc, key_slots, meta, step, rope_cs, G, n_kvh, kps, qscale,
                                                  part_o, part_ml, stg, sSlot, vb % nsplit, vb / nsplit, q_cs,
                                                  prestage ? L - 1 : -1);
        }
        df_arrive(cnt + 1);
        // the next layer's old keys on their way: the staging area is free now
        if (l + 1 < nl)
            issue_old(reinterpret_cast<const bf16_t*>(P[DF_PTRS + 7]), reinterpret_cast<const bf16_t*>(P[DF_PTRS + 8]));
        // ---- merge head o_head + o_proj rows [o_r0, o_r1) of that head ----
        if (p.nO > 0) {
            df_wait(cnt + 1, NB * (l + 1), err);
            df_stamp(prof, nprof);
            df_merge_head<HD>(part_o, part_ml, Hq, p.o_head, nsplit, so, s_m, s_den, s_num);
            constexpr int LPR = HD / 8, RPW = 32 / LPR;  // lanes per row (8 dims each), rows per warp step
            const int c = (lane % LPR) * 8;
            const float4 a = *reinterpret_cast<const float4*>(so + c);
            const float4 bb = *reinterpret_cast<const float4*>(so + c + 4);
#pragma unroll 1
            for (int i = 0; i < p.nO; ++i) {
                const int r0 = p.o_r0 + i * p.o_rows_per_tile, n = min(p.o_rows_per_tile, p.o_r1 - r0);
                const bf16_t* w = reinterpret_cast<const bf16_t*>(ring.acquire());
                constexpr int STEP = DF_WARPS * RPW, NQ = 4;  // four rows per lane group at once: their loads and
                                                              // shuffle reductions overlap (run 11: 1.5 us per tile)
                for (int rr = warp * RPW; rr < n; rr += NQ * STEP) {
                    float v[NQ];
#pragma unroll
                    for (int q = 0; q < NQ; ++q) {
                        const int r = rr + q * STEP + lane / LPR;
                        v[q] = r < n ? dot8_bf16(*reinterpret_cast<const uint4*>(w + (size_t)r * HD + c), a, bb) : 0.f;
                    }
#pragma unroll
                    for (int o = LPR / 2; o > 0; o >>= 1)
#pragma unroll
                        for (int q = 0; q < NQ; ++q) v[q] += __shfl_xor_sync(0xffffffffu, v[q], o);
                    if (lane % LPR == 0)
#pragma unroll
                        for (int q = 0; q < NQ; ++q) {
                            const int r = rr + q * STEP + lane / LPR;
                            if (r < n) atomicAdd(x + r0 + r, v[q]);
                        }
                }
                ring.release();
            }
        } else {
            df_stamp(prof, nprof);
        }
        df_arrive(cnt + 2);
        // ---- gate/up + SiLU * up ----
        df_wait(cnt + 2, NB * (l + 1), err);
        df_stamp(prof, nprof);
        df_load_vec(sx, x, H, reinterpret_cast<const bf16_t*>(P[4]), eps, red);
        {
            DfX xr;
            df_x_load(xr, sx, H);
#pragma unroll 1
            for (int i = 0; i < p.nG; ++i) {  // tile rows: gate of outputs o0 .. o0 + 3, then their up rows
                // warp w: the gate and up rows of output o0 + w
                float g, u;
                const bf16_t* w = reinterpret_cast<const bf16_t*>(ring.acquire()) + (size_t)warp * H;
                df_dot2_partial(w, w + (size_t)4 * H, xr, H, g, u);
                ring.release();
                const float gs = df_sum2(g, u), us = __shfl_sync(0xffffffffu, gs, 16);
                if (lane == 0) act[4 * (p.b + i * p.NB) + warp] = silu(gs) * us;
            }
        }
        df_arrive(cnt + 3);
        // ---- down + residual ----
        df_wait(cnt + 3, NB * (l + 1), err);
        df_stamp(prof, nprof);
        df_load_vec(sx, act, I, nullptr, eps, red);
        {
#pragma unroll 1
            for (int i = 0; i < p.nD; ++i) {
                const int t = p.b + i * p.NB, rg = t / p.nseg, seg = t - rg * p.nseg;
                const int c0 = seg * DF_KMAX, klen = min(DF_KMAX, I - c0);
                // the tile's act segment, loaded for every tile: kept across tiles (one segment per block at 132
                // SMs) it pushed the kernel to 255 registers and a 16-byte spill, and the step was 0.27 ms slower
                // (session 10 run 3)
                DfX xr;
                df_x_load(xr, sx + c0, klen);
                float a0, a1;
                const bf16_t* w = reinterpret_cast<const bf16_t*>(ring.acquire()) + (size_t)2 * warp * klen;
                df_dot2_partial(w, w + klen, xr, klen, a0, a1);
                ring.release();
                const float a = df_sum2(a0, a1);
                if ((lane & 15) == 0) atomicAdd(x + rg * 8 + 2 * warp + (lane >> 4), a);
            }
        }
        df_arrive(cnt + 4);
    }
    df_stamp(prof, nprof);
}

#define DF_PARAMS const unsigned long long* __restrict__ lp, int nl, float* x, float* qv, float* part_o, \
    float2* part_ml, float* act, const int* __restrict__ key_slots, const int* __restrict__ meta, int step, \
    const float2* __restrict__ rope_cs, int H, int I, int Hq, int n_kvh, float eps, float qscale, int kps, \
    unsigned* cnt, int* err, unsigned long long* prof
#define DF_ARGS lp, nl, x, qv, part_o, part_ml, act, key_slots, meta, step, rope_cs, H, I, Hq, n_kvh, eps, qscale, \
    kps, cnt, err, prof

#if VLA_SM90
extern "C" __global__ void __launch_bounds__(DF_BLOCK, 1) decode_df_hd128(DF_PARAMS) { decode_df_body<128>(DF_ARGS); }
extern "C" __global__ void __launch_bounds__(DF_BLOCK, 1) decode_df_hd64(DF_PARAMS) { decode_df_body<64>(DF_ARGS); }
#else
// Built for a GPU older than sm_90 (no TMA bulk copies, no mbarrier transaction counts): the kernels exist, so the
// module loads, but a launch only flags itself (code 3). The host refuses decode_kernel "dataflow" there first.
extern "C" __global__ void decode_df_hd128(DF_PARAMS) { if (threadIdx.x == 0 && blockIdx.x == 0) atomicExch(err, 3); }
extern "C" __global__ void decode_df_hd64(DF_PARAMS) { if (threadIdx.x == 0 && blockIdx.x == 0) atomicExch(err, 3); }
#endif

// W_o [H rows][Hq * HD] -> head-major [Hq][H][HD], so that one head's rows are one contiguous TMA tile.
extern "C" __global__ void df_wo_head_major(const bf16_t* __restrict__ wo, bf16_t* __restrict__ out, int H, int Hq,
                                            int HD) {
    const size_t n = (size_t)H * Hq * HD;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const int d = (int)(i % HD);
        const size_t hr = i / HD;
        const int r = (int)(hr % H), h = (int)(hr / H);
        out[i] = wo[(size_t)r * Hq * HD + (size_t)h * HD + d];
    }
}
