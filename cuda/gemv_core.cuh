// Warp-level GEMV streaming shared by the decode GEMV kernels (gemv.cu) and the persistent decode kernel
// (decode_persistent.cu): one warp owns RPW weight rows, each lane streams 16-byte chunks (8 bf16),
// GEMV_U chunks per row in flight; the first batch can be issued long before the vector is known.
#pragma once
#include "common.cuh"

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
