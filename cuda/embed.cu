// Embedding gather (decode input) and small data-movement helpers.
#include "common.cuh"

// x[0..H) = float(E[tok_buf[tok_index]]) ; the token id was written on the device by the previous argmax,
// so a captured graph can chain decode steps without the host. grid.y > 1 (the fleet's decode pass, one row per
// robot): row y = E[tok_buf[tok_index + y]] at x + y * H.
extern "C" __global__ void embed_gather(const bf16_t* __restrict__ E, const int* __restrict__ tok_buf,
                                        int tok_index, float* __restrict__ x, int H) {
    pdl_trigger();
    pdl_wait();
    const int tok = tok_buf[tok_index + blockIdx.y];
    x += (size_t)blockIdx.y * H;
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
