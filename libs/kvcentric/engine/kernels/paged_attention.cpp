// Decode attention over the paged KV cache, read where it lies: one query token per sequence attends to
// its own slots through its block table, with no gathered copy of the keys and values (what
// `gather_blocks` + SDPA does costs a copy of every key and value each layer, and reads them twice).
//
// q:       [batch, heads, head_dim], row stride `q_row` elements (heads contiguous, head_dim contiguous)
// cache:   [slots, kv_heads, head_dim] per layer (slot = block * block_size + offset), keys and values
// tables:  [batch, max_blocks] int64 block tables; lengths: [batch] int64 context lengths (the new token
//          included); window > 0: only the last `window` positions are attended (sliding window)
// out:     [batch, heads, head_dim], contiguous
//
// Each (sequence, kv head) is one work item for the OpenMP team of the calling thread (torch's own team:
// libgomp is loaded once per process). Scores, softmax and sums are fp32; bf16 is read and written as its
// upper 16 bits of an fp32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
        *dst = static_cast<uint16_t>((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
    *dst = static_cast<uint16_t>(bits >> 16);
}

// A row as fp32: fp32 rows are read in place, bf16 rows widened into `scratch`.
inline const float* widen(const float* src, float*, int64_t) { return src; }
inline const float* widen(const uint16_t* src, float* scratch, int64_t size) {
    for (int64_t d = 0; d < size; ++d) scratch[d] = to_float(src[d]);
    return scratch;
}

template <typename T>
void decode_attention(const T* q, int64_t q_row, const T* k_cache, const T* v_cache, const int64_t* tables,
                      int64_t max_blocks, const int64_t* lengths, T* out, int64_t batch, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t window, float scale) {
    const int64_t group = heads / kv_heads;
    const int64_t slot_stride = kv_heads * head_dim;
    // A work item is a sequence's run of `span` kv heads: with enough sequences all of a slot's heads (one
    // contiguous row of the cache) are read together; with few, the heads are split so every thread works.
    const int64_t span = batch >= 8 ? kv_heads : 1;
    const int64_t spans = kv_heads / span;
    const int64_t items = batch * spans;
    const int64_t width = span * head_dim;  // elements of one slot's row an item reads
    const int64_t rows = span * group;      // query heads of one item
#pragma omp parallel
    {
        std::vector<float> query(rows * head_dim), acc(rows * head_dim), scores, row(width);
        std::vector<float> top(rows), total(rows);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t b = item / spans, first_head = (item % spans) * span;
            const int64_t length = lengths[b];
            const int64_t first = window > 0 && length > window ? length - window : 0;
            const int64_t n = length - first;
            const int64_t* table = tables + b * max_blocks;
            scores.resize(rows * n);
            for (int64_t r = 0; r < rows; ++r) {
                const T* src = q + b * q_row + (first_head * group + r) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) query[r * head_dim + d] = to_float(src[d]) * scale;
                top[r] = -INFINITY;
            }
            for (int64_t t = first; t < length;) {  // scores, a block at a time; each key read once
                const int64_t offset = t % block_size;
                const int64_t run = std::min(block_size - offset, length - t);
                const T* keys = k_cache + (table[t / block_size] * block_size + offset) * slot_stride
                                + first_head * head_dim;
                for (int64_t i = 0; i < run; ++i) {
                    const float* key = widen(keys + i * slot_stride, row.data(), width);
                    for (int64_t r = 0; r < rows; ++r) {
                        const float* qr = query.data() + r * head_dim;
                        const float* kr = key + (r / group) * head_dim;
                        float s = 0.f;
#pragma omp simd reduction(+ : s)
                        for (int64_t d = 0; d < head_dim; ++d) s += qr[d] * kr[d];
                        scores[r * n + (t + i - first)] = s;
                        top[r] = s > top[r] ? s : top[r];
                    }
                }
                t += run;
            }
            for (int64_t r = 0; r < rows; ++r) {
                float sum = 0.f;
                float* sr = scores.data() + r * n;
                for (int64_t i = 0; i < n; ++i) {
                    sr[i] = std::exp(sr[i] - top[r]);
                    sum += sr[i];
                }
                total[r] = sum;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t t = first; t < length;) {  // values, likewise
                const int64_t offset = t % block_size;
                const int64_t run = std::min(block_size - offset, length - t);
                const T* values = v_cache + (table[t / block_size] * block_size + offset) * slot_stride
                                  + first_head * head_dim;
                for (int64_t i = 0; i < run; ++i) {
                    const float* value = widen(values + i * slot_stride, row.data(), width);
                    for (int64_t r = 0; r < rows; ++r) {
                        const float p = scores[r * n + (t + i - first)];
                        const float* vr = value + (r / group) * head_dim;
                        float* ar = acc.data() + r * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; ++d) ar[d] += p * vr[d];
                    }
                }
                t += run;
            }
            for (int64_t r = 0; r < rows; ++r) {
                T* dst = out + (b * heads + first_head * group + r) * head_dim;
                const float inverse = 1.f / total[r];
                for (int64_t d = 0; d < head_dim; ++d) store(dst + d, acc[r * head_dim + d] * inverse);
            }
        }
    }
}

}  // namespace

extern "C" {

int kvc_kernels_version() { return 1; }

// dtype: 0 = float32, 1 = bfloat16. Returns 0, or -1 for a shape it does not take.
int kvc_paged_decode_attention(int dtype, const void* q, int64_t q_row, const void* k_cache, const void* v_cache,
                               const int64_t* tables, int64_t max_blocks, const int64_t* lengths, void* out,
                               int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                               int64_t window, float scale) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || block_size <= 0 || head_dim <= 0) return -1;
    if (dtype == 0) {
        decode_attention(static_cast<const float*>(q), q_row, static_cast<const float*>(k_cache),
                         static_cast<const float*>(v_cache), tables, max_blocks, lengths, static_cast<float*>(out),
                         batch, heads, kv_heads, head_dim, block_size, window, scale);
    } else if (dtype == 1) {
        decode_attention(static_cast<const uint16_t*>(q), q_row, static_cast<const uint16_t*>(k_cache),
                         static_cast<const uint16_t*>(v_cache), tables, max_blocks, lengths,
                         static_cast<uint16_t*>(out), batch, heads, kv_heads, head_dim, block_size, window, scale);
    } else {
        return -1;
    }
    return 0;
}

}
