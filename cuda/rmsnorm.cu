// RMSNorm over rows of the fp32 residual stream (prefill: one block per token).
// HF Qwen2RMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)), computed in fp32.
#include "common.cuh"

// out (bf16) = rmsnorm(x[row]) for row = blockIdx.x; the bf16 rows are the A operand of the next skinny GEMM.
// When bias_out is given, bias_out[row][0..nbias) = bias (the QKV GEMM then accumulates onto it with atomics).
extern "C" __global__ void rmsnorm_rows_bf16(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                             bf16_t* __restrict__ out, int H, float eps,
                                             const float* __restrict__ bias, float* __restrict__ bias_out,
                                             int nbias) {
    pdl_trigger();
    pdl_wait();
    __shared__ float red[33];
    const int row = blockIdx.x;
    const float* xr = x + (size_t)row * H;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) { float v = xr[i]; ss = fmaf(v, v, ss); }
    ss = block_sum(ss, red);
    const float r = rsqrtf(ss / (float)H + eps);
    bf16_t* o = out + (size_t)row * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = f32_to_bf16(bf16_to_f32(w[i]) * (xr[i] * r));
    if (bias_out != nullptr)
        for (int i = threadIdx.x; i < nbias; i += blockDim.x) bias_out[(size_t)row * nbias + i] = bias[i];
}

// fp32 output (final norm of the prefill rows, read back by tests and for the LM head).
extern "C" __global__ void rmsnorm_rows_f32(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                            float* __restrict__ out, int H, float eps) {
    pdl_trigger();
    pdl_wait();
    __shared__ float red[33];
    const int row = blockIdx.x;
    const float* xr = x + (size_t)row * H;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) { float v = xr[i]; ss = fmaf(v, v, ss); }
    ss = block_sum(ss, red);
    const float r = rsqrtf(ss / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) out[(size_t)row * H + i] = bf16_to_f32(w[i]) * (xr[i] * r);
}
