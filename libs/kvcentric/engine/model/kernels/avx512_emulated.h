// AVX-512 under its own names (`__m512`, `__mmask16`, `_mm512_*`) on a CPU without it, for simd.h's 16-lane branch
// in the `avx512-emulated` build (KVC_AVX512_EMULATED, `isas.EMULATED`): SIMDe's portable implementations
// (SIMD Everywhere, header-only: `apt-get install libsimde-dev`, or a clone of it on CPATH) with its native
// aliases, so the kernels' AVX-512 source lines, their 16 lanes and their register tiles compile and run where
// only AVX2 does. It is a way to test that code, not a speed option: each `__m512` operation is two of AVX2's or
// a loop over lanes.
//
// What the SIMDe of Debian 12 (0.7.4) lacks is written below to Intel's pseudo-code, over SIMDe's public functions:
// the masked load and the conversion only where SIMDe has not defined them itself (newer versions do), the two
// reductions always, in Intel's tree (halves of 8, 4, 2, 1: what GCC's and Clang's `_mm512_reduce_*_ps` compute),
// so that a reduction gives the hardware's bits where a SIMDe that has them may add the lanes in another order.

#pragma once

#if !defined(SIMDE_ENABLE_NATIVE_ALIASES)
#define SIMDE_ENABLE_NATIVE_ALIASES
#endif
#include <simde/x86/avx512.h>

#include <cmath>
#include <cstdint>

#if defined(SIMDE_X86_AVX512F_NATIVE)
#error "KVC_AVX512_EMULATED: this compiler targets AVX-512 itself; build `avx512` instead"
#endif

namespace kvc_emulated {

// The sum (or maximum) of the 16 lanes in Intel's tree: lane j with lane j + 8, then j + 4, j + 2, j + 1.
inline float reduce_add_ps(simde__m512 v) {
    float lanes[16];
    simde_mm512_storeu_ps(lanes, v);
    for (int half = 8; half >= 1; half /= 2)
        for (int j = 0; j < half; ++j) lanes[j] = lanes[j] + lanes[j + half];
    return lanes[0];
}

inline float reduce_max_ps(simde__m512 v) {
    float lanes[16];
    simde_mm512_storeu_ps(lanes, v);
    for (int half = 8; half >= 1; half /= 2)
        for (int j = 0; j < half; ++j) lanes[j] = lanes[j] > lanes[j + half] ? lanes[j] : lanes[j + half];
    return lanes[0];
}

// Lane i from p[i] where bit i of k is set, else src's; the memory of the lanes left out is not read.
inline simde__m512 mask_loadu_ps(simde__m512 src, simde__mmask16 k, const void* p) {
    float lanes[16];
    simde_mm512_storeu_ps(lanes, src);
    const float* from = static_cast<const float*>(p);
    for (int i = 0; i < 16; ++i)
        if ((k >> i) & 1) lanes[i] = from[i];
    return simde_mm512_loadu_ps(lanes);
}

// Each lane rounded to a whole number in the current rounding mode (to nearest even unless changed), as int32;
// NaN and what int32 does not hold give 0x80000000, the "integer indefinite".
inline simde__m512i cvtps_epi32(simde__m512 v) {
    float lanes[16];
    int32_t whole[16];
    simde_mm512_storeu_ps(lanes, v);
    for (int i = 0; i < 16; ++i) {
        const float rounded = std::nearbyint(lanes[i]);
        whole[i] = rounded >= -2147483648.f && rounded < 2147483648.f ? static_cast<int32_t>(rounded) : INT32_MIN;
    }
    return simde_mm512_loadu_si512(whole);
}

}  // namespace kvc_emulated

#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps(v) kvc_emulated::reduce_add_ps(v)
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps(v) kvc_emulated::reduce_max_ps(v)
#if !defined(_mm512_mask_loadu_ps)
#define _mm512_mask_loadu_ps(src, k, p) kvc_emulated::mask_loadu_ps(src, k, p)
#endif
#if !defined(_mm512_cvtps_epi32)
#define _mm512_cvtps_epi32(v) kvc_emulated::cvtps_epi32(v)
#endif
