// Skinny GEMMs of the 32-token prefill over quantised weights (issue 23): the gemm32_* and gemm32v4_* forms of
// gemm_skinny.cu (its header says how they work; the bf16 kernels stay there, exactly the measured code), with a
// lane's 8 consecutive k values of a weight row loaded as codes (8 int8 / fp8 bytes, 4 int4 bytes) and turned into
// the 8 bf16 words the mma takes: bf16(w) with w dequantised in fp32 (cuda/wtype.cuh). Same grids as bf16.
#include "gemm_core.cuh"
#include "wtype.cuh"

template <int WPB, int MODE, typename WT>
__device__ __forceinline__ void gemm32_body(const bf16_t* __restrict__ A, int lda, const void* __restrict__ W,
                                            int N, int K, int ks_len, float* __restrict__ C, int ldc,
                                            bf16_t* __restrict__ act, const float* __restrict__ scales = nullptr,
                                            const uint8_t* __restrict__ zeros = nullptr) {
    __shared__ uint4 sAb[2 * 32 * GEMM_SA];  // two activation chunks (double buffer)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nw = blockIdx.x * (WPB * 16) + warp * 16;
    const bool active = nw < N;  // N is a multiple of 16
    const int kbeg = blockIdx.y * ks_len;
    const int kend = min(K, kbeg + ks_len);
    const int nrow = active ? nw + g : 0;
    const char* W0 = wrow<WT>(W, nrow, K, t * 8);
    const char* W1 = wrow<WT>(W, nrow + 8, K, t * 8);
    typename WT::RowQ q0, q1;  // the two rows' quantisation parameters (wtype.cuh; none for bf16)
    if (active) {
        q0.init(scales, zeros, nrow, K, 0);
        q1.init(scales, zeros, nrow + 8, K, 0);
    }
    // a chunk's weight loads and their columns' quantisation parameters (int4: the group's scale and zero point;
    // nothing for the others), all in flight before any is used (read in the mma loop, each step's pair was a round
    // trip of its own)
    typename WT::raw_t b[GEMM_KC / 32][2];
    typename WT::Q bq[GEMM_KC / 32][2];
    auto load_w = [&](int kc, int clen) {
#pragma unroll
        for (int u = 0; u < GEMM_KC / 32; ++u) {
            if (active && 32 * u < clen) {
                b[u][0] = WT::load_raw(W0 + (size_t)(kc + 32 * u) * WT::BITS / 8);
                b[u][1] = WT::load_raw(W1 + (size_t)(kc + 32 * u) * WT::BITS / 8);
                bq[u][0] = WT::at(q0, kc + 32 * u + 8 * t);
                bq[u][1] = WT::at(q1, kc + 32 * u + 8 * t);
            }
        }
    };
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
                if (32 * u < clen) {
                    const uint4 bb[2] = {WT::to_bf16x8(b[u][0], q0, bq[u][0]), WT::to_bf16x8(b[u][1], q1, bq[u][1])};
                    mma_k32(acc, bb, sA, GEMM_SA, 4 * u + t, g);
                }
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

// gemm32v4's unit of K for a weight type: its k32 steps (SPU = 1), or for int4 with GEMM_I4_PAIR pairs of them
// (SPU = 2): a lane then loads 16 consecutive k values (8 bytes) where one step's load is 8 (4 bytes), so a row's
// 64 columns are one 32-byte sector of one request instead of two half-sector requests from two warps, and a unit
// needs one group's scale / zero point (they are 64-aligned inside a group of 128) instead of two. The lane's sub-step
// v of a unit takes k values 16 t + 8 v of it; the staged activation words follow (slot 4 v + t of the unit's 8, so
// that mma_k32's reads stay conflict-free). A measuring knob (docs/KERNEL_NOTES.md, session 30); K % 64 == 0.
#ifndef GEMM_I4_PAIR
#define GEMM_I4_PAIR 0
#endif
template <bool PAIR, typename RAW> struct G4Raw { typedef RAW type; };  // (no <type_traits>: nvrtc, cpp)
template <typename RAW> struct G4Raw<true, RAW> { typedef uint2 type; };
template <typename WT>
struct G4Unit {
    static constexpr int SPU = (WT::BITS == 4 && GEMM_I4_PAIR) ? 2 : 1;  // k32 steps per unit
    typedef typename G4Raw<SPU == 2, typename WT::raw_t>::type raw_t;
    __device__ static __forceinline__ raw_t load(const char* p) {
        if constexpr (SPU == 2) return ldg_stream8(p);
        else return WT::load_raw(p);
    }
    // the 8 k values of sub-step v (v < SPU) of a lane's unit load
    __device__ static __forceinline__ typename WT::raw_t sub(const raw_t& r, int v) {
        if constexpr (SPU == 2) return v ? r.y : r.x;
        else return r;
    }
};

template <typename WT>
struct G4Buf {
    typename G4Unit<WT>::raw_t w[G4_U][2];  // (only the first G4_U / SPU used)
    typename WT::RowQ rq[2];   // the two rows' quantisation parameters (none for bf16)
    typename WT::Q q[G4_U][2];  // ... and those of each unit's columns (int4: its group; empty for the others)
};

// item rg: weight rows rg*16 + g and rg*16 + g + 8, this warp's units (k0 = this lane's first column of its first unit)
template <typename WT>
__device__ __forceinline__ void g4_load(G4Buf<WT>& B, const void* __restrict__ W, int K, int rg, int k0, int nsw,
                                        bool ok, const float* __restrict__ scales, const uint8_t* __restrict__ zeros) {
    constexpr int UW = 32 * G4Unit<WT>::SPU;  // columns per unit
    const int g = (threadIdx.x & 31) >> 2;
    const char* p0 = wrow<WT>(W, rg * 16 + g, K, k0);
    const char* p1 = wrow<WT>(W, rg * 16 + g + 8, K, k0);
    if (ok) {
        B.rq[0].init(scales, zeros, rg * 16 + g, K, 0);
        B.rq[1].init(scales, zeros, rg * 16 + g + 8, K, 0);
    }
#pragma unroll
    for (int u = 0; u < G4_U / G4Unit<WT>::SPU; ++u)
        if (ok && u < nsw) {
            B.w[u][0] = G4Unit<WT>::load(p0 + (size_t)(UW * G4_NW * u) * WT::BITS / 8);
            B.w[u][1] = G4Unit<WT>::load(p1 + (size_t)(UW * G4_NW * u) * WT::BITS / 8);
            B.q[u][0] = WT::at(B.rq[0], k0 + UW * G4_NW * u);
            B.q[u][1] = WT::at(B.rq[1], k0 + UW * G4_NW * u);
        }
}

template <typename WT>
__device__ __forceinline__ void g4_mma(float (&acc)[2][2][4], const G4Buf<WT>& B, const uint4* sA, int nsw) {
    constexpr int SPU = G4Unit<WT>::SPU;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][j][e] = 0.f;
#pragma unroll
    for (int u = 0; u < G4_U / SPU; ++u) {
        if (u < nsw) {
#pragma unroll
            for (int v = 0; v < SPU; ++v) {
                const uint4 bb[2] = {WT::to_bf16x8(G4Unit<WT>::sub(B.w[u][0], v), B.rq[0], B.q[u][0]),
                                     WT::to_bf16x8(G4Unit<WT>::sub(B.w[u][1], v), B.rq[1], B.q[u][1])};
                mma_k32(acc, bb, sA, G4_SA, 4 * (SPU * u + v) + t, g);
            }
        }
    }
}

template <int MODE, typename WT>
__device__ __forceinline__ void gemm32v4_body(const bf16_t* __restrict__ A, int lda, const void* __restrict__ W,
                                              int N, int K, float* __restrict__ C, int ldc,
                                              bf16_t* __restrict__ act, const float* __restrict__ scales = nullptr,
                                              const uint8_t* __restrict__ zeros = nullptr) {
    constexpr int SPU = G4Unit<WT>::SPU, UW = 32 * SPU;  // k32 steps and columns per unit
    extern __shared__ uint4 g4_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
    const int nrg = N >> 4, nunits = K >> (4 + SPU);
    const int rper = nrg / gridDim.x, rrem = nrg - rper * gridDim.x;
    const int rg_beg = blockIdx.x * rper + min((int)blockIdx.x, rrem);
    const int rg_end = rg_beg + rper + ((int)blockIdx.x < rrem ? 1 : 0);
    const int sper = nunits / gridDim.y, srem = nunits - sper * gridDim.y;
    const int st_beg = blockIdx.y * sper + min((int)blockIdx.y, srem);
    const int st_n = sper + ((int)blockIdx.y < srem ? 1 : 0);
    if (rg_beg >= rg_end || st_n == 0) return;  // uniform over the block
    const int nsw = warp < st_n ? (st_n - warp + G4_NW - 1) / G4_NW : 0;  // this warp's units (<= G4_U / SPU)
    const int k0 = UW * (st_beg + warp) + 8 * SPU * t;
    G4Buf<WT> bA, bB;
    // the first two items' weights do not depend on the previous kernel: requested before the PDL wait
    g4_load(bA, W, K, rg_beg, k0, nsw, true, scales, zeros);
    g4_load(bB, W, K, rg_beg + 1, k0, nsw, rg_beg + 1 < rg_end, scales, zeros);
    pdl_trigger(FAM_GEMM);
    pdl_wait(FAM_GEMM);
    // this warp's activation columns: rows 0..31 x the 4 SPU words of each of its units u; the unit's word c (k
    // values 8c..8c+7 of it) goes to slot 4 (c % SPU) + c / SPU, where lane t's sub-step c % SPU reads it
    uint4* sA = g4_smem + warp * (32 * G4_SA);
    for (int i = lane; i < 32 * 4 * SPU * nsw; i += 32) {
        const int r = i / (4 * SPU * nsw), rest = i - r * 4 * SPU * nsw;
        const int u = rest >> (1 + SPU), c = rest & (4 * SPU - 1);
        cp_async16(sA + r * G4_SA + 4 * SPU * u + 4 * (c & (SPU - 1)) + (c >> (SPU - 1)),
                   A + (size_t)r * lda + UW * (st_beg + warp + G4_NW * u) + 8 * c);
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
        if (rg + 2 < rg_end) g4_load(bA, W, K, rg + 2, k0, nsw, true, scales, zeros);
        g4_reduce<MODE>(acc, red + par * (G4_NW * 16 * 32), rg, C, ldc, atomic, act, N >> 1);
        par ^= 1;
        if (rg + 1 >= rg_end) break;
        g4_mma(acc, bB, sA, nsw);
        if (rg + 3 < rg_end) g4_load(bB, W, K, rg + 3, k0, nsw, true, scales, zeros);
        g4_reduce<MODE>(acc, red + par * (G4_NW * 16 * 32), rg + 1, C, ldc, atomic, act, N >> 1);
        par ^= 1;
    }
}

// The quantised twins (engine/cuda/plan.py KERNEL_SUFFIX): the same arguments with the weights as codes, then the
// scales (float32: per row for int8 / fp8, per row and group for int4) and the int4 zero points (uint8; null else).
#define GEMM_QUANTISED(SUF, WT)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * GEMM_WARPS, 2) gemm32_atomic##SUF(const bf16_t* A,          \
            int lda, const void* W, int N, int K, int ks_len, float* C, int ldc, const float* scales,               \
            const uint8_t* zeros) {                                                                                  \
        gemm32_body<GEMM_WARPS, GEMM_ATOMIC, WT>(A, lda, W, N, K, ks_len, C, ldc, nullptr, scales, zeros);          \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(32 * GEMM_WARPS, 2) gemm32_silu##SUF(const bf16_t* A, int lda,   \
            const void* W, int N, int K, bf16_t* act, const float* scales, const uint8_t* zeros) {                   \
        gemm32_body<GEMM_WARPS, GEMM_SILU, WT>(A, lda, W, N, K, K, nullptr, 0, act, scales, zeros);                 \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 1) gemm32v4_atomic##SUF(const bf16_t* A, int lda,           \
            const void* W, int N, int K, float* C, int ldc, const float* scales, const uint8_t* zeros) {             \
        gemm32v4_body<GEMM_ATOMIC, WT>(A, lda, W, N, K, C, ldc, nullptr, scales, zeros);                            \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 1) gemm32v4_silu##SUF(const bf16_t* A, int lda,             \
            const void* W, int N, int K, bf16_t* act, const float* scales, const uint8_t* zeros) {                   \
        gemm32v4_body<GEMM_SILU, WT>(A, lda, W, N, K, nullptr, 0, act, scales, zeros);                              \
    }
GEMM_QUANTISED(_i8, WInt8)
GEMM_QUANTISED(_f8, WFp8)
GEMM_QUANTISED(_i4, WInt4)

