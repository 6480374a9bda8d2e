// What both skinny-GEMM files share (gemm_skinny.cu: bf16 weights; gemm_quant.cu: int8 / fp8 / int4 codes): the
// tile constants, the k32 mma step and the gemm32v4 reduction epilogue. gemm_skinny.cu's header and the gemm32v4
// note below say how they work.
#pragma once
#include "common.cuh"

#define GEMM_WARPS 8         // warps per block of gemm32_* (4 measured slower on the H200: docs/KERNEL_NOTES.md)
#define GEMM_KC 256          // K chunk staged in shared memory
#define GEMM_SA 36           // row stride of the staged chunk in 16-byte words: 32 + 4 (== 4 mod 8: no conflicts)

enum { GEMM_ATOMIC = 0, GEMM_SILU = 1 };

// One k32 step of a warp's 32-token x 16-row tile: activation words q of rows g, g+8, g+16, g+24 (row stride sa,
// 16-byte words), b = the lane's words of its two weight rows (g and g+8); words {2h, 2h+1} feed k16 half h.
__device__ __forceinline__ void mma_k32(float (&acc)[2][2][4], const uint4 (&b)[2], const uint4* sA, int sa, int q,
                                        int g) {
    const uint4 a0 = sA[g * sa + q], a1 = sA[(g + 8) * sa + q];
    const uint4 a2 = sA[(g + 16) * sa + q], a3 = sA[(g + 24) * sa + q];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const uint32_t b0 = u4_word(b[j], 2 * h), b1 = u4_word(b[j], 2 * h + 1);
            mma_bf16_16816(acc[0][j], u4_word(a0, 2 * h), u4_word(a1, 2 * h), u4_word(a0, 2 * h + 1),
                           u4_word(a1, 2 * h + 1), b0, b1);
            mma_bf16_16816(acc[1][j], u4_word(a2, 2 * h), u4_word(a3, 2 * h), u4_word(a2, 2 * h + 1),
                           u4_word(a3, 2 * h + 1), b0, b1);
        }
}

// C[0..32) x [nw, nw + 16) += a warp's 32-token x 16-row tile (mma_k32's accumulator layout), fp32 atomics: the
// epilogue of every split-K gemm32 (bf16, quantised, the fleet's multi-tile form).
__device__ __forceinline__ void gemm32_add_tile(float* __restrict__ C, int ldc, int nw, int g, int t,
                                                const float (&acc)[2][2][4]) {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int col = nw + j * 8 + 2 * t;
            const int r0 = mi * 16 + g;
            atomicAdd(C + (size_t)r0 * ldc + col, acc[mi][j][0]);
            atomicAdd(C + (size_t)r0 * ldc + col + 1, acc[mi][j][1]);
            atomicAdd(C + (size_t)(r0 + 8) * ldc + col, acc[mi][j][2]);
            atomicAdd(C + (size_t)(r0 + 8) * ldc + col + 1, acc[mi][j][3]);
        }
}

// gemm32_add_tile with a quarter of the atomics (the fleet's multi-tile GEMM, whose split-K partial sums are added
// once per tile): lanes t and t ^ 1 swap a pair of values so that the even lane holds four consecutive columns of
// row r0 and the odd lane four of row r0 + 8, added by one 16-byte vector atomic (sm_90; before it, four scalar
// ones). ldc and nw are multiples of 4, so the four columns are 16-byte aligned.
__device__ __forceinline__ void gemm32_add_tile_v4(float* __restrict__ C, int ldc, int nw, int g, int t,
                                                   const float (&acc)[2][2][4]) {
    const bool odd = t & 1;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const float* a = acc[mi][j];
            const float rx = __shfl_xor_sync(0xffffffffu, odd ? a[0] : a[2], 1);
            const float ry = __shfl_xor_sync(0xffffffffu, odd ? a[1] : a[3], 1);
            const float4 v = odd ? make_float4(rx, ry, a[2], a[3]) : make_float4(a[0], a[1], rx, ry);
            const int row = mi * 16 + g + (odd ? 8 : 0);
            float* c = C + (size_t)row * ldc + nw + j * 8 + 2 * (t & ~1);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            atomicAdd(reinterpret_cast<float4*>(c), v);
#else
            atomicAdd(c, v.x);
            atomicAdd(c + 1, v.y);
            atomicAdd(c + 2, v.z);
            atomicAdd(c + 3, v.w);
#endif
        }
}

// A K chunk's bf16 weights of a gemm32 warp (rows W0 and W1 = W0 + 8 K, 16-byte streaming loads, all in flight
// before any is used): b[u] = k32 step u of the chunk starting at column kc, clen columns long.
__device__ __forceinline__ void gemm32_load_w(uint4 (&b)[GEMM_KC / 32][2], const bf16_t* W0, const bf16_t* W1,
                                              int kc, int clen, bool active) {
#pragma unroll
    for (int u = 0; u < GEMM_KC / 32; ++u) {
        if (active && 32 * u < clen) {
            b[u][0] = ldg_stream16(W0 + kc + 32 * u);
            b[u][1] = ldg_stream16(W1 + kc + 32 * u);
        }
    }
}

// ---- gemm32v4: balanced grid, split K inside the block, weights double-buffered in registers across row groups.
// The gemm32_* grids give each block a fixed set of 16-row groups over its K range: 140 gate/up blocks on 132 SMs
// (8 SMs do two), one weight chunk in flight per warp between mma phases, and the down GEMM 22 K splits x 32
// tokens x 1536 fp32 atomics. Here grid = (R row-group ranges, S K splits) with R x S <= SMs: block (r, s)
// owns a balanced range of 16-row groups and the K range s (k32 steps balanced over S); its NW warps split that
// K range (warp w takes steps w, w + NW, ...: at most G4_U each), so one row group is one "item" for the whole
// block and each warp holds two items' weights in registers (the next requested before the current one feeds the
// mma; both before the PDL wait). A warp stages only its own activation columns (cp.async, no block barrier); the
// warps' partial sums meet in shared memory once per item (double-buffered: one barrier per item), then the
// epilogue adds into C (plainly when S == 1, atomically otherwise) or writes silu(gate) * up.
// K range per split <= 32 * G4_NW * G4_U = 1536 columns.
#define G4_NW 8
#define G4_U 6
#define G4_SA (4 * G4_U + 4)  // 16-byte words per activation row of a warp's slice (== 4 mod 8: no bank conflicts)
#define G4_SMEM (G4_NW * 32 * G4_SA * 16 + 2 * G4_NW * 16 * 32 * 4)  // activation slices + two reduction buffers

// the warps' partial sums of one item -> the epilogue (every thread of the block: 2 mi x 4 e x 32 source lanes)
template <int MODE>
__device__ __forceinline__ void g4_reduce(const float (&acc)[2][2][4], float* __restrict__ red, int rg,
                                          float* __restrict__ C, int ldc, bool atomic, bf16_t* __restrict__ act,
                                          int I) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) red[(warp * 16 + mi * 8 + j * 4 + e) * 32 + lane] = acc[mi][j][e];
    __syncthreads();
    const int sel = threadIdx.x >> 5, mi = sel >> 2, e = sel & 3;  // blockDim.x == 32 * G4_NW == 256
    float v[2] = {0.f, 0.f};
#pragma unroll
    for (int w = 0; w < G4_NW; ++w)
#pragma unroll
        for (int j = 0; j < 2; ++j) v[j] += red[(w * 16 + mi * 8 + j * 4 + e) * 32 + lane];
    const int g = lane >> 2, t = lane & 3;
    const int r = mi * 16 + g + (e >= 2 ? 8 : 0);
    const int cp = 2 * t + (e & 1);
    if (MODE == GEMM_ATOMIC) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float* c = C + (size_t)r * ldc + rg * 16 + j * 8 + cp;
            if (atomic) atomicAdd(c, v[j]);
            else *c += v[j];
        }
    } else {
        act[(size_t)r * I + rg * 8 + cp] = f32_to_bf16(silu(v[0]) * v[1]);
    }
}

