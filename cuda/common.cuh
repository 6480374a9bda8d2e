// Shared helpers for the vla_edge_ros kernels (included by every cuda/*.cu).
// bf16 values travel as raw 16-bit patterns (unsigned short) so the kernels need no cuda_bf16.h types at the
// Python boundary; conversions below are exact (bf16 -> f32) and round-to-nearest-even (f32 -> bf16).
#pragma once
#include <stdint.h>

typedef unsigned short bf16_t;

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float bf16_to_f32(bf16_t h) { return __uint_as_float(((uint32_t)h) << 16); }

// PACK_CVT=1 (a measuring knob, session 31, unmeasured): both conversions below by the conversion instruction
// (cvt.rn.bf16[x2].f32, sm_80 on: the same rounding, one instruction a value or pair) instead of ~7 integer
// instructions a value. Outputs equal bit for bit except NaN payloads (the instruction's NaN is canonical). The
// quantised GEMMs already use it (wtype.cuh cvt_bf16x2: their prefill -19 to -23 %); here it would reach the
// attention kernels' P and RoPE packing and every bf16 store (docs/KERNEL_NOTES.md, session 31).
#ifndef PACK_CVT
#define PACK_CVT 0
#endif
#if PACK_CVT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define VLA_PACK_CVT 1
#else
#define VLA_PACK_CVT 0
#endif

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
#if VLA_PACK_CVT
    bf16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
#endif
}

// two floats -> one bf16x2 word (lo = first) by the conversion instruction (sm_80 on), rounded to nearest even as
// pack_bf16x2 below, whose integer rounding (about 7 instructions a value) was most of the instructions of the
// quantised GEMMs' dequantisation (wtype.cuh, docs/KERNEL_NOTES.md session 31). Only NaN payloads can differ.
__device__ __forceinline__ uint32_t cvt_bf16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// two floats -> one 32-bit word of two bf16 (lo = first)
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
#if VLA_PACK_CVT
    return cvt_bf16x2(lo, hi);
#else
    return (uint32_t)f32_to_bf16(lo) | ((uint32_t)f32_to_bf16(hi) << 16);
#endif
}

// 16-byte streaming load of weights: read once per pass, keep them out of L1.
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ float dot8_bf16(uint4 w, float4 a, float4 b) {
    float s = bf16_lo(w.x) * a.x;
    s = fmaf(bf16_hi(w.x), a.y, s);
    s = fmaf(bf16_lo(w.y), a.z, s);
    s = fmaf(bf16_hi(w.y), a.w, s);
    s = fmaf(bf16_lo(w.z), b.x, s);
    s = fmaf(bf16_hi(w.z), b.y, s);
    s = fmaf(bf16_lo(w.w), b.z, s);
    s = fmaf(bf16_hi(w.w), b.w, s);
    return s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the nw warps of the block (all of them: blockDim.x == 32 nw); every thread gets the result.
__device__ __forceinline__ float warps_sum(float v, float* scratch /* >= 33 floats */, int nw) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nw ? scratch[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    return scratch[32];
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch /* >= 33 floats */) {
    return warps_sum(v, scratch, blockDim.x >> 5);
}

// D = A(16x16 bf16, row) * B(16x8 bf16, col) + D, fp32 accumulate (sm_80+ tensor cores).
__device__ __forceinline__ void mma_bf16_16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t u4_word(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// Row of intermediate o's gate in the interleaved gate/up matrix (engine interleave_gate_up: blocks of 8 gate rows
// then their 8 up rows); its up row is 8 further.
__device__ __forceinline__ int gateup_gate_row(int o) { return 16 * (o >> 3) + (o & 7); }

// 16-byte global -> shared copy through L2 (sm_80 cp.async): no registers held while in flight.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Programmatic dependent launch (sm_90): a kernel launched with the programmatic-stream-serialization attribute
// may start while its predecessor finishes; everything before pdl_wait() must not read data the predecessor
// writes nor write data it reads (weights are read-only: they are prefetched before the wait). Without the
// attribute both are no-ops, so the same kernels run under plain launches too.
//
// Timeline (benchmark builds only, -DVLA_TIMELINE): thread 0 of the first and the last block of a grid stamps
// %globaltimer into the grid's row of vla_tl (row = %gridid % VLA_TL_ROWS): [gridid, first block's start, first
// and last of the two blocks' pass of the wait]. Two blocks only: same-address atomics from every block of a
// 1500-block grid would serialise and distort what they measure. The host (bench/gpu_profile.py) orders the
// rows by grid id, i.e. by launch.
#ifdef VLA_TIMELINE
#define VLA_TL_ROWS 4096
__device__ unsigned long long vla_tl[VLA_TL_ROWS][4];
__device__ __forceinline__ void vla_tl_stamp(int col) {
    const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x != 0 || threadIdx.y != 0 || (b != 0 && b != gridDim.x * gridDim.y * gridDim.z - 1)) return;
    unsigned long long g, t;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    unsigned long long* row = vla_tl[g % VLA_TL_ROWS];
    row[0] = g;
    if (col == 3) atomicMax(row + 3, t);
    else atomicMin(row + col, t);
}
// Per-block phase stamps of the prefill attention (the last layer's launch overwrites the earlier ones): lane 0 of
// every warp raises vla_pf_phase[block][phase] to %globaltimer as it passes the phase's end, so a slot holds the
// block's slowest warp. Tells which blocks and which phase set the kernel's completion (the block-0 / last-block
// stamps above cannot).
#define VLA_PF_BLOCKS 1024
#define VLA_PF_PHASES 5
__device__ unsigned long long vla_pf_phase[VLA_PF_BLOCKS][VLA_PF_PHASES];
__device__ __forceinline__ void vla_pf_stamp(int phase) {
    const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if ((threadIdx.x & 31) != 0 || b >= VLA_PF_BLOCKS) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    atomicMax(&vla_pf_phase[b][phase], t);
}
#else
__device__ __forceinline__ void vla_tl_stamp(int) {}
__device__ __forceinline__ void vla_pf_stamp(int) {}
#endif
//
// When a kernel lets its successor launch: at its start (default), or after its own wait when its family's bit is
// set in vla_late_trigger (written by the host, tuning "late_trigger"). Every kernel triggering at its start lets
// a whole cascade of later kernels become resident early, each holding registers and shared memory while it
// waits; a late trigger bounds the cascade. Either way is correct: a dependent still waits for completion.
enum VlaFamily { FAM_QKV = 0, FAM_ATTN = 1, FAM_COMBINE = 2, FAM_RESID = 3, FAM_GATEUP = 4, FAM_GEMM = 5,
                 FAM_RMSNORM = 6, FAM_ATTN_PF = 7 };
__constant__ unsigned vla_late_trigger;
__device__ __forceinline__ bool vla_late(int fam) { return fam >= 0 && ((vla_late_trigger >> fam) & 1u); }
// griddepcontrol is sm_90 PTX. Built for an older GPU (Jetson Orin sm_87, A100 sm_80, RTX 30/40 / L4 sm_86 / sm_89)
// both compile to nothing, which is exactly their meaning without the launch attribute (the host launches those
// GPUs without it: engine/cuda/arch.py).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define VLA_SM90 1
#else
#define VLA_SM90 0
#endif
__device__ __forceinline__ void pdl_wait(int fam = -1) {
#if VLA_SM90
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    vla_tl_stamp(2);
    vla_tl_stamp(3);
#if VLA_SM90
    if (vla_late(fam)) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger(int fam = -1) {
    vla_tl_stamp(1);
#if VLA_SM90
    if (!vla_late(fam)) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
