// The kernels only the batched fleet pass needs (issue 24; engine/cuda/fleet.py): one edge GPU serving N robots
// reads every weight ONCE per pass for all of them. A pass's rows are every member's rows stacked (a frame's
// tokens_per_frame rows per robot for the prefill, one row per robot for a decode step), in tiles of 32.
//
// gemm32t_atomic: gemm32_atomic (gemm_skinny.cu) over `tiles` 32-row tiles: a block loads its weight chunk into
// registers once (before the PDL wait, as gemm32_atomic) and applies it to every tile in turn: the tile's activation
// chunk staged in shared memory (double buffer, one barrier per tile), the mma, the tile's partial sums added into
// C atomically. The weights are read once per pass however many robots; the activations (L2-resident) once per tile.
// The gate/up GEMM runs here too (into a zeroed fp32 buffer, then silu_rows): gemm32_silu's epilogue needs the
// whole K of one tile in registers, which a block looping over tiles cannot keep.
#include "gemm_core.cuh"  // GEMM_* constants, mma_k32

// C[tiles * 32][ldc] += A[tiles * 32][lda] * W^T; grid = (ceil(N / (16 GEMM_WARPS)), K splits of ks_len)
extern "C" __global__ void __launch_bounds__(32 * GEMM_WARPS, 2) gemm32t_atomic(const bf16_t* __restrict__ A,
        int lda, const bf16_t* __restrict__ W, int N, int K, int ks_len, float* __restrict__ C, int ldc, int tiles) {
    __shared__ uint4 sAb[2 * 32 * GEMM_SA];  // two activation chunks (double buffer)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nw = blockIdx.x * (GEMM_WARPS * 16) + warp * 16;
    const bool active = nw < N;  // N is a multiple of 16
    const int kbeg = blockIdx.y * ks_len;
    const int kend = min(K, kbeg + ks_len);
    const int nrow = active ? nw + g : 0;
    const bf16_t* W0 = W + (size_t)nrow * K + t * 8;
    const bf16_t* W1 = W0 + (size_t)8 * K;
    uint4 b[GEMM_KC / 32][2];
    const auto load_w = [&](int kc, int clen) { gemm32_load_w(b, W0, W1, kc, clen, active); };
    if (kbeg < kend) load_w(kbeg, min(GEMM_KC, kend - kbeg));  // weights: before the PDL wait
    pdl_trigger(FAM_GEMM);
    pdl_wait(FAM_GEMM);
    if (kbeg >= kend) return;  // uniform over the block
    // tile t + 1's activation chunk is staged while tile t's mma runs: one barrier per tile (tile t landed in every
    // thread's copies, and every warp is past tile t - 1's mma, whose buffer the next staging overwrites)
    const auto stage = [&](uint4* sA, int tile, int kc, int nq) {
        const bf16_t* At = A + (size_t)tile * 32 * lda;
        for (int i = threadIdx.x; i < 32 * nq; i += 32 * GEMM_WARPS) {
            const int r = i / nq, q = i - r * nq;
            cp_async16(sA + r * GEMM_SA + q, At + (size_t)r * lda + kc + q * 8);
        }
        cp_async_commit();
    };
    int buf = 0;
    for (int kc = kbeg; kc < kend; kc += GEMM_KC) {
        const int clen = min(GEMM_KC, kend - kc);  // multiple of 32
        const int nq = clen >> 3;
        if (kc != kbeg) load_w(kc, clen);
        stage(sAb + buf * (32 * GEMM_SA), 0, kc, nq);
        for (int tile = 0; tile < tiles; ++tile, buf ^= 1) {
            cp_async_wait<0>();
            __syncthreads();
            if (tile + 1 < tiles) stage(sAb + (buf ^ 1) * (32 * GEMM_SA), tile + 1, kc, nq);
            if (!active) continue;
            const uint4* sA = sAb + buf * (32 * GEMM_SA);
            float acc[2][2][4] = {};
#pragma unroll
            for (int u = 0; u < GEMM_KC / 32; ++u) {
                if (32 * u < clen) mma_k32(acc, b[u], sA, GEMM_SA, 4 * u + t, g);
            }
            float* Ct = C + (size_t)tile * 32 * ldc;
            gemm32_add_tile_v4(Ct, ldc, nw, g, t, acc);  // once per tile: a quarter of the atomics
        }
    }
}

// Decode passes of a few robots (rows <= GR_MAXM): the same C[rows][ldc] += A W^T as a GEMV over the weight rows:
// each warp streams two weight rows (16-byte loads, the next GR_U of each requested before the current ones are
// used) and dots them with every row of A, which the block holds in shared memory as fp32 (its K slice). The tensor
// cores' 32-row tiles would do 32 / rows times the work and, measured (gemm32t_atomic over one tile), ran a
// decode pass at ~3 ms where the single engine's GEMVs take ~1.1. grid = (ceil(N / (2 GR_WARPS)), K splits of
// ks_len, a multiple of 8 * 32); dynamic shared memory 4 * rows * ks_len.
#define GR_WARPS 8
#define GR_MAXM 16
#define GR_U 2
extern "C" __global__ void __launch_bounds__(32 * GR_WARPS) gemv_rows_atomic(const bf16_t* __restrict__ A, int lda,
        const bf16_t* __restrict__ W, int N, int K, int ks_len, float* __restrict__ C, int ldc, int rows) {
    extern __shared__ float4 gr_smem[];
    float* sA = reinterpret_cast<float*>(gr_smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n0 = (blockIdx.x * GR_WARPS + warp) * 2;
    const bool valid = n0 < N;  // N is even
    const int kbeg = blockIdx.y * ks_len;
    const int klen = min(ks_len, K - kbeg);
    const bf16_t* w0 = W + (size_t)(valid ? n0 : 0) * K + kbeg + lane * 8;
    const bf16_t* w1 = w0 + K;
    constexpr int SPAN = 32 * 8 * GR_U;  // columns one iteration of a warp covers
    uint4 wa[GR_U], wb[GR_U];
#pragma unroll
    for (int u = 0; u < GR_U; ++u)
        if (valid && 256 * u + lane * 8 < klen) { wa[u] = ldg_stream16(w0 + 256 * u); wb[u] = ldg_stream16(w1 + 256 * u); }
    pdl_trigger(FAM_GEMM);
    pdl_wait(FAM_GEMM);
    const int q8 = klen >> 3;  // 8-column words per row
    for (int i = threadIdx.x; i < rows * q8; i += blockDim.x) {
        const int m = i / q8, q = i - m * q8;
        const uint4 v = *reinterpret_cast<const uint4*>(A + (size_t)m * lda + kbeg + q * 8);
        float4* d = reinterpret_cast<float4*>(sA + (size_t)m * ks_len + q * 8);
        d[0] = make_float4(bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y));
        d[1] = make_float4(bf16_lo(v.z), bf16_hi(v.z), bf16_lo(v.w), bf16_hi(v.w));
    }
    __syncthreads();
    if (!valid) return;
    float acc0[GR_MAXM], acc1[GR_MAXM];
#pragma unroll
    for (int m = 0; m < GR_MAXM; ++m) acc0[m] = acc1[m] = 0.f;
    for (int kk = 0; kk < klen; kk += SPAN) {
        uint4 na[GR_U], nb[GR_U];
#pragma unroll
        for (int u = 0; u < GR_U; ++u)
            if (kk + SPAN + 256 * u + lane * 8 < klen) {
                na[u] = ldg_stream16(w0 + kk + SPAN + 256 * u);
                nb[u] = ldg_stream16(w1 + kk + SPAN + 256 * u);
            }
#pragma unroll
        for (int u = 0; u < GR_U; ++u) {
            const int c = kk + 256 * u + lane * 8;
            if (c < klen) {
#pragma unroll
                for (int m = 0; m < GR_MAXM; ++m) {
                    if (m < rows) {
                        const float4* a = reinterpret_cast<const float4*>(sA + (size_t)m * ks_len + c);
                        const float4 a0 = a[0], a1 = a[1];
                        acc0[m] += dot8_bf16(wa[u], a0, a1);
                        acc1[m] += dot8_bf16(wb[u], a0, a1);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < GR_U; ++u) { wa[u] = na[u]; wb[u] = nb[u]; }
    }
#pragma unroll
    for (int m = 0; m < GR_MAXM; ++m) {
        if (m < rows) {
            const float s0 = warp_sum(acc0[m]), s1 = warp_sum(acc1[m]);
            if (lane == 0) {
                atomicAdd(C + (size_t)m * ldc + n0, s0);
                atomicAdd(C + (size_t)m * ldc + n0 + 1, s1);
            }
        }
    }
}

// gemv_rows_mma: gemv_rows_atomic's C[rows][ldc] += A W^T (same arguments, rows <= GR_MAXM) on the tensor cores,
// gemm32's operands swapped: the WEIGHTS are the m16 side of mma.m16n8k16 (a warp owns weight rows nw .. nw + 15)
// and the robots the n8 side (one n8 tile for <= 8 rows, two for <= 16), so each bf16 weight feeds the mma as
// loaded, with no per-robot unpacking and no fp32 dot products (gemv_rows_atomic at 8 rows: ~1.1 TB/s, bound by
// its FMAs and shared-memory reads). The K order inside a k32 step is permuted, identically for both operands
// (a dot product does not care): lane (g, t) holds the 16-byte words of physical columns [32u + 8t, +8) of weight
// rows g and g + 8 (gemm32_load_w), and in k16 half h the words {2h, 2h + 1} of them are its A fragment's
// k {2t, 2t + 1} and {2t + 8, 2t + 9}; its B fragment (robot g of the tile) is the same two words of that robot's
// row, the word mma_k32 reads. Memory-level parallelism as gemm32: a warp requests a whole GEMM_KC chunk of its
// two row groups (8 KiB) before using any of it, the first before the PDL wait. Measured slower (H200, gate/up at
// 8 rows): a ring re-requesting each k32 step as soon as its mma has read it (1.7 TB/s against 2.8: ptxas puts
// every load on one scoreboard and waits for all of them at each step, so one step was in flight), and an L2
// prefetch of the next chunk (2.5). The block's K slice of the robots' rows is staged once
// (bf16, cp.async; rows past `rows` up to the tile zero-filled: NaN * 0 is NaN), 16-byte word q of row r at
// q ^ 4 (r & 1): the two rows a quarter-warp reads then sit in different bank halves. fp32 atomics for the robots
// < rows only. grid = (ceil(N / (16 GEMM_WARPS)), K splits of ks_len); dynamic shared memory
// 2 * (rows <= 8 ? 8 : 16) * ks_len bytes, ks_len rounded up to 64. N a multiple of 16, K of 32
// (engine/cuda/fleet_forward.py).
template <int TILES>
__device__ __forceinline__ void grm_chunks(uint4 (&b)[GEMM_KC / 32][2], float (&acc)[2][4], const uint4* sA, int sa,
                                           const bf16_t* W0, const bf16_t* W1, int klen, int g, int t) {
    const int swz = (g & 1) << 2;  // rows g and g + 8 have the same parity
    for (int kc = 0; kc < klen; kc += GEMM_KC) {
        const int clen = min(GEMM_KC, klen - kc);  // a multiple of 32
        if (kc != 0) gemm32_load_w(b, W0, W1, kc, clen, true);
#pragma unroll
        for (int u = 0; u < GEMM_KC / 32; ++u) {
            if (32 * u < clen) {
                const int q = ((kc >> 3) + 4 * u + t) ^ swz;
                uint4 x[TILES];
#pragma unroll
                for (int j = 0; j < TILES; ++j) x[j] = sA[(g + 8 * j) * sa + q];
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int j = 0; j < TILES; ++j)
                        mma_bf16_16816(acc[j], u4_word(b[u][0], 2 * h), u4_word(b[u][1], 2 * h),
                                       u4_word(b[u][0], 2 * h + 1), u4_word(b[u][1], 2 * h + 1),
                                       u4_word(x[j], 2 * h), u4_word(x[j], 2 * h + 1));
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * GEMM_WARPS, 2) gemv_rows_mma(const bf16_t* __restrict__ A, int lda,
        const bf16_t* __restrict__ W, int N, int K, int ks_len, float* __restrict__ C, int ldc, int rows) {
    extern __shared__ uint4 grm_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nw = (blockIdx.x * GEMM_WARPS + warp) * 16;
    const bool active = nw < N;  // N is a multiple of 16
    const int kbeg = blockIdx.y * ks_len;
    const int klen = min(ks_len, K - kbeg);  // a multiple of 32
    const bf16_t* W0 = W + (size_t)(active ? nw + g : 0) * K + kbeg + t * 8;
    const bf16_t* W1 = W0 + (size_t)8 * K;
    uint4 b[GEMM_KC / 32][2];
    if (klen > 0) gemm32_load_w(b, W0, W1, 0, min(GEMM_KC, klen), active);  // weights: before the PDL wait
    pdl_trigger(FAM_GEMM);
    pdl_wait(FAM_GEMM);
    if (klen <= 0) return;  // uniform over the block
    const int tiles = rows > 8 ? 2 : 1;
    const int sa = ((ks_len >> 3) + 7) & ~7;  // 16-byte words per staged row: whole groups of 8 (the swizzle)
    const int nq = klen >> 3;
    for (int i = threadIdx.x; i < 8 * tiles * nq; i += 32 * GEMM_WARPS) {
        const int r = i / nq, q = i - r * nq;
        uint4* d = grm_smem + r * sa + (q ^ ((r & 1) << 2));
        if (r < rows) cp_async16(d, A + (size_t)r * lda + kbeg + q * 8);
        else *d = make_uint4(0u, 0u, 0u, 0u);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if (!active) return;
    float acc[2][4] = {};
    if (tiles == 2) grm_chunks<2>(b, acc, grm_smem, sa, W0, W1, klen, g, t);
    else grm_chunks<1>(b, acc, grm_smem, sa, W0, W1, klen, g, t);
    // acc[j] = rows g, g + 8 of the warp's 16 x robots 8j + 2t, 8j + 2t + 1 (the mma's C fragment)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int r0 = 8 * j + 2 * t;
        float* c = C + (size_t)r0 * ldc + nw + g;
        if (r0 < rows) {
            atomicAdd(c, acc[j][0]);
            atomicAdd(c + 8, acc[j][2]);
        }
        if (r0 + 1 < rows) {
            atomicAdd(c + ldc, acc[j][1]);
            atomicAdd(c + ldc + 8, acc[j][3]);
        }
    }
}

// act[row][i] = bf16(silu(gate) * up) from the fp32 gate/up GEMM output in the interleaved row layout of the
// weights (buffers.interleave_gate_up: columns 16b .. 16b + 7 = gate 8b .. 8b + 7, 16b + 8 .. = up): gemm32_silu's
// epilogue as a kernel of its own. grid = (ceil(I / blockDim.x), rows).
extern "C" __global__ void silu_rows(const float* __restrict__ gu, int I, bf16_t* __restrict__ act) {
    pdl_trigger(FAM_GATEUP);
    pdl_wait(FAM_GATEUP);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= I) return;
    const float* row = gu + (size_t)blockIdx.y * 2 * I;
    const int b = i >> 3, k = i & 7;
    act[(size_t)blockIdx.y * I + i] = f32_to_bf16(silu(row[16 * b + k]) * row[16 * b + 8 + k]);
}

// dst[r][0..H) = src[base_r + T_r - 1][0..H): each member's last row of the pass (its record r: meta + r * stride,
// [L, p0, T, n_ctx, bidirectional, base row, ..]), gathered for the LM head (gemv_logits, grid.y = members).
// grid = (ceil(H / blockDim.x), members).
extern "C" __global__ void rows_gather(const float* __restrict__ src, int H, const int* __restrict__ meta,
                                       int meta_stride, float* __restrict__ dst) {
    pdl_trigger();
    const int* rec = meta + (size_t)blockIdx.y * meta_stride;
    const int row = rec[5] + rec[2] - 1;  // host-written: read before the wait
    pdl_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < H) dst[(size_t)blockIdx.y * H + i] = src[(size_t)row * H + i];
}

// A decode step's own K and V (bf16, before RoPE, as gemv_qkv stores them) into the cache: member blockIdx.y's row
// (rec[5]) of the pass's QKV output -> its slot key_slots[m][rec[0] - 1] (the step's token is its last key).
// grid = (ceil(2 nkv / blockDim.x), members).
extern "C" __global__ void kv_store_rows(const float* __restrict__ qkv, int ld, int nq, int nkv, bf16_t* kc,
                                         bf16_t* vc, const int* __restrict__ key_slots, int slots_stride,
                                         const int* __restrict__ meta, int meta_stride) {
    pdl_trigger();
    const int* rec = meta + (size_t)blockIdx.y * meta_stride;
    const int row = rec[5];
    const int slot = key_slots[(size_t)blockIdx.y * slots_stride + rec[0] - 1];  // host-written: before the wait
    pdl_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 2 * nkv) return;
    const float v = qkv[(size_t)row * ld + nq + i];  // k columns, then v columns
    bf16_t* dst = i < nkv ? kc : vc;
    dst[(size_t)slot * nkv + (i < nkv ? i : i - nkv)] = f32_to_bf16(v);
}

// What the host reads from the compiled module (engine/cuda/kernels.py LAUNCH_CONSTANTS), in this order.
__constant__ int vla_launch[3] = {GEMM_WARPS, GR_WARPS, GR_MAXM};
