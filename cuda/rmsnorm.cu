// RMSNorm over rows of the fp32 residual stream (prefill: one block per token).
// HF Qwen2RMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)), computed in fp32.
// The norm weights (constants) are read into registers before the PDL wait and the row's values stay in registers
// between the sum of squares and the output (one L2 round trip for the row, none for the weights after the wait);
// rows longer than RN_MAX * blockDim.x values take the plain loops.
#include "common.cuh"

#define RN_MAX 8

template <typename Store>
__device__ __forceinline__ void rmsnorm_row(const float* __restrict__ xr, const bf16_t* __restrict__ w, int H,
                                            float eps, Store store) {
    __shared__ float red[33];
    const bool regs = H <= RN_MAX * (int)blockDim.x;
    float wv[RN_MAX], xv[RN_MAX];
#pragma unroll
    for (int j = 0; j < RN_MAX; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        wv[j] = regs && i < H ? bf16_to_f32(w[i]) : 0.f;
    }
    pdl_trigger(FAM_RMSNORM);
    pdl_wait(FAM_RMSNORM);
    float ss = 0.f;
    if (regs) {
#pragma unroll
        for (int j = 0; j < RN_MAX; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            xv[j] = i < H ? xr[i] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < RN_MAX; ++j) ss = fmaf(xv[j], xv[j], ss);
    } else {
        for (int i = threadIdx.x; i < H; i += blockDim.x) { float v = xr[i]; ss = fmaf(v, v, ss); }
    }
    ss = block_sum(ss, red);
    const float r = rsqrtf(ss / (float)H + eps);
    if (regs) {
#pragma unroll
        for (int j = 0; j < RN_MAX; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < H) store(i, wv[j] * (xv[j] * r));
        }
    } else {
        for (int i = threadIdx.x; i < H; i += blockDim.x) store(i, bf16_to_f32(w[i]) * (xr[i] * r));
    }
}

// out (bf16) = rmsnorm(x[row]) for row = blockIdx.x; the bf16 rows are the A operand of the next skinny GEMM.
// When bias_out is given, bias_out[row][0..nbias) = bias (the QKV GEMM then accumulates onto it with atomics).
extern "C" __global__ void rmsnorm_rows_bf16(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                             bf16_t* __restrict__ out, int H, float eps,
                                             const float* __restrict__ bias, float* __restrict__ bias_out,
                                             int nbias) {
    const int row = blockIdx.x;
    bf16_t* o = out + (size_t)row * H;
    rmsnorm_row(x + (size_t)row * H, w, H, eps, [&](int i, float y) { o[i] = f32_to_bf16(y); });
    if (bias_out != nullptr)
        for (int i = threadIdx.x; i < nbias; i += blockDim.x) bias_out[(size_t)row * nbias + i] = bias[i];
}

// fp32 output (final norm of the prefill rows, read back by tests and for the LM head).
extern "C" __global__ void rmsnorm_rows_f32(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                            float* __restrict__ out, int H, float eps) {
    const int row = blockIdx.x;
    float* o = out + (size_t)row * H;
    rmsnorm_row(x + (size_t)row * H, w, H, eps, [&](int i, float y) { o[i] = y; });
}
