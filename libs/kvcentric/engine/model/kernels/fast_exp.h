// e^x for x in [-87.3, 88.7] in plain arithmetic the compiler vectorizes, shared by the kernels of this
// library: x = (n + f) ln2 with |f| <= 1/2, 2^f by its Taylor series to the 7th power (relative error ~2e-8,
// under fp32's rounding), 2^n in the exponent bits. n is rounded to nearest (even) by the 1.5 * 2^23 trick,
// exact for |x log2 e| < 2^22. Callers clamp x into range (and say what -inf or overflow gives).

#pragma once

#include <cstdint>
#include <cstring>

inline float kvc_exp_in_range(float x) {
    const float t = x * 1.4426950408889634f;
    const float n = (t + 12582912.f) - 12582912.f;
    const float f = (t - n) * 0.6931471805599453f;
    const float series =
        1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720 + f * (1.f / 5040)))))));
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return series * scale;
}
