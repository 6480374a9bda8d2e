// Embedding gather (decode input) and small data-movement helpers.
#include "common.cuh"

// x[0..H) = float(E[tok_buf[tok_index]]) ; the token id was written on the device by the previous argmax,
// so a captured graph can chain decode steps without the host.
extern "C" __global__ void embed_gather(const bf16_t* __restrict__ E, const int* __restrict__ tok_buf,
                                        int tok_index, float* __restrict__ x, int H) {
    pdl_trigger();
    pdl_wait();
    const int tok = tok_buf[tok_index];
    const bf16_t* row = E + (size_t)tok * H;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < H; i += gridDim.x * blockDim.x)
        x[i] = bf16_to_f32(row[i]);
}

// Relocate K/V rows (budget shrink): for every layer, rows src[i] -> dst[i] (nkv values each).
extern "C" __global__ void kv_move(bf16_t* __restrict__ kc, bf16_t* __restrict__ vc, int layers, int slots,
                                   int nkv, const int* __restrict__ src, const int* __restrict__ dst, int n) {
    pdl_trigger();
    pdl_wait();
    const size_t total = (size_t)layers * n * nkv;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const int e = (int)(i % nkv);
        const size_t r = i / nkv;
        const int m = (int)(r % n);
        const int layer = (int)(r / n);
        const size_t base = (size_t)layer * slots * nkv;
        kc[base + (size_t)dst[m] * nkv + e] = kc[base + (size_t)src[m] * nkv + e];
        vc[base + (size_t)dst[m] * nkv + e] = vc[base + (size_t)src[m] * nkv + e];
    }
}

// dst[c][r] = src[r][c] for a rows x cols bf16 matrix, through a 32 x 32 tile in shared memory (the fused decode
// MLP's transposed W_d, built once per layer when that option is switched on). grid (ceil(cols/32), ceil(rows/32)),
// block (32, 8).
extern "C" __global__ void transpose_bf16(const bf16_t* __restrict__ src, bf16_t* __restrict__ dst, int rows,
                                          int cols) {
    __shared__ bf16_t tile[32][33];
    const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        const int r = r0 + i, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[i][threadIdx.x] = src[(size_t)r * cols + c];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        const int c = c0 + i, r = r0 + threadIdx.x;
        if (r < rows && c < cols) dst[(size_t)c * rows + r] = tile[threadIdx.x][i];
    }
}
