// Decode GEMVs over quantised weights (issue 23): int8 / fp8 e4m3 codes with per-row scales, int4 codes with group
// scales and zero points (cuda/wtype.cuh: how the bytes become numbers). The same structure as gemv.cu (the bf16
// kernels, kept apart so that their code is exactly the measured one): each lane streams 16-byte loads (16 int8 /
// fp8 or 32 int4 weights), dequantises in registers, accumulates in fp32; the input vector (RMS-normed where the
// kernel fuses the norm) is in shared memory. A warp takes GEMV_RPW rows (bf16: 2) with GEMV_U loads per row in
// flight, so it keeps about the bytes of a bf16 warp in flight (measured on the H200, 7-pass 1.5B chunk: int8 9.58 ms
// with 4 rows per warp, 11.51 with 2; int4 11.74 with 4, 12.15 with 8).
#include "common.cuh"
#include "wtype.cuh"

#define GEMV_WARPS 8
extern __shared__ float gemv_smem[];  // the input vector (dynamic shared memory)

template <int RPW, typename WT, int U = WT::GEMV_U>
struct GemvRows {
    static constexpr int NU = U;
    const char* p[RPW];        // row r's bytes from the kernel's first column (wtype.cuh wrow)
    typename WT::RowQ q[RPW];  // row r's quantisation parameters (none for bf16)
    typename WT::vec_t w[U][RPW];  // a batch of lane loads (16 bytes; 8 with GEMV_HALF_I4)
    typename WT::Q wq[U][RPW]; // ... and the parameters of the columns each covers (int4: its group)
};

// acc[lane] for the lanes below RPW (unrolled selects: a dynamic index would put acc in local memory)
template <int RPW>
__device__ __forceinline__ float lane_row(const float (&acc)[RPW], int lane) {
    float y = acc[0];
#pragma unroll
    for (int r = 1; r < RPW; ++r)
        if (lane == r) y = acc[r];
    return y;
}

// row r's load u of the batch at column base (a lane covers EPL columns, a warp 32 EPL: 16 and 512 bytes)
template <int RPW, typename WT, int U>
__device__ __forceinline__ void gemv_load(GemvRows<RPW, WT, U>& R, int u, int r, int c) {
    const char* p = R.p[r] + c * WT::BITS / 8;  // c < 2^28: int arithmetic (80 registers, not 92)
    if constexpr (sizeof(typename WT::vec_t) == 8) R.w[u][r] = ldg_stream8(p);
    else R.w[u][r] = ldg_stream16(p);
    R.wq[u][r] = WT::at(R.q[r], c);
}

// issue the first U chunks of every row (guarded by K and by the warp having rows at all)
template <int RPW, typename WT, int U>
__device__ __forceinline__ void gemv_prefetch(GemvRows<RPW, WT, U>& R, int K, bool valid) {
    constexpr int E = WT::EPL, W = 32 * WT::EPL;  // weights per lane load, per warp load
    const int c0 = (threadIdx.x & 31) * E;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < RPW; ++r)
            if (valid && c0 + W * u < K) gemv_load(R, u, r, c0 + W * u);
}

// consume the prefetched batch, stream the rest, reduce over the warp; acc[r]: row r's dot product, scaled
template <int RPW, typename WT, int U>
__device__ __forceinline__ void gemv_finish(const float* sx, GemvRows<RPW, WT, U>& R, int K, float (&acc)[RPW]) {
    constexpr int E = WT::EPL, W = 32 * WT::EPL;
    const int c0 = (threadIdx.x & 31) * E;
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
    for (int base = 0; base < K; base += W * U) {
        if (base > 0) {
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int r = 0; r < RPW; ++r)
                    if (base + c0 + W * u < K) gemv_load(R, u, r, base + c0 + W * u);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + c0 + W * u;
            if (c < K) {
                if constexpr (WT::XSUM) {  // GEMV_DENORM: the load's sum of x, once for all the warp's rows
                    float xs = 0.f;
#pragma unroll
                    for (int e = 0; e < E; e += 4) {
                        const float4 a = *reinterpret_cast<const float4*>(sx + c + e);
                        xs += (a.x + a.y) + (a.z + a.w);
                    }
#pragma unroll
                    for (int r = 0; r < RPW; ++r) acc[r] += WT::dot_xs(R.w[u][r], sx + c, R.wq[u][r], xs);
                } else {
#pragma unroll
                    for (int r = 0; r < RPW; ++r) acc[r] += WT::dot(R.w[u][r], sx + c, R.wq[u][r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = warp_sum(acc[r]) * R.q[r].scale() * (WT::XSUM ? GEMV_XS_BACK : 1.f);
}

#include "gemv_core.cuh"  // GemvNorm, gemv_prologue, gemv_start

template <typename WT>
__device__ __forceinline__ void gemv_qkv_body(const float* __restrict__ x, const bf16_t* __restrict__ normw,
        float eps, const void* __restrict__ W, const float* __restrict__ bias, int K, int nq, int nkv,
        float* __restrict__ q_out, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
        const int* __restrict__ key_slots, const int* __restrict__ meta, int step, const float* __restrict__ scales,
        const uint8_t* __restrict__ zeros) {
    float* sx = gemv_smem;
    constexpr int RPW = WT::GEMV_RPW;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ntot = nq + 2 * nkv;
    const int n0 = (blockIdx.x * GEMV_WARPS + warp) * RPW;
    const bool valid = n0 < ntot;
    GemvRows<RPW, WT> R;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {  // the rows and their scales: constants, read before the PDL wait
        const int row = min(n0 + r, ntot - 1);
        R.p[r] = wrow<WT>(W, row, K, 0);
        R.q[r].init(scales, zeros, row, K, 0);
    }
    // the epilogue's bias and cache slot are constants: read before the PDL wait, not after the dot products
    const int n = n0 + lane;
    const bool writer = lane < RPW && valid && n < ntot;
    const float b = writer ? bias[n] : 0.f;
    const int slot = writer && n >= nq ? key_slots[meta[3] + step - 1] : 0;
    gemv_start<2, FAM_QKV, WT::XSUM>(sx, R, K, valid, x, normw, eps, nullptr, [&]() {
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
    float acc[RPW];
    gemv_finish(sx, R, K, acc);
    if (writer) {
        const float y = lane_row(acc, lane) + b;
        if (n < nq) {
            q_out[n] = y;
        } else {
            const int e = n - nq;
            if (e < nkv) kc[(size_t)slot * nkv + e] = f32_to_bf16(y);
            else vc[(size_t)slot * nkv + (e - nkv)] = f32_to_bf16(y);
        }
    }
}

// x[n] += W[n] . v   (o_proj and down_proj with the residual add fused). RPW rows per warp:
// grid.x = ceil(N / (8 RPW)). Split-K over grid.y (ks_len a multiple of 256): each split adds its share atomically.
template <typename WT>
__device__ __forceinline__ void gemv_resid_body(const float* __restrict__ v, const void* __restrict__ W,
        int N, int K, int ks_len, float* __restrict__ x, const float* __restrict__ scales,
        const uint8_t* __restrict__ zeros) {
    float* sx = gemv_smem;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int RPW = WT::GEMV_RPW;
    const int kbeg = blockIdx.y * ks_len;
    const int klen = min(K - kbeg, ks_len);
    const int n0 = (blockIdx.x * GEMV_WARPS + warp) * RPW;
    const bool valid = n0 < N && klen > 0;
    GemvRows<RPW, WT> R;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int row = min(n0 + r, N - 1);
        R.p[r] = wrow<WT>(W, row, K, kbeg);
        R.q[r].init(scales, zeros, row, K, kbeg);
    }
    gemv_start<4, FAM_RESID, WT::XSUM>(sx, R, klen, valid, v + kbeg, nullptr, 0.f, nullptr);
    if (!valid) return;
    float acc[RPW];
    gemv_finish(sx, R, klen, acc);
    if (lane < RPW && n0 + lane < N) {
        const float y = lane_row(acc, lane);
        if (gridDim.y == 1) x[n0 + lane] += y;
        else atomicAdd(x + n0 + lane, y);
    }
}

// act[o] = silu(gate[o]) * up[o] with RMSNorm prologue; W holds gate/up rows interleaved in blocks of 8:
// rows 16b..16b+7 = gate 8b..8b+7, rows 16b+8..16b+15 = up 8b..8b+7. grid.x = ceil(I / (8 RPW / 2)).
template <typename WT>
__device__ __forceinline__ void gemv_gateup_body(const float* __restrict__ x, const bf16_t* __restrict__ normw,
        float eps, const void* __restrict__ W, int I, int K, float* __restrict__ act,
        const float* __restrict__ scales, const uint8_t* __restrict__ zeros) {
    float* sx = gemv_smem;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int RPW = WT::GEMV_RPW, M = RPW / 2;  // M outputs per warp: M gate rows and their M up rows
    const int o0 = (blockIdx.x * GEMV_WARPS + warp) * M;  // M divides 8: the M outputs share a block of 8
    const bool valid = o0 < I;
    GemvRows<RPW, WT> R;
#pragma unroll
    for (int j = 0; j < M; ++j) {
        const int gr = gateup_gate_row(min(o0 + j, I - 1));
        R.p[j] = wrow<WT>(W, gr, K, 0);
        R.q[j].init(scales, zeros, gr, K, 0);
        R.p[M + j] = wrow<WT>(W, gr + 8, K, 0);  // its up row, 8 rows below
        R.q[M + j].init(scales, zeros, gr + 8, K, 0);
    }
    gemv_start<2, FAM_GATEUP, WT::XSUM>(sx, R, K, valid, x, normw, eps, nullptr);
    if (!valid) return;
    float acc[RPW];
    gemv_finish(sx, R, K, acc);
#pragma unroll
    for (int j = 0; j < M; ++j)
        if (lane == j && o0 + j < I) act[o0 + j] = silu(acc[j]) * acc[M + j];
}

// Resident blocks per SM the int8 / fp8 GEMVs are compiled for (__launch_bounds__'s second argument: ptxas caps
// the registers at 65536 / (256 x MINB), spilling what does not fit). 0, the default, gives only the block size, and
// ptxas takes what it needs: 80 registers for bf16 (three blocks per SM), 103-124 for int8 / fp8 (two), 127-128 for
// int4 (two, with wtype.cuh's GEMV_U_I4 = 2). An explicit 1 is not the same: ptxas then takes up to 240. -D overrides
// for measuring the alternatives (3 for int8 / fp8: 80 registers, 60-92 bytes spilled; sm_90 ptxas of CUDA 13.0).
#ifndef GEMV_MINB_I8
#define GEMV_MINB_I8 0
#endif
#ifndef GEMV_MINB_F8
#define GEMV_MINB_F8 0
#endif
#if GEMV_MINB_I8 > 0
#define GEMV_LB_I8 __launch_bounds__(256, GEMV_MINB_I8)
#else
#define GEMV_LB_I8 __launch_bounds__(256)
#endif
#if GEMV_MINB_F8 > 0
#define GEMV_LB_F8 __launch_bounds__(256, GEMV_MINB_F8)
#else
#define GEMV_LB_F8 __launch_bounds__(256)
#endif

// The quantised twins (engine/cuda/plan.py KERNEL_SUFFIX): the same arguments with the weights as codes, then the
// scales (float32: per row for int8 / fp8, per row and group for int4) and the int4 zero points (uint8; null else).
#define GEMV_QUANTISED(SUF, WT, LB)                                                                                  \
    extern "C" __global__ void LB gemv_qkv##SUF(const float* __restrict__ x,                                         \
            const bf16_t* __restrict__ normw, float eps, const void* __restrict__ W,                                \
            const float* __restrict__ bias, int K, int nq, int nkv, float* __restrict__ q_out,                       \
            bf16_t* __restrict__ kc, bf16_t* __restrict__ vc, const int* __restrict__ key_slots,                     \
            const int* __restrict__ meta, int step, const float* __restrict__ scales,                                \
            const uint8_t* __restrict__ zeros) {                                                                     \
        gemv_qkv_body<WT>(x, normw, eps, W, bias, K, nq, nkv, q_out, kc, vc, key_slots, meta, step, scales, zeros); \
    }                                                                                                                \
    extern "C" __global__ void LB gemv_resid##SUF(const float* __restrict__ v,                                       \
            const void* __restrict__ W, int N, int K, int ks_len, float* __restrict__ x,                             \
            const float* __restrict__ scales, const uint8_t* __restrict__ zeros) {                                   \
        gemv_resid_body<WT>(v, W, N, K, ks_len, x, scales, zeros);                                                  \
    }                                                                                                                \
    extern "C" __global__ void LB gemv_gateup##SUF(const float* __restrict__ x,                                      \
            const bf16_t* __restrict__ normw, float eps, const void* __restrict__ W, int I, int K,                   \
            float* __restrict__ act, const float* __restrict__ scales, const uint8_t* __restrict__ zeros) {          \
        gemv_gateup_body<WT>(x, normw, eps, W, I, K, act, scales, zeros);                                           \
    }
GEMV_QUANTISED(_i8, WInt8, GEMV_LB_I8)
GEMV_QUANTISED(_f8, WFp8, GEMV_LB_F8)
#if GEMV_HALF_I4
#define GEMV_LB_I4 __launch_bounds__(256, 2)  // the knob's qkv took 176 registers on sm_80 without it
#else
#define GEMV_LB_I4 __launch_bounds__(256)  // 127-128 registers already: two blocks
#endif
GEMV_QUANTISED(_i4, WInt4, GEMV_LB_I4)


// What the host reads from the compiled module (engine/cuda/kernels.py LAUNCH_CONSTANTS), in this order.
__constant__ int vla_launch[3] = {GEMV_RPW_I8, GEMV_RPW_F8, GEMV_RPW_I4};
