// A layer's small fp32 ops on the CPU, each one pass over its rows where torch makes two to eight: SwiGLU's
// silu(gate) x up, the rotary embedding of q and k together with the KV cache write, and RMSNorm. At 2048 rows of
// `small` torch spent about 21 ms a step in silu and its multiply and 12 ms in the rotary's multiplies, adds and
// the two index copies, each pass reading and writing the whole [tokens, width] tensor (docs/performance.md).
//
// Rows are split over the calling thread's OpenMP team (torch's own: libgomp is loaded once per process).
// The arithmetic is torch's: the rotary's x1 cos - x2 sin rounds each product before the difference (no fused
// multiply-add, so the cache holds the same bits as torch's ops would write), and silu is x / (1 + e^-x) with
// an e^x accurate to fp32's rounding (its last bit may differ from torch's vector exp).

// Without AVX-512's masked lanes GCC kept kvc_silu_mul's loop scalar: e^-x is taken only inside its range there,
// and under the default -ftrapping-math it may not compute a lane whose operations might trap and then drop it,
// so it did not turn the branch into a select (AVX2: silu x up 2.4x slower than torch's at 2048 rows). No trap
// is enabled here and the values are the same; AVX-512 builds (and the emulated one, which takes their branches)
// are left as they were.
// (Before the includes: an inline function compiled with other options is not inlined into these.)
#if defined(__GNUC__) && !defined(__clang__) && !defined(__AVX512F__) && !defined(KVC_AVX512_EMULATED)
#pragma GCC optimize("no-trapping-math")
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__clang__)
#define KVC_NO_CONTRACT
#define KVC_NO_CONTRACT_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define KVC_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#define KVC_NO_CONTRACT_BODY
#else
#define KVC_NO_CONTRACT
#define KVC_NO_CONTRACT_BODY
#endif

#include "fast_exp.h"

extern "C" {

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i] for rows of `row_stride` elements; out is
// [rows, width], contiguous. fp32 only.
void kvc_silu_mul(const float* gate_up, int64_t row_stride, float* out, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static) if (rows * width >= 32768)
    for (int64_t r = 0; r < rows; ++r) {
        const float* gate = gate_up + r * row_stride;
        const float* up = gate + width;
        float* dst = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
            const float x = gate[i];
            const float minus = -x;
            // e^-x overflows to inf past 88.72 (silu is then -0, as torch gives); below -87.3 it is 0 to fp32
            const float e = minus > 88.72283f ? INFINITY : (minus < -87.3f ? 0.f : kvc_exp_in_range(minus));
            const float silu = x / (1.f + e);
            dst[i] = silu * up[i];
        }
    }
}

// The rotary embedding of q and k in one pass, with the cache write: qkv is [tokens, heads + 2 kv_heads,
// head_dim] (row stride `qkv_row`, heads contiguous); position p rotates each head's halves as
// (x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin the first halves of row p of the [max_position, table_row]
// tables. Rotated q and k go to out ([tokens, heads + kv_heads, head_dim], contiguous); the rotated k and the
// v of token t also go to row slots[t] of k_cache / v_cache ([cache_rows, kv_heads, head_dim], contiguous).
// Returns 0, or -1 (nothing written) when a position is past the tables' `table_rows` or a slot past the cache.
KVC_NO_CONTRACT int kvc_rotate_store(const float* qkv, int64_t qkv_row, const float* cos_table,
                                      const float* sin_table, int64_t table_row, const int64_t* positions,
                                      const int64_t* slots, float* k_cache, float* v_cache, float* out,
                                      int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                      int64_t table_rows, int64_t cache_rows) {
    KVC_NO_CONTRACT_BODY
    for (int64_t t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= table_rows || slots[t] < 0 || slots[t] >= cache_rows) return -1;
    const int64_t half = head_dim / 2, rotated = heads + kv_heads, slot_row = kv_heads * head_dim;
#pragma omp parallel for schedule(static) if (tokens * rotated * head_dim >= 32768)
    for (int64_t t = 0; t < tokens; ++t) {
        const float* c = cos_table + positions[t] * table_row;
        const float* s = sin_table + positions[t] * table_row;
        const float* row = qkv + t * qkv_row;
        float* dst = out + t * rotated * head_dim;
        for (int64_t h = 0; h < rotated; ++h) {
            const float* x1 = row + h * head_dim;
            const float* x2 = x1 + half;
            float* first = dst + h * head_dim;
            float* second = first + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i] * c[i], b = x2[i] * s[i];
                first[i] = a - b;
                const float d = x2[i] * c[i], e = x1[i] * s[i];
                second[i] = d + e;
            }
        }
        std::memcpy(k_cache + slots[t] * slot_row, dst + heads * head_dim, slot_row * sizeof(float));
        std::memcpy(v_cache + slots[t] * slot_row, row + rotated * head_dim, slot_row * sizeof(float));
    }
    return 0;
}

// RMSNorm of rows of `width` (row stride x_row, contiguous within a row): out[r, i] = x[r, i] * (1 / sqrt(mean of
// x[r]'s squares + eps)) * weight[i], the products in torch's order; out is [rows, width], contiguous. torch's CPU
// rms_norm is a composite of five ops (square, mean, add, rsqrt, two multiplies), each a pass over the rows and a
// dispatch: 31 us a call at 32 rows of `small`, 17 calls a decode step. The sum of squares is added in another
// order than torch's vectorized mean, so the result may differ from torch's in the last bit.
void kvc_rms_norm(const float* x, int64_t x_row, const float* weight, float* out, int64_t rows, int64_t width,
                  float eps) {
#pragma omp parallel for schedule(static) if (rows * width >= 65536)
    for (int64_t r = 0; r < rows; ++r) {
        const float* src = x + r * x_row;
        float* dst = out + r * width;
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; ++i) squares += src[i] * src[i];
        const float scale = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) dst[i] = src[i] * scale * weight[i];
    }
}

// A structured output's grammar masks applied to a block of sampling logits in place, read straight from the packed
// bitmask llguidance writes (bit t of a row's 32-bit words set: token t allowed): logits[r, t] = -inf for each token
// its mask refuses. `slots[r]` is the bitmask row of logits row r (-1: not guided, left alone); null slots: row r
// is bitmask row r. In torch this was four calls (unpack the bits, wrap them, select the block's rows, a `where`)
// of 5-10 us each in a decode step, for a few hundred bytes of work (docs/performance-notebook.md, issue 45).
void kvc_refuse_masked(float* logits, int64_t row_stride, const uint32_t* words, int64_t words_per_row,
                       const int64_t* slots, int64_t rows, int64_t vocab) {
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slots == nullptr ? r : slots[r];
        if (slot < 0) continue;
        const uint32_t* mask = words + slot * words_per_row;
        float* row = logits + r * row_stride;
        for (int64_t start = 0; start < vocab; start += 32) {
            const uint32_t word = mask[start >> 5];
            if (word == 0xFFFFFFFFu) continue;
            const int64_t end = vocab - start < 32 ? vocab - start : 32;
            for (int64_t bit = 0; bit < end; ++bit) {
                if (!((word >> bit) & 1u)) row[start + bit] = -INFINITY;
            }
        }
    }
}

}
