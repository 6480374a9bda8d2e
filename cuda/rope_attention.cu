// Grouped-query attention over the slot-indexed KV cache, keys stored BEFORE RoPE and rotated here from each
// key's logical position (its index j in key_slots), so eviction never invalidates a stored key.
//
// Cache of one layer: kc/vc [slots][nkv] bf16 with nkv = kv_heads * HD (HF layout of k_proj/v_proj rows).
// meta (device ints, written by the host before a graph replay): meta[0] = L keys seen by the prefill chunk,
// meta[1] = p0 (position of prefill token 0), meta[2] = T valid prefill tokens, meta[3] = n_ctx (decode base),
// meta[4] = 1: the prefill pass is bidirectional (vla.chunk_decode "parallel": the A action slots see each other and
// the whole context), 0: causal. One record per pass (engine/cuda/pass_meta.py META_INTS, chunk_inputs).
// Decode step s (1-based) sees L = meta[3] + s keys and sits at position meta[3] + s - 1.
// rope_cs: float2 (cos, sin) [positions][HD/2], HF rotate_half convention.
// Softmax runs in the log2 domain: queries are pre-scaled by log2(e)/sqrt(HD).
// Split-K (flash-decoding): grid.x splits the keys in runs of ATT_KC (64: one staged chunk per split block, the keys
// older than the pass staged before the PDL wait); attn_combine* merge the partials.
// Head groups (the *_hg kernels, the named fallback for more query heads per KV head than one block holds: Qwen2.5-3B
// and up at head_dim 128): grid.z splits the G query heads of a KV head into gridDim.z groups of ceil(G / gridDim.z),
// one block per (split, KV head, group); every group stages the same keys (read once per group: slower, not
// wrong). The default kernels are the same bodies with the group code compiled out (HG = false).
#include "common.cuh"
#include "attn_core.cuh"

// Keys [j0, j1) of this prefill chunk (j >= p0: token j - p0, K/V read from the fp32 QKV output, bias included) into
// rows j - kc0 of a staged chunk, and into the cache (bf16, pre-RoPE) at slot sSlot[j - kc0]: each (key, KV head)
// is staged by exactly one split block, so every row is stored once. The staged K is rotated from the bf16-rounded
// value, exactly what a later read of the cache gives. One memory round trip.
template <int HD, bool STORE = true>
__device__ __forceinline__ void stage_kv_fresh(bf16_t* sK, bf16_t* sVt, const int* sSlot, const float* qkv, int ld,
        bf16_t* kc, bf16_t* vc, const float2* __restrict__ rope_cs, int kvh, int n_kvh, int G, int j0, int j1,
        int kc0, int p0) {
    const int nkv = n_kvh * HD, nq = n_kvh * G * HD;
    stage_kv_items<HD, 2, float2>(j0, j1, rope_cs,
        [&](int j, const float2*& k, const float2*& v) {
            const float* r = qkv + (size_t)(j - p0) * ld + nq + kvh * HD;
            k = reinterpret_cast<const float2*>(r);
            v = reinterpret_cast<const float2*>(r + nkv);
        },
        [&](int j, int d, float2 klo, float2 khi, float2 vlo, float2 vhi, float4 cs) {
            const uint32_t k0 = pack_bf16x2(klo.x, klo.y), k1 = pack_bf16x2(khi.x, khi.y);
            const uint32_t v0 = pack_bf16x2(vlo.x, vlo.y), v1 = pack_bf16x2(vhi.x, vhi.y);
            if constexpr (STORE) {  // false: a head group other than the first (the first stores the rows)
                const size_t row = (size_t)sSlot[j - kc0] * nkv + kvh * HD + d;
                *reinterpret_cast<uint32_t*>(kc + row) = k0;
                *reinterpret_cast<uint32_t*>(kc + row + HD / 2) = k1;
                *reinterpret_cast<uint32_t*>(vc + row) = v0;
                *reinterpret_cast<uint32_t*>(vc + row + HD / 2) = v1;
            }
            put_kv_pair<HD>(sK, sVt, j - kc0, d, k0, k1, v0, v1, cs);
        });
}

// Prefill: 32 query rows per head (tokens; rows >= T are padding and ignored downstream) x G heads of one KV
// head, against keys [split*ATT_KC, min(L, +ATT_KC)), causal by position (key j visible to token t iff j <= p0 + t),
// or, with meta[4] set (the parallel pass), every key j < L visible to every token.
// 2G warps; warp w = m16 tile: head w/2, tokens (w&1)*16 .. +15. Tensor cores for QK^T and PV.
// Partials: part_o [split][Hq*32][HD] (unnormalised), part_ml [split][Hq*32] (max, sum), row = qh*32 + token.
// HG: heads group blockIdx.z * ceil(G / gridDim.z) + w/2 (2 ceil(G / gridDim.z) warps); warps past the last head of
// the last group compute a copy of head G - 1 and store nothing; only group 0 stores this chunk's K/V in the cache.
template <int HD, bool HG = false>
__device__ __forceinline__ void attn_prefill_body(const float* __restrict__ qkv, int ld, bf16_t* kc, bf16_t* vc,
        const int* __restrict__ key_slots, const int* __restrict__ meta, const float2* __restrict__ rope_cs, int G,
        int n_kvh, float qscale, float* __restrict__ part_o, float2* __restrict__ part_ml, bf16_t* sK, bf16_t* sVt,
        int* sSlot) {
    constexpr int KS = HD / 16;       // k16 steps over the head dim
    constexpr int HALF = HD / 2;
    constexpr int NT_O = HD / 8;      // n8 tiles of the output
    constexpr int VSTR = ATT_KC + 8;  // bf16 row stride of transposed values (staged keys: HD + 8, qk_tiles)

    const int L = meta[0], p0 = meta[1];
    const bool bidirectional = meta[4] != 0;  // host-written, like L and p0: one int more, read before the wait
    const int kvh = blockIdx.y;
    const int kbeg = blockIdx.x * ATT_KC;
    pdl_trigger(FAM_ATTN_PF);
    if (kbeg >= L) return;
    const int kend = min(L, kbeg + ATT_KC);
    const int nkv = n_kvh * HD;
    // The keys older than this chunk (j < p0: cache rows written before the prefill graph started; key_slots and
    // meta are host-written) are staged BEFORE the PDL wait, while the QKV GEMM still runs; this chunk's own keys
    // come from the QKV output after it (stage_kv_fresh, which also stores them in the cache: no separate K/V store
    // kernel).
    stage_kv_chunk<HD>(sK, sVt, sSlot, kc, vc, key_slots, rope_cs, kvh, nkv, kbeg, min(kend, p0), kend);
    pdl_wait(FAM_ATTN_PF);
    vla_pf_stamp(0);  // (benchmark builds: phases wait, own-keys staging, query fragments, S/softmax/PV, stores)
    // before the query fragments (registers: 168 at 384 threads) and in its own round trip
    __syncthreads();  // the pre-wait staging (zero rows from p0 on) is complete in every thread
    if constexpr (HG) {
        if (max(kbeg, p0) < kend) {
            if (blockIdx.z == 0)
                stage_kv_fresh<HD>(sK, sVt, sSlot, qkv, ld, kc, vc, rope_cs, kvh, n_kvh, G, max(kbeg, p0), kend,
                                   kbeg, p0);
            else
                stage_kv_fresh<HD, false>(sK, sVt, sSlot, qkv, ld, kc, vc, rope_cs, kvh, n_kvh, G, max(kbeg, p0),
                                          kend, kbeg, p0);
        }
    } else {
        if (max(kbeg, p0) < kend)
            stage_kv_fresh<HD>(sK, sVt, sSlot, qkv, ld, kc, vc, rope_cs, kvh, n_kvh, G, max(kbeg, p0), kend, kbeg, p0);
    }
    vla_pf_stamp(1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    int h = warp >> 1;
    bool head_ok = true;  // this warp's head exists (HG: the last group may have fewer heads than warps pairs)
    if constexpr (HG) {
        h += blockIdx.z * ((G + gridDim.z - 1) / gridDim.z);
        head_ok = h < G;
        h = min(h, G - 1);
    }
    const int qh = kvh * G + h;
    const int tok0 = (warp & 1) * 16 + g, tok1 = tok0 + 8;
    const int pos0 = p0 + tok0, pos1 = p0 + tok1;
    // the last key each row sees: its own position (causal), or every key (bidirectional: j >= kend masks the rest);
    // the mask below compares against these exactly as it compared against pos0 / pos1, so the causal loop is as it was
    const int last0 = bidirectional ? 0x7fffffff : pos0, last1 = bidirectional ? 0x7fffffff : pos1;

    // ---- query fragments: RoPE at the token's position, scaled, bf16 (A operand, row-major 16x16 per k step)
    uint32_t qa[KS][4];
    {
        float qv[2][KS][4];
        q_frag_load<HD>(qkv + (size_t)tok0 * ld + qh * HD, true, qkv + (size_t)tok1 * ld + qh * HD, true, qv);
        q_frag_build<HD>(qv, rope_cs + (size_t)pos0 * HALF, rope_cs + (size_t)pos1 * HALF, qscale, qa);
    }
    vla_pf_stamp(2);

    float o[NT_O][4];
#pragma unroll
    for (int i = 0; i < NT_O; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

#pragma unroll 1
    for (int kc0 = kbeg; kc0 < kend; kc0 += ATT_KC) {  // one iteration: the split's single chunk, staged above
        __syncthreads();

        // ---- S = Q K^T (16 rows x 64 keys per warp)
        float s[ATT_KC / 8][4];
        qk_tiles<HD, ATT_KC / 8>(sK, 0, qa, s);
        // ---- mask (range and causality unless bidirectional), online softmax (log2 domain)
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < ATT_KC / 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int j = kc0 + nt * 8 + 2 * t + (c & 1);
                const int last = c < 2 ? last0 : last1;
                if (j >= kend || j > last) s[nt][c] = -INFINITY;
                if (c < 2) mx0 = fmaxf(mx0, s[nt][c]); else mx1 = fmaxf(mx1, s[nt][c]);
            }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
        const float cr0 = exp2f(m0 - mu0), cr1 = exp2f(m1 - mu1);
        m0 = mn0; m1 = mn1;
        l0 *= cr0; l1 *= cr1;
#pragma unroll
        for (int i = 0; i < NT_O; ++i) { o[i][0] *= cr0; o[i][1] *= cr0; o[i][2] *= cr1; o[i][3] *= cr1; }
#pragma unroll
        for (int nt = 0; nt < ATT_KC / 8; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - mu0); s[nt][1] = exp2f(s[nt][1] - mu0);
            s[nt][2] = exp2f(s[nt][2] - mu1); s[nt][3] = exp2f(s[nt][3] - mu1);
            l0 += s[nt][0] + s[nt][1];
            l1 += s[nt][2] + s[nt][3];
        }
        // ---- O += P V (P from the S accumulators, re-packed as A fragments)
#pragma unroll
        for (int kk = 0; kk < ATT_KC / 16; ++kk) {
            const uint32_t a0 = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
            const uint32_t a1 = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
            const uint32_t a2 = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const uint32_t a3 = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dn = 0; dn < NT_O; ++dn) {
                const bf16_t* vr = sVt + (dn * 8 + g) * VSTR + kk * 16 + 2 * t;
                const uint32_t b0 = *reinterpret_cast<const uint32_t*>(vr);
                const uint32_t b1 = *reinterpret_cast<const uint32_t*>(vr + 8);
                mma_bf16_16816(o[dn], a0, a1, a2, a3, b0, b1);
            }
        }
    }
    vla_pf_stamp(3);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if constexpr (HG) {
        if (!head_ok) return;  // uniform over the warp; no block barrier follows
    }
    const int nrows = n_kvh * G * 32;
    const size_t r0 = (size_t)blockIdx.x * nrows + qh * 32 + tok0;
    const size_t r1 = r0 + 8;
#pragma unroll
    for (int dn = 0; dn < NT_O; ++dn) {
        *reinterpret_cast<float2*>(part_o + r0 * HD + dn * 8 + 2 * t) = make_float2(o[dn][0], o[dn][1]);
        *reinterpret_cast<float2*>(part_o + r1 * HD + dn * 8 + 2 * t) = make_float2(o[dn][2], o[dn][3]);
    }
    if (t == 0) {
        part_ml[r0] = make_float2(m0, l0);
        part_ml[r1] = make_float2(m1, l1);
    }
    vla_pf_stamp(4);
}

// grid (ceil(L / ATT_KC), n_kvh), 64 G threads (2G warps: G <= PF_MAXG_128 = 6 for head_dim 128, <= PF_MAXG_64 = 8 for
// 64: the register file at 168 / 126 registers); _hg: grid (ceil(L / ATT_KC), n_kvh, groups), 64 ceil(G / groups)
// threads, at most PFG_MAXG_* heads per group (head_dim 128: 4; at a launch bound of 6 heads its body, a few
// registers larger, spilled 8 bytes on sm_87).
#define PF_MAXG_128 6
#define PF_MAXG_64 8
#define PFG_MAXG_128 4
#define PFG_MAXG_64 8
#define ATTN_PREFILL_KERNEL(NAME, HD, THREADS, HG)                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(const float* qkv, int ld, bf16_t* kc, bf16_t* vc,      \
            const int* key_slots, const int* meta, const float2* rope_cs, int G, int n_kvh, float qscale,           \
            float* part_o, float2* part_ml) {                                                                      \
        __shared__ __align__(16) bf16_t sK[ATT_KC * (HD + 8)];                                                     \
        __shared__ __align__(16) bf16_t sVt[HD * (ATT_KC + 8)];                                                    \
        __shared__ int sSlot[ATT_KC];                                                                              \
        attn_prefill_body<HD, HG>(qkv, ld, kc, vc, key_slots, meta, rope_cs, G, n_kvh, qscale, part_o, part_ml,   \
                                  sK, sVt, sSlot);                                                                 \
    }
ATTN_PREFILL_KERNEL(attn_prefill_hd128, 128, 64 * PF_MAXG_128, false)
ATTN_PREFILL_KERNEL(attn_prefill_hd64, 64, 64 * PF_MAXG_64, false)

// Decode: one query token (G heads of KV head blockIdx.y) against keys [split * ATT_KC, min(L, +ATT_KC)), on tensor
// cores: the G heads are the rows of one m16 tile (rows >= G are zero), warp w takes keys 16w .. 16w + 15 of the
// chunk, online softmax per warp, the 4 warps merged in shared memory into one partial per (split, head).
// Partials: part_o [split][Hq][HD], part_ml [split][Hq]. Before the PDL wait (while the QKV GEMV still runs) the split
// stages its keys older than this decode pass (j < n_ctx = meta[3]: written by the prefill or earlier chunks,
// complete before the decode started: its first kernel is launched without a programmatic edge; slots and RoPE
// rows are host-written constants), the slot indices of the rest and the query position's RoPE row. After it:
// the query (through shared memory, so no query registers live across the staging) and this pass's keys in one
// round trip, then the chunk. Lean on registers (96: the query goes through shared memory): more of its blocks fit
// beside the QKV GEMV, so they are resident, and staged, when its wait opens.
// HG: the block takes heads h0 .. h0 + Gb - 1 of the KV head's G, h0 = blockIdx.z * ceil(G / gridDim.z) (<= DEC_MAXG
// each: the host picks gridDim.z = ceil(G / DEC_MAXG)).
// Shared memory (declared by the callers below): smem (DecAttnSmem<HD>::BYTES), sSlot[ATT_KC], sQcs[HD / 2],
// sQ[DEC_MAXG * HD].
template <int HD, bool HG>
__device__ __forceinline__ void attn_decode_core(const float* __restrict__ q, const bf16_t* kc, const bf16_t* vc,
        const int* __restrict__ key_slots, const int* __restrict__ meta, int step, const float2* __restrict__ rope_cs,
        int G, int n_kvh, float qscale, float* part_o, float2* part_ml, unsigned char* smem, int* sSlot,
        float2* sQcs, float* sQ) {
    constexpr int KS = HD / 16, HALF = HD / 2;
    constexpr int QPT = DEC_MAXG * HD / (32 * DEC_WARPS);  // query values per thread
    bf16_t* sK = reinterpret_cast<bf16_t*>(smem);
    bf16_t* sVt = sK + ATT_KC * (HD + 8);
    pdl_trigger(FAM_ATTN);
    const int n_ctx = meta[3], L = n_ctx + step, kbeg = blockIdx.x * ATT_KC, kvh = blockIdx.y, nkv = n_kvh * HD;
    if (kbeg >= L) return;
    const int kend = min(L, kbeg + ATT_KC);
    stage_kv_chunk<HD>(sK, sVt, sSlot, kc, vc, key_slots, rope_cs, kvh, nkv, kbeg, min(n_ctx, kend), kend);
    for (int d = threadIdx.x; d < HALF; d += blockDim.x) sQcs[d] = rope_cs[(size_t)(L - 1) * HALF + d];
    pdl_wait(FAM_ATTN);
    int Gb = G, h0 = 0;  // this block's heads: kvh * G + h0 .. + Gb - 1
    if constexpr (HG) {
        const int per = (G + gridDim.z - 1) / gridDim.z;
        h0 = blockIdx.z * per;
        Gb = min(per, G - h0);
    }
    float qt[QPT];
    const float* qg = q + (size_t)kvh * G * HD + (size_t)h0 * HD;
#pragma unroll
    for (int i = 0; i < QPT; ++i) {
        const int idx = threadIdx.x + i * blockDim.x;
        qt[i] = idx < Gb * HD ? qg[idx] : 0.f;
    }
    __syncthreads();  // the pre-wait staging (zero rows from n_ctx on) is complete in every thread
    const int j0 = max(kbeg, n_ctx);
    if (j0 < kend) stage_kv_keys<HD, 2>(sK, sVt, sSlot, kc, vc, rope_cs, kvh, nkv, j0, kend, kbeg);
#pragma unroll
    for (int i = 0; i < QPT; ++i) sQ[threadIdx.x + i * blockDim.x] = qt[i];
    __syncthreads();
    uint32_t qa[KS][4];
    {
        float qv[2][KS][4];
        dec_load_q<HD>(sQ, Gb, qv);
        q_frag_build<HD>(qv, sQcs, sQcs, qscale, qa);
    }
    DecState<HD> st;
    st.init();
    dec_attend16<HD>(sK, sVt, (threadIdx.x >> 5) * 16, kbeg, kend, qa, st);
    const int Hq = n_kvh * G;
    dec_merge<HD, DEC_WARPS>(reinterpret_cast<float*>(smem), Gb, st, [&](int h, int d, float num, float M, float den) {
        const size_t row = (size_t)blockIdx.x * Hq + kvh * G + h0 + h;
        part_o[row * HD + d] = num;
        if (d == 0) part_ml[row] = make_float2(M, den);
    });
}
// the block's shared memory and the core (attn_decode_body: the default kernels; _hg: head groups)
#define ATTN_DECODE_BODY(BODY, HG)                                                                                 \
    template <int HD>                                                                                              \
    __device__ __forceinline__ void BODY(const float* __restrict__ q, const bf16_t* kc, const bf16_t* vc,          \
            const int* __restrict__ key_slots, const int* __restrict__ meta, int step,                            \
            const float2* __restrict__ rope_cs, int G, int n_kvh, float qscale, float* part_o, float2* part_ml) { \
        __shared__ __align__(16) unsigned char smem[DecAttnSmem<HD>::BYTES];                                       \
        __shared__ int sSlot[ATT_KC];                                                                              \
        __shared__ float2 sQcs[HD / 2];                                                                            \
        __shared__ __align__(16) float sQ[DEC_MAXG * HD];                                                          \
        attn_decode_core<HD, HG>(q, kc, vc, key_slots, meta, step, rope_cs, G, n_kvh, qscale, part_o, part_ml,    \
                                 smem, sSlot, sQcs, sQ);                                                           \
    }
ATTN_DECODE_BODY(attn_decode_body, false)
ATTN_DECODE_BODY(attn_decode_body_hg, true)
// grid (ceil(L / ATT_KC), n_kvh), 32 DEC_WARPS threads; _hg: grid (ceil(L / ATT_KC), n_kvh, ceil(G / DEC_MAXG))
#define ATTN_DECODE_KERNEL(NAME, HD, BODY)                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * DEC_WARPS) NAME(const float* q, const bf16_t* kc,            \
            const bf16_t* vc, const int* key_slots, const int* meta, int step, const float2* rope_cs, int G,        \
            int n_kvh, float qscale, float* part_o, float2* part_ml) {                                            \
        BODY<HD>(q, kc, vc, key_slots, meta, step, rope_cs, G, n_kvh, qscale, part_o, part_ml);                  \
    }
ATTN_DECODE_KERNEL(attn_decode_hd128, 128, attn_decode_body)
ATTN_DECODE_KERNEL(attn_decode_hd64, 64, attn_decode_body)

#define CMB_GROUPS 8  // split groups per combine block (blockDim.x == 32 * CMB_GROUPS)

// Merge split partials. Row r = qh * T + token (T = 32 prefill, 1 decode). Block: 32 VEC dims x CMB_GROUPS split
// groups (each group walks every CMB_GROUPS-th split); grid.x = nrows * HD / (32 VEC). Active splits:
// ceil(L / kps), L = meta[meta_idx] + add. Output [token][Hq * HD], fp32 and/or bf16.
// One pass: every thread loads the (max, sum, value) of CMB_MAXS of its splits at once, before using any, and merges
// them online: one L2 round trip per CMB_GROUPS * CMB_MAXS splits (a max loop, then a sum loop: +0.04 ms per chunk).
#define CMB_MAXS 12
// VEC dims per thread (float VEC-vector loads of the partials): grid.x = nrows * HD / (32 * VEC). The prefill's
// merge (384 rows x 65 splits x 128 dims, 12.8 MB) with VEC = 1 is 1536 blocks in ~1.5 waves; VEC = 4: 384 blocks,
// a quarter of the load instructions.
template <int VEC> struct CmbVec;
template <> struct CmbVec<1> { typedef float T; };
template <> struct CmbVec<2> { typedef float2 T; };
template <> struct CmbVec<4> { typedef float4 T; };
template <int VEC>
__device__ __forceinline__ float cmb_get(const typename CmbVec<VEC>::T& v, int i) {
    return reinterpret_cast<const float*>(&v)[i];
}

// merge_row: row r, dims d = dblk * 32 * VEC + lane * VEC + k of every split (L keys: nsplit = ceil(L / kps));
// store(d, value) runs in the threads of split group 0 only (every thread returns from here).
template <int VEC, typename Store>
__device__ __forceinline__ void merge_row(const float* __restrict__ part_o, const float2* __restrict__ part_ml,
                                          int nrows, int HD, int r, int dblk, int L, int kps, Store store) {
    typedef typename CmbVec<VEC>::T VT;
    __shared__ float s_m[CMB_GROUPS], s_num[CMB_GROUPS][32 * VEC], s_den[CMB_GROUPS];
    const int lane = threadIdx.x & 31;
    const int d = dblk * 32 * VEC + lane * VEC;
    const int sg = threadIdx.x >> 5;
    const int nsplit = (L + kps - 1) / kps;
    const VT* po = reinterpret_cast<const VT*>(part_o);
    float Mg = -INFINITY, num[VEC], den = 0.f;  // this group's max and its sums relative to it
#pragma unroll
    for (int k = 0; k < VEC; ++k) num[k] = 0.f;
    for (int base = sg; base < nsplit; base += CMB_GROUPS * CMB_MAXS) {
        float m[CMB_MAXS], l[CMB_MAXS];
        VT o[CMB_MAXS];
#pragma unroll
        for (int i = 0; i < CMB_MAXS; ++i) {
            const int sp = base + i * CMB_GROUPS;
            m[i] = -INFINITY;
            l[i] = 0.f;
            o[i] = VT{};
            if (sp < nsplit) {
                const float2 ml = part_ml[(size_t)sp * nrows + r];
                m[i] = ml.x;
                l[i] = ml.y;
                o[i] = po[(((size_t)sp * nrows + r) * HD + d) / VEC];
            }
        }
        float M = Mg;
#pragma unroll
        for (int i = 0; i < CMB_MAXS; ++i) M = fmaxf(M, m[i]);
        const float c = Mg == -INFINITY ? 0.f : exp2f(Mg - M);
#pragma unroll
        for (int k = 0; k < VEC; ++k) num[k] *= c;
        den *= c;
#pragma unroll
        for (int i = 0; i < CMB_MAXS; ++i) {
            const float e = m[i] == -INFINITY ? 0.f : exp2f(m[i] - M);
#pragma unroll
            for (int k = 0; k < VEC; ++k) num[k] = fmaf(e, cmb_get<VEC>(o[i], k), num[k]);
            den = fmaf(e, l[i], den);
        }
        Mg = M;
    }
    if (lane == 0) s_m[sg] = Mg;
    __syncthreads();
    float M = -INFINITY;
#pragma unroll
    for (int i = 0; i < CMB_GROUPS; ++i) M = fmaxf(M, s_m[i]);
    const float c = Mg == -INFINITY ? 0.f : exp2f(Mg - M);
#pragma unroll
    for (int k = 0; k < VEC; ++k) num[k] *= c;
    den *= c;
#pragma unroll
    for (int k = 0; k < VEC; ++k) s_num[sg][lane * VEC + k] = num[k];
    if (lane == 0) s_den[sg] = den;
    __syncthreads();
    if (sg != 0) return;
#pragma unroll
    for (int i = 1; i < CMB_GROUPS; ++i) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) num[k] += s_num[i][lane * VEC + k];
        den += s_den[i];
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) store(d + k, num[k] / den);
}

template <int VEC>
__device__ __forceinline__ void attn_combine_body(const float* __restrict__ part_o, const float2* __restrict__ part_ml,
        int nrows, int HD, int T, int Hq, const int* __restrict__ meta, int meta_idx, int add, int kps,
        float* __restrict__ out_f32, bf16_t* __restrict__ out_bf16) {
    pdl_trigger(FAM_COMBINE);
    const int L = meta[meta_idx] + add;  // host-written: read before the wait
    pdl_wait(FAM_COMBINE);
    const int per_row = HD / (32 * VEC);
    const int r = blockIdx.x / per_row;
    const int qh = r / T, tok = r - qh * T;
    const size_t o = (size_t)tok * Hq * HD + (size_t)qh * HD;
    merge_row<VEC>(part_o, part_ml, nrows, HD, r, blockIdx.x - r * per_row, L, kps, [&](int d, float y) {
        if (out_f32 != nullptr) out_f32[o + d] = y;
        if (out_bf16 != nullptr) out_bf16[o + d] = f32_to_bf16(y);
    });
}
// attn_combine (one dim per thread: the decode's), attn_combine_v2 / _v4 (2 / 4 dims per thread, HD a multiple of
// 32 VEC: the prefill's, v4 for head_dim 128, v2 for 64)
#define COMBINE_KERNEL(NAME, VEC)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * CMB_GROUPS) NAME(const float* __restrict__ part_o,           \
            const float2* __restrict__ part_ml, int nrows, int HD, int T, int Hq, const int* __restrict__ meta,     \
            int meta_idx, int add, int kps, float* __restrict__ out_f32, bf16_t* __restrict__ out_bf16) {          \
        attn_combine_body<VEC>(part_o, part_ml, nrows, HD, T, Hq, meta, meta_idx, add, kps, out_f32, out_bf16);   \
    }
COMBINE_KERNEL(attn_combine, 1)
COMBINE_KERNEL(attn_combine_v2, 2)
COMBINE_KERNEL(attn_combine_v4, 4)

// The head-group kernels (the named fallback for G > PF_MAXG_* / DEC_MAXG), defined last so that the default kernels'
// PTX stays as it was without them.
ATTN_PREFILL_KERNEL(attn_prefill_hd128_hg, 128, 64 * PFG_MAXG_128, true)
ATTN_PREFILL_KERNEL(attn_prefill_hd64_hg, 64, 64 * PFG_MAXG_64, true)
ATTN_DECODE_KERNEL(attn_decode_hd128_hg, 128, attn_decode_body_hg)
ATTN_DECODE_KERNEL(attn_decode_hd64_hg, 64, attn_decode_body_hg)

// ---- the fleet's batched pass (issue 24; engine/cuda/fleet.py): one launch serves every member robot.
// Member r = blockIdx.z (prefill attention) / blockIdx.y (merge) reads its own record meta + r * meta_stride
// ([L, p0, T, n_ctx, bidirectional, base row, ..]: its keys, positions and rows), its own slot list
// key_slots + r * slots_stride (slots in its own region of one shared cache) and its own split partials
// (part_rows = splits x Hq x 32 rows each); its T query rows are rows base .. base + T - 1 of the pass's QKV output
// (the 32 - T rows after them are other members' or padding: computed, never stored). The bodies are the
// single-robot kernels' (no head groups: the fleet refuses models that need them).
#define ATTN_PREFILL_BATCH_KERNEL(NAME, HD, THREADS)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(const float* qkv, int ld, bf16_t* kc, bf16_t* vc,      \
            const int* key_slots, const int* meta, const float2* rope_cs, int G, int n_kvh, float qscale,           \
            float* part_o, float2* part_ml, int slots_stride, int meta_stride, int part_rows) {                    \
        __shared__ __align__(16) bf16_t sK[ATT_KC * (HD + 8)];                                                     \
        __shared__ __align__(16) bf16_t sVt[HD * (ATT_KC + 8)];                                                    \
        __shared__ int sSlot[ATT_KC];                                                                              \
        const int r = blockIdx.z;                                                                                  \
        meta += (size_t)r * meta_stride;                                                                           \
        attn_prefill_body<HD, false>(qkv + (size_t)meta[5] * ld, ld, kc, vc, key_slots + (size_t)r * slots_stride,  \
                                     meta, rope_cs, G, n_kvh, qscale, part_o + (size_t)r * part_rows * HD,          \
                                     part_ml + (size_t)r * part_rows, sK, sVt, sSlot);                              \
    }
ATTN_PREFILL_BATCH_KERNEL(attn_prefill_batch_hd128, 128, 64 * PF_MAXG_128)
ATTN_PREFILL_BATCH_KERNEL(attn_prefill_batch_hd64, 64, 64 * PF_MAXG_64)

// One decode step of every member (grid.z = member): attn_decode_core on its query (row base of the pass's QKV
// output: the q columns come first), its slot list and record (n_ctx = rec[3], step = the pass's decode step: L =
// n_ctx + step keys, the last one this step's own, stored by kv_store_rows just before) and its own partials
// ([split][Hq][HD] at part_rows rows per member). The prefill-shaped attention would stage and rotate the same keys
// for 32 query rows with 12 warps per block: measured, it made a decode step of 8 robots ~7 ms.
#define ATTN_DECODE_BATCH_KERNEL(NAME, HD)                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * DEC_WARPS) NAME(const float* qkv, int ld, const bf16_t* kc,   \
            const bf16_t* vc, const int* key_slots, const int* meta, int step, const float2* rope_cs, int G,        \
            int n_kvh, float qscale, float* part_o, float2* part_ml, int slots_stride, int meta_stride,             \
            int part_rows) {                                                                                       \
        __shared__ __align__(16) unsigned char smem[DecAttnSmem<HD>::BYTES];                                       \
        __shared__ int sSlot[ATT_KC];                                                                              \
        __shared__ float2 sQcs[HD / 2];                                                                            \
        __shared__ __align__(16) float sQ[DEC_MAXG * HD];                                                          \
        const int r = blockIdx.z;                                                                                  \
        meta += (size_t)r * meta_stride;                                                                           \
        attn_decode_core<HD, false>(qkv + (size_t)meta[5] * ld, kc, vc, key_slots + (size_t)r * slots_stride, meta, \
                                    step, rope_cs, G, n_kvh, qscale, part_o + (size_t)r * part_rows * HD,           \
                                    part_ml + (size_t)r * part_rows, smem, sSlot, sQcs, sQ);                        \
    }
ATTN_DECODE_BATCH_KERNEL(attn_decode_batch_hd128, 128)
ATTN_DECODE_BATCH_KERNEL(attn_decode_batch_hd64, 64)

// The merge of member blockIdx.y's partials (rows qh * T + token, T = 32 after the prefill-shaped attention, 1
// after the decode one) into attention rows base + token of the pass (bf16, the o_proj GEMM's input); only its
// rec[2] tokens are written (the block of a padding token returns before the merge's barriers: one block = one
// row). Keys: rec[0]. grid = (Hq * T * HD / (32 VEC), members).
template <int VEC>
__device__ __forceinline__ void attn_combine_batch_body(const float* __restrict__ part_o,
        const float2* __restrict__ part_ml, int HD, int Hq, int T, const int* __restrict__ meta, int meta_stride,
        int kps, int part_rows, bf16_t* __restrict__ out_bf16) {
    pdl_trigger(FAM_COMBINE);
    const int* rec = meta + (size_t)blockIdx.y * meta_stride;
    const int L = rec[0], rows = rec[2], base = rec[5];  // host-written: read before the wait
    const int per_row = HD / (32 * VEC);
    const int r = blockIdx.x / per_row;
    const int qh = r / T, tok = r - qh * T;
    if (tok >= rows) return;  // uniform over the block
    pdl_wait(FAM_COMBINE);
    part_o += (size_t)blockIdx.y * part_rows * HD;
    part_ml += (size_t)blockIdx.y * part_rows;
    const size_t o = (size_t)(base + tok) * Hq * HD + (size_t)qh * HD;
    merge_row<VEC>(part_o, part_ml, Hq * T, HD, r, blockIdx.x - r * per_row, L, kps, [&](int d, float y) {
        out_bf16[o + d] = f32_to_bf16(y);
    });
}
#define COMBINE_BATCH_KERNEL(NAME, VEC)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * CMB_GROUPS) NAME(const float* __restrict__ part_o,           \
            const float2* __restrict__ part_ml, int HD, int Hq, int T, const int* __restrict__ meta,                \
            int meta_stride, int kps, int part_rows, bf16_t* __restrict__ out_bf16) {                             \
        attn_combine_batch_body<VEC>(part_o, part_ml, HD, Hq, T, meta, meta_stride, kps, part_rows, out_bf16);    \
    }
COMBINE_BATCH_KERNEL(attn_combine_batch, 1)
COMBINE_BATCH_KERNEL(attn_combine_batch_v2, 2)
COMBINE_BATCH_KERNEL(attn_combine_batch_v4, 4)

// What the host reads from the compiled module (engine/cuda/kernels.py LAUNCH_CONSTANTS), in this order.
__constant__ int vla_launch[8] = {ATT_KC, DEC_WARPS, DEC_MAXG, CMB_GROUPS, PF_MAXG_128, PF_MAXG_64, PFG_MAXG_128,
                                  PFG_MAXG_64};
