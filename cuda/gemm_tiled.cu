// A GEMM for many rows (the fleet's batched prefill: 32 x robots rows, issue 24; the parallel pass of more than
// one 32-row tile, issue 22): C[M][ldc] += A[M][lda] W^T
// with BOTH operands staged in shared memory, as a textbook tensor-core GEMM. Why it exists: the fleet's
// gemm32t_atomic (fleet.cu) keeps a block's weights in registers and loops over the 32-row tiles, so every tile
// pays a barrier, a staging round trip and a split-K partial sum added by atomics per 256 columns: measured, the
// 8-robot prefill took 11.1 of a 28.6 ms batch on the H200, one robot's 2.3 (docs/KERNEL_NOTES_MANY_ROWS.md).
// Here a block owns a BM x 128 tile of C over its whole K range (accumulators in registers), so a weight element is
// read from DRAM once per BM rows and added into C once per K split, not once per 256 columns and tile.
//
// Block: 8 warps as 2 (rows) x 4 (columns), a warp BM/2 x 32 of C (mma.m16n8k16: BM/32 x 4 tiles of 16 x 8).
// K steps of GT_BK columns, GT_STAGES of them in flight (cp.async; one barrier per step); the operands' rows are
// 2 GT_BK + 16 bytes apart in shared memory (an odd multiple of 16: ldmatrix's eight 16-byte rows land in distinct
// bank quads). grid = (ceil(M / BM), ceil(N / 128), K splits of ks_len columns, a multiple of GT_BK): the row
// blocks of one column block are adjacent, so they run together and read its weights from DRAM once (a gate/up
// weight matrix is larger than the L2); dynamic shared memory GT_SMEM128 / GT_SMEM64. Rows >= M are neither read
// (their addresses clamped) nor written. With one K split C is added to plainly (a block owns its elements); with
// more, by fp32 atomics. The _silu kernels (one K split) write
// silu(gate) * up in bf16 instead, as gemm32_silu: no fp32 gate/up rows, no memset, no separate SiLU pass.
#include "common.cuh"

#define GT_BN 128
// K step and stages in flight (measuring knobs: VLA_CUDA_DEFINES="GT_BK=.. GT_STAGES=.."). 64 x 3 (a step reads 128
// contiguous bytes of each weight row) measured best on sm_90 (session 34, H100: a 64-row layer's GEMMs 79.7 -> 67.0
// us, 256 rows 148 -> 139; 128 x 2: no better). GPUs of 99 KB of shared memory per block (sm_86, sm_89) keep 32 x 4:
// 64 x 3's 128-row tile needs 108 KB there.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 890)
#define GT_SMALL_SMEM 1
#endif
#ifndef GT_BK
#ifdef GT_SMALL_SMEM
#define GT_BK 32
#else
#define GT_BK 64
#endif
#endif
#ifndef GT_STAGES
#ifdef GT_SMALL_SMEM
#define GT_STAGES 4
#else
#define GT_STAGES 3
#endif
#endif
#define GT_RS (GT_BK + 8)  // bf16 per staged row
#define GT_SMEM128 (GT_STAGES * (128 + GT_BN) * GT_RS * 2)  // dynamic shared memory of the 128-row block tile
#define GT_SMEM64 (GT_STAGES * (64 + GT_BN) * GT_RS * 2)    // ... and of the 64-row one

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

enum { GT_ATOMIC = 0, GT_SILU = 1 };

template <int BM, int MODE>
__device__ __forceinline__ void gemm_tiled_body(const bf16_t* __restrict__ A, int lda, const bf16_t* __restrict__ W,
                                                int N, int K, int ks_len, float* __restrict__ C, int ldc, int M,
                                                bf16_t* __restrict__ act) {
    constexpr int MI = BM / 32;  // 16-row mma tiles per warp (a warp: BM / 2 rows)
    extern __shared__ __align__(16) bf16_t gt_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;  // this warp's rows wm * BM / 2, columns wn * 32 of the block tile
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * GT_BN;
    const int kbeg = blockIdx.z * ks_len, kend = min(K, kbeg + ks_len);
    const int nk = (kend - kbeg) / GT_BK;
    bf16_t* sA = gt_smem;                                // [GT_STAGES][BM][GT_RS]
    bf16_t* sW = gt_smem + GT_STAGES * BM * GT_RS;       // [GT_STAGES][GT_BN][GT_RS]
    // step kt's 16-byte pieces (PR a row) of n rows of X from row r0 (clamped to row rmax) into a stage's buffer
    constexpr int PR = GT_BK / 8;
    const auto load = [&](bf16_t* dst, const bf16_t* X, int ld, int n, int r0, int rmax, int kt) {
        const int k = kbeg + kt * GT_BK;
#pragma unroll
        for (int i = tid; i < n * PR; i += 256) {
            const int r = i / PR, c = i % PR;
            cp_async16(dst + r * GT_RS + 8 * c, X + (size_t)min(r0 + r, rmax) * ld + k + 8 * c);
        }
    };
    const auto load_w = [&](int stage, int kt) { load(sW + stage * GT_BN * GT_RS, W, K, GT_BN, n0, N - 1, kt); };
    const auto load_a = [&](int stage, int kt) { load(sA + stage * BM * GT_RS, A, lda, BM, m0, M - 1, kt); };
    // the weights do not depend on the previous kernel: the first stages' are requested before the PDL wait (one
    // commit group), then each stage's activations a group of its own; from then on a group per step. Step kt's
    // data is in the first kt + 2 groups, so waiting until at most GT_STAGES - 2 are pending is always enough.
    for (int s = 0; s < GT_STAGES - 1; ++s)
        if (s < nk) load_w(s, s);
    cp_async_commit();
    pdl_trigger(FAM_GEMM);
    pdl_wait(FAM_GEMM);
    for (int s = 0; s < GT_STAGES - 1; ++s) {
        if (s < nk) load_a(s, s);
        cp_async_commit();
    }
    float acc[MI][4][4] = {};
    // ldmatrix lanes: A x4 = rows 0-15 x k halves (lane & 15, lane >> 4); W x4 = two 8-row blocks x k halves
    const int a_row = wm * (BM / 2) + (lane & 15), a_col = 8 * (lane >> 4);
    const int w_row = wn * 32 + (lane & 7) + ((lane >> 4) << 3), w_col = 8 * ((lane >> 3) & 1);
    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<GT_STAGES - 2>();
        __syncthreads();  // step kt landed for every thread; every warp is past step kt - 1, whose buffer is refilled
        const int nxt = kt + GT_STAGES - 1;
        if (nxt < nk) {
            load_w(nxt % GT_STAGES, nxt);
            load_a(nxt % GT_STAGES, nxt);
        }
        cp_async_commit();
        const bf16_t* a = sA + (kt % GT_STAGES) * BM * GT_RS;
        const bf16_t* w = sW + (kt % GT_STAGES) * GT_BN * GT_RS;
#pragma unroll
        for (int h = 0; h < GT_BK / 16; ++h) {  // the step's k16 slices
            uint32_t af[MI][4], bf[2][4];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(af[mi], a + (a_row + 16 * mi) * GT_RS + 16 * h + a_col);
#pragma unroll
            for (int nj = 0; nj < 2; ++nj) ldmatrix_x4(bf[nj], w + (w_row + 16 * nj) * GT_RS + 16 * h + w_col);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int j = 0; j < 4; ++j)  // 8-column tile j: bf[j >> 1] words 2 (j & 1), 2 (j & 1) + 1
                    mma_bf16_16816(acc[mi][j], af[mi][0], af[mi][1], af[mi][2], af[mi][3], bf[j >> 1][2 * (j & 1)],
                                   bf[j >> 1][2 * (j & 1) + 1]);
        }
    }
    cp_async_wait<0>();  // no copy outlives the block
    const int g = lane >> 2, t = lane & 3;
    if (MODE == GT_SILU) {
        // act[M][N / 2] = silu(gate) * up: the weight rows are interleaved in groups of 8 gate rows then their 8 up
        // rows (engine interleave_gate_up), so 8-column tiles j = 0, 1 (and 2, 3) of a warp are one group's gate and
        // up, lane for lane: intermediate column 8 (group) + 2t, + 1. One K split (the host's grid).
        const int I = N >> 1;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int jp = 0; jp < 2; ++jp) {
                const int colg = n0 + wn * 32 + 16 * jp;  // the group's first weight row
                if (colg >= N) continue;
                const float* ga = acc[mi][2 * jp];
                const float* ua = acc[mi][2 * jp + 1];
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int row = m0 + wm * (BM / 2) + 16 * mi + g + 8 * hr;
                    if (row >= M) continue;
                    *reinterpret_cast<uint32_t*>(act + (size_t)row * I + 8 * (colg >> 4) + 2 * t) =
                        pack_bf16x2(silu(ga[2 * hr]) * ua[2 * hr], silu(ga[2 * hr + 1]) * ua[2 * hr + 1]);
                }
            }
        return;
    }
    const bool atomic = gridDim.z > 1;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = n0 + wn * 32 + 8 * j + 2 * t;
            if (col >= N) continue;  // N is even: both columns or neither
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int row = m0 + wm * (BM / 2) + 16 * mi + g + 8 * hr;
                if (row >= M) continue;
                float* c = C + (size_t)row * ldc + col;
                const float v0 = acc[mi][j][2 * hr], v1 = acc[mi][j][2 * hr + 1];
                if (atomic) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                    atomicAdd(reinterpret_cast<float2*>(c), make_float2(v0, v1));
#else
                    atomicAdd(c, v0);
                    atomicAdd(c + 1, v1);
#endif
                } else {
                    float2 o = *reinterpret_cast<float2*>(c);
                    o.x += v0;
                    o.y += v1;
                    *reinterpret_cast<float2*>(c) = o;
                }
            }
        }
}

// C[M][ldc] += A W^T (gemm32t_atomic's arguments; tiles: M = 32 tiles rows)
extern "C" __global__ void __launch_bounds__(256, 2) gemm_tiled128_atomic(const bf16_t* __restrict__ A, int lda,
        const bf16_t* __restrict__ W, int N, int K, int ks_len, float* __restrict__ C, int ldc, int tiles) {
    gemm_tiled_body<128, GT_ATOMIC>(A, lda, W, N, K, ks_len, C, ldc, 32 * tiles, nullptr);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemm_tiled64_atomic(const bf16_t* __restrict__ A, int lda,
        const bf16_t* __restrict__ W, int N, int K, int ks_len, float* __restrict__ C, int ldc, int tiles) {
    gemm_tiled_body<64, GT_ATOMIC>(A, lda, W, N, K, ks_len, C, ldc, 32 * tiles, nullptr);
}
// act[M][N / 2] = silu(gate) * up of the interleaved gate/up weights (as gemm32_silu); grid z = 1
extern "C" __global__ void __launch_bounds__(256, 2) gemm_tiled128_silu(const bf16_t* __restrict__ A, int lda,
        const bf16_t* __restrict__ W, int N, int K, bf16_t* __restrict__ act, int tiles) {
    gemm_tiled_body<128, GT_SILU>(A, lda, W, N, K, K, nullptr, 0, 32 * tiles, act);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemm_tiled64_silu(const bf16_t* __restrict__ A, int lda,
        const bf16_t* __restrict__ W, int N, int K, bf16_t* __restrict__ act, int tiles) {
    gemm_tiled_body<64, GT_SILU>(A, lda, W, N, K, K, nullptr, 0, 32 * tiles, act);
}

// What the host reads from the compiled module (engine/cuda/kernels.py LAUNCH_CONSTANTS), in this order.
__constant__ int vla_launch[4] = {GT_BN, GT_SMEM128, GT_SMEM64, GT_BK};
