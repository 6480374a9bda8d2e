// Weight types of the decode GEMVs and prefill GEMMs (issue 23): where a row's bytes are and how they become
// numbers, so one kernel body serves bf16 weights and the quantised codes of engine/quant.py.
//
//   WBf16  bf16 weights.
//   WInt8  int8 codes q in [-127, 127], one float32 scale s per output row: w = q * s.
//   WFp8   e4m3fn codes (bit patterns, no NaN), one float32 scale per row: w = e4m3(q) * s.
//   WInt4  4-bit codes q in [0, 15] packed two per byte (low nibble = even column), per row and group of 128
//          columns a float32 scale s and a uint8 zero point z: w = (q - z) * s.
// Every GEMV lane load is 16 bytes (8 bf16, 16 int8 / fp8, 32 int4 weights; 8 bytes, 16 int4 weights, under the
// GEMV_HALF_I4 knob); a GEMM lane takes 8 consecutive k values of a row (`raw_t`: 16, 8 or 4 bytes) and turns them
// into the 8 bf16 words the mma takes, bf16(w) rounded to nearest even. Per-row scales multiply a GEMV row's dot
// product once, at the end (RowQ::scale); int4's group scales multiply each lane load's partial dot (one load never
// crosses a group: 32 or 16 columns of an aligned 128).
// The kernels compute in float32 what the numpy oracle computes; they compare with a tolerance (float rounding).
//
// Integer -> float without the conversion unit (16 per SM per clock on sm_90, too few to keep up with the loads):
// a byte b placed as the low mantissa byte of 2^23 is the float 2^23 + b exactly (one PRMT), minus a constant.
// e4m3 -> bf16 by moving the 7 exponent/mantissa bits into place (the bias 7 read as bf16's 127: the value times
// 2^-120, subnormals included), then one bf16x2 FMA by 2^120 (exact: a power of two, normal results).
#pragma once
#include "common.cuh"

#define WT_GROUP 128  // int4 group along the input dimension (engine/quant.py GROUP_SIZE)
// Decode GEMV rows per warp (bf16: 2) and 16-byte loads per row in flight: a warp keeps the bytes of bf16's 2 x 6
// in flight whatever the width of a weight. With bf16's shape, an int8 row of 1536 columns is 3 loads per lane, the
// warp has half the bytes in flight, and the 7-pass int8 chunk measured 11.5 ms against bf16's 10.2 (H200).
// (-D overrides for measuring alternatives: the host reads the values back from gemv.cu's vla_launch)
#ifndef GEMV_RPW_I8
#define GEMV_RPW_I8 4
#endif
#ifndef GEMV_RPW_F8
#define GEMV_RPW_F8 4
#endif
#ifndef GEMV_RPW_I4
#define GEMV_RPW_I4 4
#endif
#define GEMV_U_FOR(RPW) ((12 + (RPW) - 1) / (RPW))  // loads per row in flight: 12 per lane over its RPW rows
// int4 takes 2 loads per row, not GEMV_U_FOR's 3: a 1536-column row is 1.5 loads of a warp, and the third slot's
// registers (16 bytes, a group's scale and zero point, per row) took the kernels to 173-181 registers, one block per
// SM; with 2 they fit 128, two blocks (H100, session 29: 7-pass int4 chunk 11.92 -> 10.57 ms; docs/KERNEL_NOTES.md)
#ifndef GEMV_U_I4
#define GEMV_U_I4 2
#endif
// int4 GEMV lane loads of 8 bytes (16 weights) instead of 16 (32), 3 per row in flight: a measuring knob (session 31,
// unmeasured). A 1536-column int4 row is 1.5 warp loads of 16 bytes, so half the lanes sit out the second load (their
// dot products issued all the same, under a branch); with 8-byte loads it is 3 whole loads, as an int8 row of 16.
#ifndef GEMV_HALF_I4
#define GEMV_HALF_I4 0
#endif
// int8 / int4 GEMV codes as denormal floats (a measuring knob, session 31, unmeasured): the code byte as a float's
// whole bit pattern is the denormal q 2^-149, so one PRMT and one FFMA a weight against x 2^100 (scaled in shared
// memory by the prologue, the products normal) where the default needs a third instruction, the FADD that removes
// the 2^23 bias. The zero point / int8's offset of 128 comes off once a load: minus z times the load's sum of x
// (computed once per load for all the warp's rows). FFMA takes denormal inputs at full rate (no -ftz here).
#ifndef GEMV_DENORM
#define GEMV_DENORM 0
#endif
#define GEMV_XS_SCALE 0x1p100f  // x's scale in shared memory (gemv_core.cuh's prologue)
// what a row's sum is multiplied by at the end: the denormal codes' 2^-149 and x's scale undone (2^49)
#define GEMV_XS_BACK (1.f / (GEMV_XS_SCALE * 0x1p-149f))

// byte i of a word as the denormal float byte x 2^-149 (GEMV_DENORM)
__device__ __forceinline__ float byte_den(uint32_t word, int i) {
    return __uint_as_float(__byte_perm(word, 0, 0x4440u + i));
}

// byte i of a word as the float 2^23 + byte (biased: the caller subtracts 2^23, or 2^23 + 128 for int8)
__device__ __forceinline__ float byte_plus_2p23(uint32_t word, int i) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540u + i));
}

// the code in byte i of a word for a GEMV dot product: byte - bias exactly (bias = 2^23 + the code offset), or under
// GEMV_DENORM (DEN) the denormal byte 2^-149, the offset then taken off once a load by the caller
template <bool DEN>
__device__ __forceinline__ float gemv_code(uint32_t word, int i, float bias) {
    if constexpr (DEN) return byte_den(word, i);
    else return byte_plus_2p23(word, i) - bias;
}

__device__ __forceinline__ uint2 ldg_stream8(const void* p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

__device__ __forceinline__ uint32_t ldg_stream4(const void* p) {
    uint32_t r;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

// four e4m3fn codes -> two bf16x2 words of their exact values: b02 = (code 0, code 2), b13 = (code 1, code 3)
__device__ __forceinline__ void e4m3x4_to_bf16(uint32_t q, uint32_t& b02, uint32_t& b13) {
    const uint32_t t13 = (q & 0x80008000u) | ((q >> 4) & 0x07F007F0u);         // codes 1, 3: value * 2^-120
    const uint32_t t02 = ((q << 8) & 0x80008000u) | ((q << 4) & 0x07F007F0u);  // codes 0, 2
    const uint32_t two120 = 0x7B807B80u, neg0 = 0x80008000u;                   // bf16x2 (2^120, 2^120), (-0, -0)
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(b02) : "r"(t02), "r"(two120), "r"(neg0));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(b13) : "r"(t13), "r"(two120), "r"(neg0));
}

// ---- the types. Each has: BITS per weight; EPL weights per 16-byte GEMV load; GEMV_RPW rows per warp and GEMV_U
// loads per row in flight; RowQ (a row's quantisation
// parameters, init from the kernel's scales / zeros arguments; scale(): what a GEMV row's dot product is multiplied
// by at the end), Q (those of the k range one load covers, at(rq, k), k counted from the RowQ's first column: int4's
// group; empty for the others); dot (a GEMV load's 16 bytes against x[0..EPL)); raw_t / load_raw / to_bf16x8 (a
// GEMM lane's 8 k values).

struct NoQ {
    __device__ __forceinline__ void init(const float*, const uint8_t*, int, int, int) {}
    __device__ __forceinline__ float scale() const { return 1.f; }
};

struct WBf16 {
    static constexpr int BITS = 16, EPL = 8, GEMV_RPW = 2, GEMV_U = 6;
    static constexpr bool XSUM = false;  // GEMV_DENORM's form (dot_xs against a scaled x and its load sums)
    typedef uint4 vec_t;  // a GEMV lane load
    typedef NoQ RowQ;
    struct Q {};
    __device__ static __forceinline__ Q at(const RowQ&, int) { return Q(); }
    __device__ static __forceinline__ float dot(const uint4& w, const float* x, Q) {
        const float4 a = *reinterpret_cast<const float4*>(x);
        const float4 b = *reinterpret_cast<const float4*>(x + 4);
        return dot8_bf16(w, a, b);
    }
    typedef uint4 raw_t;
    __device__ static __forceinline__ raw_t load_raw(const void* p) { return ldg_stream16(p); }
    __device__ static __forceinline__ uint4 to_bf16x8(const raw_t& r, const RowQ&, Q) { return r; }
};

// int8 / fp8: one float32 scale per row
struct RowScale {
    float s;
    __device__ __forceinline__ void init(const float* scales, const uint8_t*, int row, int, int) { s = scales[row]; }
    __device__ __forceinline__ float scale() const { return s; }
};

struct WInt8 {
    static constexpr int BITS = 8, EPL = 16, GEMV_RPW = GEMV_RPW_I8, GEMV_U = GEMV_U_FOR(GEMV_RPW_I8);
    static constexpr bool XSUM = GEMV_DENORM;
    typedef uint4 vec_t;
    typedef RowScale RowQ;
    struct Q {};  // the row's scale is all there is (RowQ)
    __device__ static __forceinline__ Q at(const RowQ&, int) { return Q(); }
    // sum q x over a load's 16 codes (the biased bytes q + 128 as gemv_code<DEN>: minus 2^23 + 128, or denormal)
    template <bool DEN>
    __device__ static __forceinline__ float codes_dot(const uint4& w, const float* x) {
        float s = 0.f;
        const uint32_t words[4] = {w.x ^ 0x80808080u, w.y ^ 0x80808080u, w.z ^ 0x80808080u, w.w ^ 0x80808080u};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float4 a = *reinterpret_cast<const float4*>(x + 4 * q);
            s = fmaf(gemv_code<DEN>(words[q], 0, 8388736.f), a.x, s);  // biased byte - (2^23 + 128) = q
            s = fmaf(gemv_code<DEN>(words[q], 1, 8388736.f), a.y, s);
            s = fmaf(gemv_code<DEN>(words[q], 2, 8388736.f), a.z, s);
            s = fmaf(gemv_code<DEN>(words[q], 3, 8388736.f), a.w, s);
        }
        return s;
    }
    __device__ static __forceinline__ float dot(const uint4& w, const float* x, Q) { return codes_dot<false>(w, x); }
    // GEMV_DENORM: sum (q + 128) x' - 128 xs', x' = x GEMV_XS_SCALE, xs' = the load's sum of x' (times 2^-149)
    __device__ static __forceinline__ float dot_xs(const uint4& w, const float* x, Q, float xs) {
        return fmaf(-__uint_as_float(128u), xs, codes_dot<true>(w, x));
    }
    typedef uint2 raw_t;
    __device__ static __forceinline__ raw_t load_raw(const void* p) { return ldg_stream8(p); }
    __device__ static __forceinline__ uint4 to_bf16x8(const raw_t& r, const RowQ& rq, Q) {
        const uint32_t lo = r.x ^ 0x80808080u, hi = r.y ^ 0x80808080u;
        const float s = rq.s, c = 8388736.f;
        uint4 o;
        o.x = cvt_bf16x2((byte_plus_2p23(lo, 0) - c) * s, (byte_plus_2p23(lo, 1) - c) * s);
        o.y = cvt_bf16x2((byte_plus_2p23(lo, 2) - c) * s, (byte_plus_2p23(lo, 3) - c) * s);
        o.z = cvt_bf16x2((byte_plus_2p23(hi, 0) - c) * s, (byte_plus_2p23(hi, 1) - c) * s);
        o.w = cvt_bf16x2((byte_plus_2p23(hi, 2) - c) * s, (byte_plus_2p23(hi, 3) - c) * s);
        return o;
    }
};

struct WFp8 {
    static constexpr int BITS = 8, EPL = 16, GEMV_RPW = GEMV_RPW_F8, GEMV_U = GEMV_U_FOR(GEMV_RPW_F8);
    static constexpr bool XSUM = false;
    typedef uint4 vec_t;
    typedef RowScale RowQ;
    struct Q {};
    __device__ static __forceinline__ Q at(const RowQ&, int) { return Q(); }
    __device__ static __forceinline__ float dot(const uint4& w, const float* x, Q) {
        float s = 0.f;
        const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float4 a = *reinterpret_cast<const float4*>(x + 4 * q);
            uint32_t b02, b13;
            e4m3x4_to_bf16(words[q], b02, b13);
            s = fmaf(bf16_lo(b02), a.x, s);
            s = fmaf(bf16_lo(b13), a.y, s);
            s = fmaf(bf16_hi(b02), a.z, s);
            s = fmaf(bf16_hi(b13), a.w, s);
        }
        return s;
    }
    typedef uint2 raw_t;
    __device__ static __forceinline__ raw_t load_raw(const void* p) { return ldg_stream8(p); }
    __device__ static __forceinline__ uint32_t scaled_pair(uint32_t pair, float s) {  // bf16x2 exact -> * s
        return cvt_bf16x2(bf16_lo(pair) * s, bf16_hi(pair) * s);
    }
    __device__ static __forceinline__ uint4 to_bf16x8(const raw_t& r, const RowQ& rq, Q) {
        uint32_t a02, a13, b02, b13;
        e4m3x4_to_bf16(r.x, a02, a13);
        e4m3x4_to_bf16(r.y, b02, b13);
        uint4 o;  // (k0, k1), (k2, k3), (k4, k5), (k6, k7): low halves then high halves of the pairs
        o.x = scaled_pair(__byte_perm(a02, a13, 0x5410u), rq.s);
        o.y = scaled_pair(__byte_perm(a02, a13, 0x7632u), rq.s);
        o.z = scaled_pair(__byte_perm(b02, b13, 0x5410u), rq.s);
        o.w = scaled_pair(__byte_perm(b02, b13, 0x7632u), rq.s);
        return o;
    }
};

// int4: a row's group scales and zero points, from its first column on (groups of WT_GROUP columns)
struct RowGroups {
    const float* s;
    const uint8_t* z;
    // col0: the first column the kernel's k counts from (a split-K range's start: a multiple of WT_GROUP)
    __device__ __forceinline__ void init(const float* scales, const uint8_t* zeros, int row, int K, int col0) {
        const int groups = (K + WT_GROUP - 1) / WT_GROUP;
        s = scales + (size_t)row * groups + col0 / WT_GROUP;
        z = zeros + (size_t)row * groups + col0 / WT_GROUP;
    }
    __device__ __forceinline__ float scale() const { return 1.f; }  // applied per load (WInt4::dot)
};

// one 32-bit word of int4 codes (8 columns: byte b = columns 2b, low nibble, and 2b + 1) against x[0..8), the codes
// as gemv_code<DEN> (zf = 2^23 + z; unused for DEN): the even columns' products go into de, the odd ones' into dodd
// (the same variable for one chain)
template <bool DEN = false>
__device__ __forceinline__ void int4_word_dot(uint32_t word, const float* x, float zf, float& de, float& dodd) {
    const uint32_t lo = word & 0x0F0F0F0Fu, hi = (word >> 4) & 0x0F0F0F0Fu;
    const float4 a = *reinterpret_cast<const float4*>(x);
    const float4 b = *reinterpret_cast<const float4*>(x + 4);
    de = fmaf(gemv_code<DEN>(lo, 0, zf), a.x, de);
    dodd = fmaf(gemv_code<DEN>(hi, 0, zf), a.y, dodd);
    de = fmaf(gemv_code<DEN>(lo, 1, zf), a.z, de);
    dodd = fmaf(gemv_code<DEN>(hi, 1, zf), a.w, dodd);
    de = fmaf(gemv_code<DEN>(lo, 2, zf), b.x, de);
    dodd = fmaf(gemv_code<DEN>(hi, 2, zf), b.y, dodd);
    de = fmaf(gemv_code<DEN>(lo, 3, zf), b.z, de);
    dodd = fmaf(gemv_code<DEN>(hi, 3, zf), b.w, dodd);
}

struct WInt4 {
    static constexpr bool XSUM = GEMV_DENORM;
#if GEMV_HALF_I4
    static_assert(!GEMV_DENORM, "GEMV_DENORM has the 16-byte int4 loads only");
    static constexpr int BITS = 4, EPL = 16, GEMV_RPW = GEMV_RPW_I4, GEMV_U = 3;
    typedef uint2 vec_t;
#else
    static constexpr int BITS = 4, EPL = 32, GEMV_RPW = GEMV_RPW_I4, GEMV_U = GEMV_U_I4;
    typedef uint4 vec_t;
#endif
    typedef RowGroups RowQ;
    // The zero point stays the loaded byte until a dot product or GEMM step uses it: a conversion here, next to its
    // load, made every group's load a round trip of its own (the warp waited for it before issuing the next row's
    // loads; ptxas keeps the wait inside each guarded load). zf(): 2^23 + z by one OR, (2^23 + q) - zf = q - z exactly.
    struct Q {
        float s;
        uint32_t z;
        __device__ __forceinline__ float zf() const { return __uint_as_float(0x4B000000u | z); }
    };
    __device__ static __forceinline__ Q at(const RowQ& rq, int k) {
        const int g = k / WT_GROUP;
        return Q{__ldg(rq.s + g), (uint32_t)__ldg(rq.z + g)};
    }
    __device__ static __forceinline__ float dot(const uint4& w, const float* x, Q q) {
        float d = 0.f;
        const float zf = q.zf();
        const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) int4_word_dot(words[j], x + 8 * j, zf, d, d);  // word j: columns 8j .. 8j + 7
        return d * q.s;
    }
    __device__ static __forceinline__ float dot(const uint2& w, const float* x, Q q) {  // GEMV_HALF_I4: 16 weights
        float d0 = 0.f, d1 = 0.f;  // two dependent chains of 8 instead of one of 16
        const float zf = q.zf();
        int4_word_dot(w.x, x, zf, d0, d1);
        int4_word_dot(w.y, x + 8, zf, d0, d1);
        return (d0 + d1) * q.s;
    }
    // GEMV_DENORM: (sum q x' - z xs') s, as WInt8::dot_xs (the zero point's denormal z 2^-149 against xs')
    __device__ static __forceinline__ float dot_xs(const uint4& w, const float* x, Q q, float xs) {
        float d = 0.f;
        const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) int4_word_dot<true>(words[j], x + 8 * j, 0.f, d, d);
        return fmaf(-__uint_as_float(q.z), xs, d) * q.s;
    }
    typedef uint32_t raw_t;
    __device__ static __forceinline__ raw_t load_raw(const void* p) { return ldg_stream4(p); }
    __device__ static __forceinline__ uint4 to_bf16x8(const raw_t& r, const RowQ&, Q q) {
        const uint32_t lo = r & 0x0F0F0F0Fu, hi = (r >> 4) & 0x0F0F0F0Fu;
        const float zf = q.zf();
        uint4 o;
        o.x = cvt_bf16x2((byte_plus_2p23(lo, 0) - zf) * q.s, (byte_plus_2p23(hi, 0) - zf) * q.s);
        o.y = cvt_bf16x2((byte_plus_2p23(lo, 1) - zf) * q.s, (byte_plus_2p23(hi, 1) - zf) * q.s);
        o.z = cvt_bf16x2((byte_plus_2p23(lo, 2) - zf) * q.s, (byte_plus_2p23(hi, 2) - zf) * q.s);
        o.w = cvt_bf16x2((byte_plus_2p23(lo, 3) - zf) * q.s, (byte_plus_2p23(hi, 3) - zf) * q.s);
        return o;
    }
};

// a row's weights from column k on (k a multiple of the load's width)
template <typename WT>
__device__ __forceinline__ const char* wrow(const void* W, int row, int K, int k) {
    return reinterpret_cast<const char*>(W) + ((size_t)row * K + k) * WT::BITS / 8;
}
