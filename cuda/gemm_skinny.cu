// Skinny GEMM for the 32-token prefill: C[32][N] (+)= A[32][K] * W[N][K]^T with bf16 tensor cores
// (mma.sync m16n8k16, fp32 accumulate). Memory-bound on W: each weight byte is read once with 16-byte
// streaming loads; the 32 activation rows (bf16) are staged in shared memory per 256-wide K chunk.
//
// K-permutation trick: the reduction order inside one mma is free, so a thread loads 8 CONSECUTIVE k values
// (one 16-byte load) of its weight row and of its activation rows, and feeds words {2h, 2h+1} of them to the
// two k16 halves h = 0, 1 of a 32-wide k step. A and B use the same permutation, so the sum is unchanged.
//
// Two forms: gemm32_* (a fixed set of 16-row groups per block, split-K over grid.y; the named fallback where
// gemm32v4's 144 KB of shared memory does not fit, and the QKV / o GEMMs everywhere) and gemm32v4_* (a balanced grid
// of one block per SM, K split inside the block: the gate/up and down GEMMs on the H200).
//
// gemm32_*: GEMM_WARPS warps; warp w owns 16 weight rows (two n8 tiles) x all 32 tokens (two m16 tiles).
// grid.x = ceil(N / (16 * GEMM_WARPS)), grid.y = K splits of length ks_len (multiple of 32).
#include "gemm_core.cuh"  // GEMM_* / G4_* constants, mma_k32, g4_reduce

template <int WPB, int MODE>
__device__ __forceinline__ void gemm32_body(const bf16_t* __restrict__ A, int lda, const bf16_t* __restrict__ W,
                                            int N, int K, int ks_len, float* __restrict__ C, int ldc,
                                            bf16_t* __restrict__ act) {
    __shared__ uint4 sAb[2 * 32 * GEMM_SA];  // two activation chunks (double buffer)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nw = blockIdx.x * (WPB * 16) + warp * 16;
    const bool active = nw < N;  // N is a multiple of 16
    const int kbeg = blockIdx.y * ks_len;
    const int kend = min(K, kbeg + ks_len);
    const int nrow = active ? nw + g : 0;
    const bf16_t* W0 = W + (size_t)nrow * K + t * 8;
    const bf16_t* W1 = W0 + (size_t)8 * K;
    // a chunk's weight loads (16-byte streaming loads, all in flight before any is used)
    uint4 b[GEMM_KC / 32][2];
    const auto load_w = [&](int kc, int clen) { gemm32_load_w(b, W0, W1, kc, clen, active); };
    // the first chunk's weights do not depend on the previous kernel: requested before the PDL wait
    if (kbeg < kend) load_w(kbeg, min(GEMM_KC, kend - kbeg));
    pdl_trigger(FAM_GEMM);
    pdl_wait(FAM_GEMM);
    if (kbeg >= kend) return;  // uniform over the block
    float acc[2][2][4] = {};

    int buf = 0;
    for (int kc = kbeg; kc < kend; kc += GEMM_KC, buf ^= 1) {
        const int clen = min(GEMM_KC, kend - kc);  // multiple of 32
        if (kc != kbeg) load_w(kc, clen);
        // the chunk's activation words go straight to shared memory (cp.async, no registers), into the buffer
        // that the chunk before last used: every warp passed this iteration's predecessor's barrier after its
        // last read of it. One barrier per chunk; the copies overlap the weight loads.
        uint4* sA = sAb + buf * (32 * GEMM_SA);
        const int nq = clen >> 3;
        for (int i = threadIdx.x; i < 32 * nq; i += 32 * WPB) {
            const int r = i / nq, q = i - r * nq;
            cp_async16(sA + r * GEMM_SA + q, A + (size_t)r * lda + kc + q * 8);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        if (active) {
#pragma unroll
            for (int u = 0; u < GEMM_KC / 32; ++u) {
                if (32 * u < clen) mma_k32(acc, b[u], sA, GEMM_SA, 4 * u + t, g);
            }
        }
    }
    if (!active) return;
    if (MODE == GEMM_ATOMIC) {
        gemm32_add_tile(C, ldc, nw, g, t, acc);
    } else {
        // rows are interleaved at load: tile j=0 = gate rows 8b..8b+7, tile j=1 = the matching up rows
        const int I = N >> 1;
        const int col = (nw >> 4) * 8 + 2 * t;
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
            const int r0 = mi * 16 + g;
            *reinterpret_cast<uint32_t*>(act + (size_t)r0 * I + col) =
                pack_bf16x2(silu(acc[mi][0][0]) * acc[mi][1][0], silu(acc[mi][0][1]) * acc[mi][1][1]);
            *reinterpret_cast<uint32_t*>(act + (size_t)(r0 + 8) * I + col) =
                pack_bf16x2(silu(acc[mi][0][2]) * acc[mi][1][2], silu(acc[mi][0][3]) * acc[mi][1][3]);
        }
    }
}

// C[32][ldc] += A * W^T (split-K over grid.y; C pre-initialised: bias, or the residual stream itself)
extern "C" __global__ void __launch_bounds__(32 * GEMM_WARPS, 2) gemm32_atomic(const bf16_t* A, int lda,
        const bf16_t* W, int N, int K, int ks_len, float* C, int ldc) {
    gemm32_body<GEMM_WARPS, GEMM_ATOMIC>(A, lda, W, N, K, ks_len, C, ldc, nullptr);
}
// act[32][N/2] = silu(gate) * up, W = interleaved gate/up rows (blocks of 8), full K (grid.y == 1)
extern "C" __global__ void __launch_bounds__(32 * GEMM_WARPS, 2) gemm32_silu(const bf16_t* A, int lda,
        const bf16_t* W, int N, int K, bf16_t* act) {
    gemm32_body<GEMM_WARPS, GEMM_SILU>(A, lda, W, N, K, K, nullptr, 0, act);
}

struct G4Buf {
    uint4 w[G4_U][2];
};

// item rg: weight rows rg*16 + g and rg*16 + g + 8, this warp's steps (k0 = first column of its first step)
__device__ __forceinline__ void g4_load(G4Buf& B, const bf16_t* __restrict__ W, int K, int rg, int k0, int nsw,
                                        bool ok) {
    const int g = (threadIdx.x & 31) >> 2;
    const bf16_t* p0 = W + (size_t)(rg * 16 + g) * K + k0;
    const bf16_t* p1 = p0 + (size_t)8 * K;
#pragma unroll
    for (int u = 0; u < G4_U; ++u)
        if (ok && u < nsw) {
            B.w[u][0] = ldg_stream16(p0 + 32 * G4_NW * u);
            B.w[u][1] = ldg_stream16(p1 + 32 * G4_NW * u);
        }
}

__device__ __forceinline__ void g4_mma(float (&acc)[2][2][4], const G4Buf& B, const uint4* sA, int nsw) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][j][e] = 0.f;
#pragma unroll
    for (int u = 0; u < G4_U; ++u) {
        if (u < nsw) mma_k32(acc, B.w[u], sA, G4_SA, 4 * u + t, g);
    }
}

template <int MODE>
__device__ __forceinline__ void gemm32v4_body(const bf16_t* __restrict__ A, int lda, const bf16_t* __restrict__ W,
                                              int N, int K, float* __restrict__ C, int ldc,
                                              bf16_t* __restrict__ act) {
    extern __shared__ uint4 g4_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
    const int nrg = N >> 4, nsteps = K >> 5;
    const int rper = nrg / gridDim.x, rrem = nrg - rper * gridDim.x;
    const int rg_beg = blockIdx.x * rper + min((int)blockIdx.x, rrem);
    const int rg_end = rg_beg + rper + ((int)blockIdx.x < rrem ? 1 : 0);
    const int sper = nsteps / gridDim.y, srem = nsteps - sper * gridDim.y;
    const int st_beg = blockIdx.y * sper + min((int)blockIdx.y, srem);
    const int st_n = sper + ((int)blockIdx.y < srem ? 1 : 0);
    if (rg_beg >= rg_end || st_n == 0) return;  // uniform over the block
    const int nsw = warp < st_n ? (st_n - warp + G4_NW - 1) / G4_NW : 0;  // this warp's steps (<= G4_U)
    const int k0 = 32 * (st_beg + warp) + 8 * t;
    G4Buf bA, bB;
    // the first two items' weights do not depend on the previous kernel: requested before the PDL wait
    g4_load(bA, W, K, rg_beg, k0, nsw, true);
    g4_load(bB, W, K, rg_beg + 1, k0, nsw, rg_beg + 1 < rg_end);
    pdl_trigger(FAM_GEMM);
    pdl_wait(FAM_GEMM);
    // this warp's activation columns: rows 0..31 x words 4u + c (c = 0..3) of its steps u
    uint4* sA = g4_smem + warp * (32 * G4_SA);
    for (int i = lane; i < 32 * 4 * nsw; i += 32) {
        const int r = i / (4 * nsw), rest = i - r * 4 * nsw, u = rest >> 2, c = rest & 3;
        cp_async16(sA + r * G4_SA + 4 * u + c, A + (size_t)r * lda + 32 * (st_beg + warp + G4_NW * u) + 8 * c);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
    float* red = reinterpret_cast<float*>(g4_smem + G4_NW * 32 * G4_SA);
    const bool atomic = gridDim.y > 1;
    float acc[2][2][4];
    int par = 0;
    for (int rg = rg_beg; rg < rg_end; rg += 2) {
        g4_mma(acc, bA, sA, nsw);
        if (rg + 2 < rg_end) g4_load(bA, W, K, rg + 2, k0, nsw, true);
        g4_reduce<MODE>(acc, red + par * (G4_NW * 16 * 32), rg, C, ldc, atomic, act, N >> 1);
        par ^= 1;
        if (rg + 1 >= rg_end) break;
        g4_mma(acc, bB, sA, nsw);
        if (rg + 3 < rg_end) g4_load(bB, W, K, rg + 3, k0, nsw, true);
        g4_reduce<MODE>(acc, red + par * (G4_NW * 16 * 32), rg + 1, C, ldc, atomic, act, N >> 1);
        par ^= 1;
    }
}

// C[32][ldc] (+)= A W^T; grid = (row-group ranges, K splits); dynamic shared memory G4_SMEM
extern "C" __global__ void __launch_bounds__(256, 1) gemm32v4_atomic(const bf16_t* A, int lda, const bf16_t* W,
                                                                     int N, int K, float* C, int ldc) {
    gemm32v4_body<GEMM_ATOMIC>(A, lda, W, N, K, C, ldc, nullptr);
}
// act[32][N/2] = silu(gate) * up (interleaved rows as gemm32_silu); grid = (row-group ranges, 1)
extern "C" __global__ void __launch_bounds__(256, 1) gemm32v4_silu(const bf16_t* A, int lda, const bf16_t* W, int N,
                                                                   int K, bf16_t* act) {
    gemm32v4_body<GEMM_SILU>(A, lda, W, N, K, nullptr, 0, act);
}

// What the host reads from the compiled module (engine/cuda/kernels.py LAUNCH_CONSTANTS), in this order.
__constant__ int vla_launch[4] = {GEMM_WARPS, G4_NW, G4_U, G4_SMEM};
