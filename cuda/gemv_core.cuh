// What every decode GEMV shares (gemv.cu: bf16 weights; gemv_quant.cu: int8 / fp8 / int4 codes): the RMSNorm
// prologue, the input vector in shared memory and the start sequence around the PDL wait. Included after the
// including file's row type (Rows) and its gemv_prefetch(Rows&, K, valid), which gemv_start calls.
#pragma once
#include "common.cuh"

#ifndef GEMV_WARPS
#define GEMV_WARPS 8
#endif
#ifndef GEMV_XS_SCALE  // the GEMV_DENORM knob's scale of x: wtype.cuh defines it; without it (gemv.cu) XS is never on
#define GEMV_XS_SCALE 1.f
#endif

// RMSNorm weights of the prologue, read into registers BEFORE the PDL wait (constants: their HBM round trip
// overlaps the predecessor instead of following the block reduction). Up to GEMV_NW values per thread; larger K
// reads them in the prologue.
#define GEMV_NW 6
struct GemvNorm {
    float w[GEMV_NW];
    bool pre;
};
__device__ __forceinline__ void gemv_norm_prefetch(GemvNorm& n, const bf16_t* __restrict__ normw, int K) {
    n.pre = normw != nullptr && K <= GEMV_NW * (int)blockDim.x;
#pragma unroll
    for (int j = 0; j < GEMV_NW; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        n.w[j] = n.pre && i < K ? bf16_to_f32(normw[i]) : 0.f;
    }
}

// Load v (K floats) into shared memory; with normw, replace it by rmsnorm(v) * normw.
// norm_out (optional, block 0 only): the normalised vector (the final hidden state for the LM head).
// The vector is read PV float4 per thread at a time, all loads in flight before any is stored (a plain loop
// would wait for each L2 round trip in turn: K / 256 of them for the 8960-wide down projection). PV: 2 covers
// K <= 2048 in one batch (the normed GEMVs), 4 covers the o_proj / down split-K slices in one or two.
// XS (the quantised GEMVs' GEMV_DENORM knob, wtype.cuh): sx holds the vector times GEMV_XS_SCALE (norm_out does not).
template <int PV, bool XS = false>
__device__ __forceinline__ void gemv_prologue(float* sx, const float* __restrict__ v, int K,
                                              const bf16_t* __restrict__ normw, float eps, float* norm_out,
                                              const GemvNorm& nrm) {
    __shared__ float red[33];
    float ss = 0.f;
    const int n4 = K >> 2;  // K % 8 == 0 and v 16-byte aligned (the 16-byte weight loads need both anyway)
    const float4* v4 = reinterpret_cast<const float4*>(v);
    float4* s4 = reinterpret_cast<float4*>(sx);
    for (int base = 0; base < n4; base += PV * blockDim.x) {
        float4 a[PV];
#pragma unroll
        for (int j = 0; j < PV; ++j) {
            const int i = base + threadIdx.x + j * blockDim.x;
            if (i < n4) a[j] = v4[i];
        }
#pragma unroll
        for (int j = 0; j < PV; ++j) {
            const int i = base + threadIdx.x + j * blockDim.x;
            if (i < n4) {
                if constexpr (XS) {
                    static_assert(!XS || GEMV_XS_SCALE > 1.f, "XS needs wtype.cuh's GEMV_XS_SCALE, included first");
                    const float f = normw == nullptr ? GEMV_XS_SCALE : 1.f;  // a normed vector is scaled below
                    s4[i] = make_float4(a[j].x * f, a[j].y * f, a[j].z * f, a[j].w * f);
                } else {
                    s4[i] = a[j];
                }
                ss = fmaf(a[j].x, a[j].x, fmaf(a[j].y, a[j].y, fmaf(a[j].z, a[j].z, fmaf(a[j].w, a[j].w, ss))));
            }
        }
    }
    if (normw != nullptr) {
        ss = block_sum(ss, red);  // contains __syncthreads: every thread's stores above are visible
        const float r = rsqrtf(ss / (float)K + eps);
        if (nrm.pre) {
#pragma unroll
            for (int j = 0; j < GEMV_NW; ++j) {
                const int i = threadIdx.x + j * blockDim.x;
                if (i < K) {
                    const float y = nrm.w[j] * (sx[i] * r);
                    sx[i] = XS ? y * GEMV_XS_SCALE : y;
                    if (norm_out != nullptr && blockIdx.x == 0) norm_out[i] = y;
                }
            }
        } else {
            for (int i = threadIdx.x; i < K; i += blockDim.x) {
                const float y = bf16_to_f32(normw[i]) * (sx[i] * r);
                sx[i] = XS ? y * GEMV_XS_SCALE : y;
                if (norm_out != nullptr && blockIdx.x == 0) norm_out[i] = y;
            }
        }
    }
    __syncthreads();
}

struct NoPreWait {
    __device__ void operator()() const {}
};

// The start every GEMV kernel shares: its weight loads and norm weights requested, pre() (more work before the
// wait, after the weight loads are issued: it may block on loads of its own), the PDL trigger and wait (FAM: the
// kernel family, common.cuh), then the input vector v (K floats, RMS-normed when normw is given) in shared memory sx.
template <int PV, int FAM, bool XS = false, typename Rows, typename Pre = NoPreWait>
__device__ __forceinline__ void gemv_start(float* sx, Rows& R, int K, bool valid, const float* __restrict__ v,
                                           const bf16_t* __restrict__ normw, float eps, float* norm_out,
                                           Pre pre = Pre()) {
    gemv_prefetch(R, K, valid);
    GemvNorm nrm;
    gemv_norm_prefetch(nrm, normw, K);
    pre();
    pdl_trigger(FAM);
    pdl_wait(FAM);
    gemv_prologue<PV, XS>(sx, v, K, normw, eps, norm_out, nrm);
}

