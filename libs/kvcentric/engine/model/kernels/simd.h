// The fp32 vector operations the kernels of this library are written in, one implementation per instruction set:
// AVX-512 (16 lanes, `__m512`) and AVX2 with FMA (8 lanes, `__m256`). A kernel body written once over `simd::vec`
// and `simd::LANES` compiles to either; where the compiler targets neither, KVC_SIMD is left undefined and the
// kernels take their scalar loops. It holds no kernel and no policy (how many rows or vectors a kernel keeps in
// registers is the kernel's choice, per LANES).
//
// KVC_AVX512_EMULATED (the `avx512-emulated` build, for tests only) takes the AVX-512 branch on a CPU without it:
// the same lines over SIMDe's portable `__m512` (avx512_emulated.h), 16 lanes, the kernels' 16-lane tiles.

#pragma once

#include <cstdint>

#if defined(__AVX512F__) || defined(KVC_AVX512_EMULATED)
#if defined(KVC_AVX512_EMULATED)
#include "avx512_emulated.h"
#else
#include <immintrin.h>
#endif
#define KVC_SIMD 16

namespace simd {

using vec = __m512;
constexpr int LANES = 16;
#if defined(KVC_AVX512_EMULATED)
constexpr const char* NAME = "avx512-emulated";
#else
constexpr const char* NAME = "avx512";
#endif

inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec set1(float x) { return _mm512_set1_ps(x); }
inline vec zero() { return _mm512_setzero_ps(); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(vec v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vec v) { return _mm512_reduce_max_ps(v); }
inline vec round_nearest(vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// Lanes [0, count) from p, `fill` in the others; nothing is read past p + count.
inline vec load_first(const float* p, int64_t count, float fill) {
    const __mmask16 keep = static_cast<__mmask16>(count >= 16 ? 0xffff : count <= 0 ? 0 : (1u << count) - 1);
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), keep, p);
}

// 2^n for whole-valued lanes n in [-126, 127], through the exponent bits.
inline vec pow2(vec whole) {
    const __m512i biased = _mm512_add_epi32(_mm512_cvtps_epi32(whole), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(biased, 23));
}

// v, with 0 in the lanes where x == y.
inline vec zero_where_equal(vec x, vec y, vec v) {
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(x, y, _CMP_EQ_OQ)), v);
}

// v, loaded into a register for the multiply-adds that share it (see AVX2's; here as the compiler chooses).
inline vec shared(vec v) { return v; }

}  // namespace simd

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVC_SIMD 8

namespace simd {

using vec = __m256;
constexpr int LANES = 8;
constexpr const char* NAME = "avx2";

inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec set1(float x) { return _mm256_set1_ps(x); }
inline vec zero() { return _mm256_setzero_ps(); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec round_nearest(vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// The eight lanes folded in halves (a tree, as AVX-512's reduction): 4 + 4, 2 + 2, 1 + 1.
inline float reduce_add(vec v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

inline float reduce_max(vec v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// Lanes [0, count) from p, `fill` in the others; nothing is read past p + count (a masked load does not touch
// the memory of the lanes it leaves out).
inline vec load_first(const float* p, int64_t count, float fill) {
    const int32_t clamped = static_cast<int32_t>(count < 0 ? 0 : count > 8 ? 8 : count);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(clamped), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, keep), _mm256_castsi256_ps(keep));
}

// 2^n for whole-valued lanes n in [-126, 127], through the exponent bits.
inline vec pow2(vec whole) {
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
}

// v, with 0 in the lanes where x == y.
inline vec zero_where_equal(vec x, vec y, vec v) { return _mm256_andnot_ps(_mm256_cmp_ps(x, y, _CMP_EQ_OQ), v); }

// v, loaded into a register for the multiply-adds that share it. GCC's tuning for AMD's Zen (-march=native there)
// otherwise folds the load into each of them, a load per multiply-add instead of one per vector: prefill ran
// 30-40% slower built with -march=native than with -march=x86-64-v3 on an EPYC (Zen 3). Where the registers are
// short (the small GEMM's tiles, decode's 2 x 8) the folded loads did as well or better.
inline vec shared(vec v) {
    asm("" : "+x"(v));
    return v;
}

}  // namespace simd
#endif

#if defined(KVC_SIMD)
namespace simd {

// e^d for d <= 0 (below -87, e^-87: what fp32 holds of it), to fp32's rounding: `kvc_exp_in_range`'s series
// (fast_exp.h) in registers, d log2 e = n + f/ln2 with n rounded to nearest.
inline vec exp_nonpositive(vec d) {
    const vec t = mul(max(d, set1(-87.f)), set1(1.4426950408889634f));
    const vec whole = round_nearest(t);
    const vec f = mul(sub(t, whole), set1(0.6931471805599453f));
    vec series = set1(1.f / 5040);
    series = fmadd(series, f, set1(1.f / 720));
    series = fmadd(series, f, set1(1.f / 120));
    series = fmadd(series, f, set1(1.f / 24));
    series = fmadd(series, f, set1(1.f / 6));
    series = fmadd(series, f, set1(0.5f));
    series = fmadd(series, f, set1(1.f));
    series = fmadd(series, f, set1(1.f));
    return mul(series, pow2(whole));
}

}  // namespace simd
#endif
