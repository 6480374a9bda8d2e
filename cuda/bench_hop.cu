// Benchmark-only kernels (vla_edge_ros/bench/pdl_hop_bench.py; not loaded by the engine): the cost of one kernel
// boundary in a PDL chain, with the data dependency the decode's kernels have, and nothing else.
// hop_copy: out[i] = in[i] + 1 for i < n after the PDL wait (each thread depends on one value of its predecessor).
// hop_vector: every block first reads the whole n-float input (as every decode kernel needs the whole residual /
// activation vector of its predecessor), sums it, then writes its slice out[i] = in[i] + 1e-9 * sum: one L2 round
// trip for the input, one block reduction, one store, as in a GEMV's prologue and epilogue without the weights.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) hop_copy(const float* __restrict__ in, float* __restrict__ out,
                                                          int n) {
    pdl_trigger();
    pdl_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] + 1.f;
}

extern "C" __global__ void __launch_bounds__(256) hop_vector(const float* __restrict__ in, float* __restrict__ out,
                                                            int n) {
    __shared__ float red[33];
    pdl_trigger();
    pdl_wait();
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += in[i];
    s = block_sum(s, red);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = in[i] + 1e-9f * s;
}
