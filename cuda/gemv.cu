// Decode GEMVs: y[n] = W[n][:] . v, bf16 weights, fp32 vector (in shared memory) and fp32 accumulation.
// One warp owns RPW rows; each lane streams 16-byte weight chunks (8 bf16), GEMV_U chunks per row in flight.
// The first batch of weight loads is issued BEFORE the prologue (vector load, RMSNorm), which does not depend
// on them, so the prologue's latency hides under the weight fetch. 8 warps per block. Fused prologues
// (RMSNorm of the residual) and epilogues (bias + K/V store, residual add, SiLU(gate)*up, logits).
#include "common.cuh"

#define GEMV_WARPS 8
#define GEMV_U 6

template <int RPW>
struct GemvRows {
    const bf16_t* p[RPW];
    uint4 w[GEMV_U][RPW];
};

// issue the first GEMV_U chunks of every row (guarded by K and by the warp having rows at all)
template <int RPW>
__device__ __forceinline__ void gemv_prefetch(GemvRows<RPW>& R, int K, bool valid) {
    const int c0 = (threadIdx.x & 31) * 8;
#pragma unroll
    for (int u = 0; u < GEMV_U; ++u)
#pragma unroll
        for (int r = 0; r < RPW; ++r)
            if (valid && c0 + 256 * u < K) R.w[u][r] = ldg_stream16(R.p[r] + c0 + 256 * u);
}

// consume the prefetched batch, stream the rest, reduce over the warp
template <int RPW>
__device__ __forceinline__ void gemv_finish(const float* sx, GemvRows<RPW>& R, int K, float (&acc)[RPW]) {
    const int c0 = (threadIdx.x & 31) * 8;
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
    for (int base = 0; base < K; base += 256 * GEMV_U) {
        if (base > 0) {
#pragma unroll
            for (int u = 0; u < GEMV_U; ++u)
#pragma unroll
                for (int r = 0; r < RPW; ++r)
                    if (base + c0 + 256 * u < K) R.w[u][r] = ldg_stream16(R.p[r] + base + c0 + 256 * u);
        }
#pragma unroll
        for (int u = 0; u < GEMV_U; ++u) {
            const int c = base + c0 + 256 * u;
            if (c < K) {
                const float4 a = *reinterpret_cast<const float4*>(sx + c);
                const float4 b = *reinterpret_cast<const float4*>(sx + c + 4);
#pragma unroll
                for (int r = 0; r < RPW; ++r) acc[r] += dot8_bf16(R.w[u][r], a, b);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = warp_sum(acc[r]);
}

#include "gemv_core.cuh"  // GemvNorm, gemv_prologue, gemv_start

// Fused RMSNorm + QKV (+bias). Rows [0, nq) -> q_out (fp32, pre-RoPE); [nq, nq+nkv) -> K cache, [nq+nkv, nq+2nkv)
// -> V cache, both bf16 and pre-RoPE, at slot key_slots[meta[3] + step - 1] (decode step `step`, 1-based).
// Two rows per warp: grid.x = ceil((nq + 2 nkv) / 16).
// Before the wait, the grid asks L2 for this layer's K/V rows of the n_ctx keys older than the pass (one 128-byte
// line per thread and round), so the decode attention that follows finds them there (without: +0.07 ms per chunk).
extern "C" __global__ void __launch_bounds__(256) gemv_qkv(const float* __restrict__ x,
        const bf16_t* __restrict__ normw, float eps, const bf16_t* __restrict__ W, const float* __restrict__ bias,
        int K, int nq, int nkv, float* __restrict__ q_out, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
        const int* __restrict__ key_slots, const int* __restrict__ meta, int step) {
    extern __shared__ float sx[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ntot = nq + 2 * nkv;
    const int n0 = (blockIdx.x * GEMV_WARPS + warp) * 2;
    const bool valid = n0 < ntot;
    GemvRows<2> R;
    R.p[0] = W + (size_t)min(n0, ntot - 1) * K;
    R.p[1] = W + (size_t)min(n0 + 1, ntot - 1) * K;
    // the epilogue's bias and cache slot are constants: read before the PDL wait, not after the dot products
    const int n = n0 + lane;
    const bool writer = lane < 2 && valid && n < ntot;
    const float b = writer ? bias[n] : 0.f;
    const int slot = writer && n >= nq ? key_slots[meta[3] + step - 1] : 0;
    gemv_start<2, FAM_QKV>(sx, R, K, valid, x, normw, eps, nullptr, [&]() {
        const int lines = nkv / 64;  // 128-byte lines per cache row (nkv bf16)
        const int total = meta[3] * 2 * lines;
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
            const int key = i / (2 * lines), part = i - key * 2 * lines;
            const bf16_t* base = part < lines ? kc : vc;
            const bf16_t* p = base + (size_t)key_slots[key] * nkv + (part % lines) * 64;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
        }
    });
    if (!valid) return;
    float acc[2];
    gemv_finish(sx, R, K, acc);
    if (writer) {
        const float y = (lane == 0 ? acc[0] : acc[1]) + b;
        if (n < nq) {
            q_out[n] = y;
        } else {
            const int e = n - nq;
            if (e < nkv) kc[(size_t)slot * nkv + e] = f32_to_bf16(y);
            else vc[(size_t)slot * nkv + (e - nkv)] = f32_to_bf16(y);
        }
    }
}

// x[n] += W[n] . v   (o_proj and down_proj with the residual add fused). Two rows per warp:
// grid.x = ceil(N / 16). Split-K over grid.y (ks_len a multiple of 8): each split adds its share atomically.
extern "C" __global__ void __launch_bounds__(256) gemv_resid(const float* __restrict__ v,
        const bf16_t* __restrict__ W, int N, int K, int ks_len, float* __restrict__ x) {
    extern __shared__ float sx[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kbeg = blockIdx.y * ks_len;
    const int klen = min(K - kbeg, ks_len);
    const int n0 = (blockIdx.x * GEMV_WARPS + warp) * 2;
    const bool valid = n0 < N && klen > 0;
    GemvRows<2> R;
    R.p[0] = W + (size_t)min(n0, N - 1) * K + kbeg;
    R.p[1] = W + (size_t)min(n0 + 1, N - 1) * K + kbeg;
    gemv_start<4, FAM_RESID>(sx, R, klen, valid, v + kbeg, nullptr, 0.f, nullptr);
    if (!valid) return;
    float acc[2];
    gemv_finish(sx, R, klen, acc);
    if (lane < 2 && n0 + lane < N) {
        const float y = lane == 0 ? acc[0] : acc[1];
        if (gridDim.y == 1) x[n0 + lane] += y;
        else atomicAdd(x + n0 + lane, y);
    }
}

// act[o] = silu(gate[o]) * up[o] with RMSNorm prologue; W holds gate/up rows interleaved in blocks of 8:
// rows 16b..16b+7 = gate 8b..8b+7, rows 16b+8..16b+15 = up 8b..8b+7. grid.x = ceil(I / 8).
extern "C" __global__ void __launch_bounds__(256) gemv_gateup(const float* __restrict__ x,
        const bf16_t* __restrict__ normw, float eps, const bf16_t* __restrict__ W, int I, int K,
        float* __restrict__ act) {
    extern __shared__ float sx[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int o = blockIdx.x * GEMV_WARPS + warp;
    const bool valid = o < I;
    const int oc = min(o, I - 1);
    const int gr = gateup_gate_row(oc);
    GemvRows<2> R;
    R.p[0] = W + (size_t)gr * K;
    R.p[1] = W + (size_t)(gr + 8) * K;
    gemv_start<2, FAM_GATEUP>(sx, R, K, valid, x, normw, eps, nullptr);
    if (!valid) return;
    float acc[2];
    gemv_finish(sx, R, K, acc);
    if (lane == 0) act[o] = silu(acc[0]) * acc[1];
}

// logits[n] = W[n] . rmsnorm(x_row) for the action rows (W = embedding rows vocab-256 .. vocab-1).
// x_row = x + row*K with row = (row_meta >= 0 ? meta[row_meta] - 1 : 0) (prefill: the last valid token).
// normw may be null (x already normalised). norm_out: the final hidden state (written by block 0).
// One row per warp: grid.x = ceil(N / 8). grid.y: that many consecutive x rows, row + y -> logits[y * N ..] (the
// parallel pass's heads; 1 everywhere else, where blockIdx.y = 0 leaves the kernel as it was).
extern "C" __global__ void __launch_bounds__(256) gemv_logits(const float* __restrict__ x, const int* __restrict__ meta,
        int row_meta, const bf16_t* __restrict__ normw, float eps, const bf16_t* __restrict__ W, int N, int K,
        float* __restrict__ logits, float* __restrict__ norm_out) {
    extern __shared__ float sx[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * GEMV_WARPS + warp;
    const bool valid = n < N;
    GemvRows<1> R;
    R.p[0] = W + (size_t)min(n, N - 1) * K;
    // meta is host-written: readable before the wait. grid.y > 1: rows row .. row + gridDim.y - 1, one per blockIdx.y
    // (the parallel pass's A action slots in one launch; norm_out then null)
    const int row = (row_meta >= 0 ? meta[row_meta] - 1 : 0) + blockIdx.y;
    gemv_start<2, -1>(sx, R, K, valid, x + (size_t)row * K, normw, eps, norm_out);
    if (!valid) return;
    float acc[1];
    gemv_finish(sx, R, K, acc);
    if (lane == 0) logits[(size_t)blockIdx.y * N + n] = acc[0];
}

// What the host reads from the compiled module (engine/cuda/kernels.py LAUNCH_CONSTANTS), in this order.
__constant__ int vla_launch[1] = {GEMV_WARPS};
