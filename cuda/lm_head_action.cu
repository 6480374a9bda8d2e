// Greedy choice over the action rows of the LM head. The logits themselves come from gemv_logits (gemv.cu)
// run over the LAST n vocabulary rows only (the action bins); the chosen id is written to device memory so
// the next decode step's embedding gather reads it inside the same graph, without a host round trip.
#include "common.cuh"

// tok_buf[out_index] = offset + argmax(logits[0..n)); ties -> lowest index (numpy.argmax); or forced[out_index]
// where that is >= 0 (a forced prefix, engine/geometry.forced_gen: the logits stay the computed ones, and the next
// decode step's embedding gather reads the forced id, i.e. teacher forcing on the device). One block per row:
// block b takes logits[b * n ..] -> tok_buf[out_index + b] (grid.x > 1: the parallel pass's A slots at once).
extern "C" __global__ void argmax_tokens(const float* __restrict__ logits, int n, int offset,
                                         int* __restrict__ tok_buf, int out_index, const int* __restrict__ forced) {
    pdl_trigger();
    out_index += blockIdx.x;
    logits += (size_t)blockIdx.x * n;
    const int fixed = forced[out_index];  // host-written before the replay: read before the wait
    pdl_wait();
    __shared__ float sv[32];
    __shared__ int si[32];
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = logits[i];
        if (v > best || (v == best && i < bi) || (bi == 0x7fffffff && !(v == v))) { best = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        best = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) tok_buf[out_index] = fixed >= 0 ? fixed : offset + (bi == 0x7fffffff ? 0 : bi);
    }
}
