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
// upper 16 bits of an fp32. The inner loops are written once over simd.h's vectors (AVX-512 or AVX2), their
// register tiles sized per instruction set; without either, scalar loops.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fast_exp.h"
#include "simd.h"

namespace {

#if defined(KVC_SIMD)
using simd::vec;
constexpr int LANES = simd::LANES;
// A decode item's weighed values, in registers: two query rows x WEIGH_VECTORS vectors of the head a pass over the
// values (2 x 8 accumulators: a head of up to 128 in one pass with AVX-512, 64 with AVX2, whose sixteen registers
// then spill a few, yet ran 5-25% faster than passes of 4 or 6 vectors). An odd last row of a group is computed
// twice as a pair with itself (AVX-512, as written and measured there) or alone (AVX2: 10-15% faster at group 1).
constexpr int WEIGH_VECTORS = 8;
constexpr bool ODD_ROW_ALONE = LANES == 8;
#endif

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

// visit(i, slot) for positions first..length-1 of a sequence (i counted from `first`), `slot` pointing at the
// position's row of `cache` plus `column`: a block at a time, so no division per position. With `prefetch` bytes,
// each position's row of the next block (that many bytes from `column`) is prefetched as the position is visited:
// a block's rows lie together but the blocks anywhere, so the hardware's prefetcher stops at every block's end,
// and without it a layer's KV came in from memory at half the rate this CPU reads it at (docs/performance.md).
template <typename T, typename Visit>
inline void each_slot(const T* cache, const int64_t* table, int64_t block_size, int64_t slot_stride, int64_t column,
                      int64_t first, int64_t length, Visit&& visit, int64_t prefetch = 0) {
    const int64_t last_block = (length - 1) / block_size;
    for (int64_t t = first; t < length;) {
        const int64_t block = t / block_size, offset = t % block_size;
        const int64_t run = std::min(block_size - offset, length - t);
        const T* slots = cache + (table[block] * block_size + offset) * slot_stride + column;
        const char* next = prefetch > 0 && block < last_block
            ? reinterpret_cast<const char*>(cache + (table[block + 1] * block_size + offset) * slot_stride + column)
            : nullptr;
        for (int64_t i = 0; i < run; ++i) {
            if (next != nullptr)
                for (int64_t byte = 0; byte < prefetch; byte += 64)
                    __builtin_prefetch(next + i * slot_stride * static_cast<int64_t>(sizeof(T)) + byte, 0, 3);
            visit(t + i - first, slots + i * slot_stride);
        }
        t += run;
    }
}

// The dot product of two fp32 rows. With vectors and whole ones, the partial sums are added in a tree
// (`simd::reduce_add`) where the compiler's loop added its lanes one after another: one decode score is one such
// product, so that chain was most of the kernel's time with its KV in cache.
inline float dot(const float* a, const float* b, int64_t size) {
#if defined(KVC_SIMD)
    if (size % LANES == 0 && size > 0) {
        vec acc = simd::mul(simd::load(a), simd::load(b));
        for (int64_t d = LANES; d < size; d += LANES) acc = simd::fmadd(simd::load(a + d), simd::load(b + d), acc);
        return simd::reduce_add(acc);
    }
#endif
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < size; ++d) s += a[d] * b[d];
    return s;
}

// x[i] = e^(x[i] - shift) for x[i] <= shift, returning their sum, in one vectorized loop (what std::exp called
// once per score cost the decode kernel a fifth of its time).
inline float exp_shifted(float* x, int64_t count, float shift) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < count; ++i) {
        x[i] = kvc_exp_in_range(std::max(x[i] - shift, -87.f));
        sum += x[i];
    }
    return sum;
}

#if defined(KVC_SIMD)
// acc[r] = sum_i p[r][i] value_i for ROWS (1 or 2) query rows of one kv head over V vectors of the head from
// `column`, their accumulators in registers across every position, each value vector loaded once for the rows.
template <int ROWS, int V>
inline void weigh_rows(const float* v_cache, const int64_t* table, int64_t block_size, int64_t slot_stride,
                       int64_t column, int64_t first, int64_t length, const float* p0, const float* p1, float* acc0,
                       float* acc1) {
    static_assert(ROWS == 1 || ROWS == 2, "one row or two");
    vec a[ROWS][V];
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < V; ++c) a[r][c] = simd::zero();
    const float* p[2] = {p0, p1};
    each_slot(v_cache, table, block_size, slot_stride, column, first, length, [&](int64_t i, const float* slot) {
        vec w[ROWS];
        for (int r = 0; r < ROWS; ++r) w[r] = simd::set1(p[r][i]);
        for (int c = 0; c < V; ++c) {
            const vec v = simd::load(slot + LANES * c);  // not `shared`: AVX2's 2 x 8 would spill (10-20% slower)
            for (int r = 0; r < ROWS; ++r) a[r][c] = simd::fmadd(w[r], v, a[r][c]);
        }
    }, V * LANES * static_cast<int64_t>(sizeof(float)));
    float* acc[2] = {acc0, acc1};
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < V; ++c) simd::store(acc[r] + LANES * c, a[r][c]);
}

static_assert(WEIGH_VECTORS == 8, "weigh_rows_of switches over 1 .. 8 vectors");

// weigh_rows over `vectors` (1 .. WEIGH_VECTORS) vectors. A switch: a chain of templates calling the next cost
// AVX-512's loops two more instructions a position.
template <int ROWS>
inline void weigh_rows_of(int64_t vectors, const float* v_cache, const int64_t* table, int64_t block_size,
                          int64_t slot_stride, int64_t column, int64_t first, int64_t length, const float* p0,
                          const float* p1, float* acc0, float* acc1) {
    if (vectors < 1 || vectors > WEIGH_VECTORS) __builtin_unreachable();
#define KVC_WEIGH(V) \
    weigh_rows<ROWS, V>(v_cache, table, block_size, slot_stride, column, first, length, p0, p1, acc0, acc1)
    switch (vectors) {
        case 1: KVC_WEIGH(1); break;
        case 2: KVC_WEIGH(2); break;
        case 3: KVC_WEIGH(3); break;
        case 4: KVC_WEIGH(4); break;
        case 5: KVC_WEIGH(5); break;
        case 6: KVC_WEIGH(6); break;
        case 7: KVC_WEIGH(7); break;
        default: KVC_WEIGH(8);
    }
#undef KVC_WEIGH
}
#endif

// The weighed values of a decode item ([rows][head_dim] into acc, rows of kv head h being h * group ..) kept in
// registers per pair of rows, WEIGH_VECTORS vectors of the head a pass (fp32, head_dim up to 128 in whole
// vectors); false where it does not apply (the caller's loop, which adds into acc in memory at every position,
// then runs). An odd last row of a group is computed twice (as a pair with itself), or alone with
// ODD_ROW_ALONE.
template <typename T>
inline bool weigh_values(const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*,
                         int64_t, int64_t, int64_t, int64_t, float*) {
    return false;
}

#if defined(KVC_SIMD)
template <>
inline bool weigh_values<float>(const float* v_cache, const int64_t* table, int64_t block_size, int64_t slot_stride,
                                int64_t column, int64_t first, int64_t length, const float* scores, int64_t n,
                                int64_t group, int64_t span, int64_t head_dim, float* acc) {
    if (head_dim % LANES != 0 || head_dim > 128 || head_dim == 0) return false;
    for (int64_t h = 0; h < span; ++h) {
        for (int64_t g = 0; g < group; g += 2) {
            const bool pair = g + 1 < group;
            const int64_t r0 = h * group + g, r1 = pair ? r0 + 1 : r0;
            const float *p0 = scores + r0 * n, *p1 = scores + r1 * n;
            for (int64_t d0 = 0; d0 < head_dim; d0 += WEIGH_VECTORS * LANES) {
                const int64_t vectors = std::min<int64_t>(WEIGH_VECTORS, (head_dim - d0) / LANES);
                const int64_t at = column + h * head_dim + d0;
                if (ODD_ROW_ALONE && !pair)
                    weigh_rows_of<1>(vectors, v_cache, table, block_size, slot_stride, at, first, length, p0, p1,
                                     acc + r0 * head_dim + d0, acc + r1 * head_dim + d0);
                else
                    weigh_rows_of<2>(vectors, v_cache, table, block_size, slot_stride, at, first, length, p0, p1,
                                     acc + r0 * head_dim + d0, acc + r1 * head_dim + d0);
            }
        }
    }
    return true;
}
#endif

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
            const int64_t column = first_head * head_dim;
            each_slot(k_cache, table, block_size, slot_stride, column, first, length, [&](int64_t i, const T* slot) {
                const float* key = widen(slot, row.data(), width);  // each key read once for every row
                for (int64_t r = 0; r < rows; ++r) {
                    const float* qr = query.data() + r * head_dim;
                    const float* kr = key + (r / group) * head_dim;
                    const float s = dot(qr, kr, head_dim);
                    scores[r * n + i] = s;
                    top[r] = s > top[r] ? s : top[r];
                }
            }, width * static_cast<int64_t>(sizeof(T)));
            for (int64_t r = 0; r < rows; ++r) total[r] = exp_shifted(scores.data() + r * n, n, top[r]);
            if (!weigh_values(v_cache, table, block_size, slot_stride, column, first, length, scores.data(), n, group,
                              span, head_dim, acc.data())) {
                std::fill(acc.begin(), acc.end(), 0.f);
                each_slot(v_cache, table, block_size, slot_stride, column, first, length, [&](int64_t i, const T* slot) {
                    const float* value = widen(slot, row.data(), width);  // likewise each value
                    for (int64_t r = 0; r < rows; ++r) {
                        const float p = scores[r * n + i];
                        const float* vr = value + (r / group) * head_dim;
                        float* ar = acc.data() + r * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; ++d) ar[d] += p * vr[d];
                    }
                });
            }
            for (int64_t r = 0; r < rows; ++r) {
                T* dst = out + (b * heads + first_head * group + r) * head_dim;
                const float inverse = 1.f / total[r];
                for (int64_t d = 0; d < head_dim; ++d) store(dst + d, acc[r * head_dim + d] * inverse);
            }
        }
    }
}


constexpr int64_t TILE_KEYS = 64;     // keys per tile
constexpr int64_t TILE_QUERIES = 64;  // query positions per work item
constexpr int64_t HEAD_STEP = 16;     // prefill takes a head_dim that is a multiple of this (whole vectors)
#if defined(KVC_SIMD)
static_assert(TILE_KEYS % LANES == 0 && HEAD_STEP % LANES == 0, "a key tile and a head are whole vectors");
constexpr int TILE_VECTORS = TILE_KEYS / LANES;
// The register tiles of prefill, 4 query rows x: SCORE_VECTORS vectors of a key tile's scores (AVX-512: the whole
// tile, 4 x 4 accumulators + 4 keys; AVX2: a quarter, 4 x 2 + 2), VALUE_VECTORS vectors of head_dim accumulated
// (AVX-512: 4 x 4 + 4 values; AVX2: 4 x 2 + 2, within 5% of 4 x 3 and 4 x 4 at heads of 48 to 128).
constexpr int SCORE_VECTORS = LANES == 16 ? 4 : 2;
constexpr int VALUE_VECTORS = LANES == 16 ? 4 : 2;
static_assert(TILE_VECTORS % SCORE_VECTORS == 0, "a key tile is whole register tiles of scores");
#endif

// e^x of a tile's scores (all <= 0), -inf giving 0.
inline void exp_tile(const float* x, float* y) {
#pragma omp simd
    for (int64_t j = 0; j < TILE_KEYS; ++j) y[j] = x[j] == -INFINITY ? 0.f : kvc_exp_in_range(std::max(x[j], -87.f));
}

#if defined(KVC_SIMD)
// Scores of four query rows against keys j0 .. j0 + V LANES - 1 of a key tile ([d][j]): the 4 x V vectors of
// scores in registers, each key vector loaded once for the four rows.
template <int V>
inline void scores_of_four_at(const float* query, int64_t head_dim, const float* keys, float* out, int64_t j0) {
    vec s[4][V];
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < V; ++c) s[r][c] = simd::zero();
    for (int64_t d = 0; d < head_dim; ++d) {
        const float* kd = keys + d * TILE_KEYS + j0;
        vec k[V];
        for (int c = 0; c < V; ++c) k[c] = simd::shared(simd::load(kd + LANES * c));
        for (int r = 0; r < 4; ++r) {
            const vec a = simd::set1(query[r * head_dim + d]);
            for (int c = 0; c < V; ++c) s[r][c] = simd::fmadd(a, k[c], s[r][c]);
        }
    }
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < V; ++c) simd::store(out + r * TILE_KEYS + j0 + LANES * c, s[r][c]);
}

inline void scores_of_four(const float* query, int64_t head_dim, const float* keys, float* out) {
    for (int64_t j0 = 0; j0 < TILE_KEYS; j0 += SCORE_VECTORS * LANES)
        scores_of_four_at<SCORE_VECTORS>(query, head_dim, keys, out, j0);
}

// acc[r] += sum_j p[r][j] values[j] for four rows over WIDTH vectors of head_dim from d0: the 4 x WIDTH
// accumulators in registers across the tile (with AVX-512, sixteen independent chains keep both FMA ports busy,
// where one vector at a time left four), each value vector loaded once for the four rows. Every acc element sums
// over j in the same order as one vector at a time, so the result is the same to the bit.
template <int WIDTH>
inline void accumulate_four_wide(const float* p, const float* values, int64_t head_dim, float* acc, int64_t keys,
                                 int64_t d0) {
    vec a[4][WIDTH];
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < WIDTH; ++c) a[r][c] = simd::load(acc + r * head_dim + d0 + LANES * c);
    for (int64_t j = 0; j < keys; ++j) {
        const float* vj = values + j * head_dim + d0;
        vec v[WIDTH];
        for (int c = 0; c < WIDTH; ++c) v[c] = simd::shared(simd::load(vj + LANES * c));
        for (int r = 0; r < 4; ++r) {
            const vec pr = simd::set1(p[r * TILE_KEYS + j]);
            for (int c = 0; c < WIDTH; ++c) a[r][c] = simd::fmadd(pr, v[c], a[r][c]);
        }
    }
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < WIDTH; ++c) simd::store(acc + r * head_dim + d0 + LANES * c, a[r][c]);
}

inline void accumulate_four(const float* p, const float* values, int64_t head_dim, float* acc, int64_t keys) {
    int64_t d0 = 0;
    for (; d0 + VALUE_VECTORS * LANES <= head_dim; d0 += VALUE_VECTORS * LANES)
        accumulate_four_wide<VALUE_VECTORS>(p, values, head_dim, acc, keys, d0);
    static_assert(VALUE_VECTORS <= 4, "the rest of a head is at most three vectors");
    switch ((head_dim - d0) / LANES) {  // the compiler drops the cases of VALUE_VECTORS and more
        case 3: if constexpr (VALUE_VECTORS > 3) accumulate_four_wide<3>(p, values, head_dim, acc, keys, d0); break;
        case 2: if constexpr (VALUE_VECTORS > 2) accumulate_four_wide<2>(p, values, head_dim, acc, keys, d0); break;
        case 1: if constexpr (VALUE_VECTORS > 1) accumulate_four_wide<1>(p, values, head_dim, acc, keys, d0); break;
        default: break;
    }
}
#else
// Scores of four query rows against a key tile ([d][j]): each key vector loaded once for the four.
inline void scores_of_four(const float* query, int64_t head_dim, const float* keys, float* out) {
    float s0[TILE_KEYS] = {}, s1[TILE_KEYS] = {}, s2[TILE_KEYS] = {}, s3[TILE_KEYS] = {};
    for (int64_t d = 0; d < head_dim; ++d) {
        const float* kd = keys + d * TILE_KEYS;
        const float a0 = query[d], a1 = query[head_dim + d], a2 = query[2 * head_dim + d], a3 = query[3 * head_dim + d];
        for (int64_t j = 0; j < TILE_KEYS; ++j) {
            s0[j] += a0 * kd[j];
            s1[j] += a1 * kd[j];
            s2[j] += a2 * kd[j];
            s3[j] += a3 * kd[j];
        }
    }
    std::memcpy(out, s0, sizeof(s0));
    std::memcpy(out + TILE_KEYS, s1, sizeof(s1));
    std::memcpy(out + 2 * TILE_KEYS, s2, sizeof(s2));
    std::memcpy(out + 3 * TILE_KEYS, s3, sizeof(s3));
}

// acc[r] += sum_j p[r][j] values[j] for four rows, a vector of head_dim at a time: each value vector loaded once
// for the four rows, the accumulators in registers across the tile.
inline void accumulate_four(const float* p, const float* values, int64_t head_dim, float* acc, int64_t keys) {
    for (int64_t d0 = 0; d0 < head_dim; d0 += HEAD_STEP) {
        float a0[HEAD_STEP], a1[HEAD_STEP], a2[HEAD_STEP], a3[HEAD_STEP];
        std::memcpy(a0, acc + d0, sizeof(a0));
        std::memcpy(a1, acc + head_dim + d0, sizeof(a1));
        std::memcpy(a2, acc + 2 * head_dim + d0, sizeof(a2));
        std::memcpy(a3, acc + 3 * head_dim + d0, sizeof(a3));
        for (int64_t j = 0; j < keys; ++j) {
            const float* vj = values + j * head_dim + d0;
            const float p0 = p[j], p1 = p[TILE_KEYS + j], p2 = p[2 * TILE_KEYS + j], p3 = p[3 * TILE_KEYS + j];
            for (int64_t l = 0; l < HEAD_STEP; ++l) {
                a0[l] += p0 * vj[l];
                a1[l] += p1 * vj[l];
                a2[l] += p2 * vj[l];
                a3[l] += p3 * vj[l];
            }
        }
        std::memcpy(acc + d0, a0, sizeof(a0));
        std::memcpy(acc + head_dim + d0, a1, sizeof(a1));
        std::memcpy(acc + 2 * head_dim + d0, a2, sizeof(a2));
        std::memcpy(acc + 3 * head_dim + d0, a3, sizeof(a3));
    }
}
#endif

#if defined(KVC_SIMD)
// One row of a key tile through the online softmax, in registers: scores past `seen` masked, the tile's maximum,
// e^(s - max) (`simd::exp_nonpositive`), the row's running maximum, sum and accumulator updated. The scores become
// the probabilities the values are weighed by (zeros where masked or where nothing is visible).
inline void online_softmax(float* sr, int64_t seen, float& top, float& total, float* acc, int64_t head_dim) {
    const vec minus_infinity = simd::set1(-INFINITY);
    vec x[TILE_VECTORS];
    vec tile_top = minus_infinity;
    for (int c = 0; c < TILE_VECTORS; ++c) {
        x[c] = simd::load_first(sr + LANES * c, seen - LANES * c, -INFINITY);
        tile_top = simd::max(tile_top, x[c]);
    }
    const float tile_max = simd::reduce_max(tile_top);
    if (tile_max == -INFINITY) {  // nothing visible: adds nothing
        for (int c = 0; c < TILE_VECTORS; ++c) simd::store(sr + LANES * c, simd::zero());
        return;
    }
    const float new_top = std::max(top, tile_max);
    const vec shift = simd::set1(new_top);
    vec sum = simd::zero();
    for (int c = 0; c < TILE_VECTORS; ++c) {
        const vec p = simd::zero_where_equal(x[c], minus_infinity, simd::exp_nonpositive(simd::sub(x[c], shift)));
        simd::store(sr + LANES * c, p);
        sum = simd::add(sum, p);
    }
    if (new_top != top) {
        const float rescale = top == -INFINITY ? 0.f : std::exp(top - new_top);
        total *= rescale;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= rescale;
        top = new_top;
    }
    total += simd::reduce_add(sum);
}
#else
inline void online_softmax(float* sr, int64_t seen, float& top, float& total, float* acc, int64_t head_dim) {
    for (int64_t j = seen; j < TILE_KEYS; ++j) sr[j] = -INFINITY;
    float tile_top = -INFINITY;
    for (int64_t j = 0; j < TILE_KEYS; ++j) tile_top = std::max(tile_top, sr[j]);
    if (tile_top == -INFINITY) {  // nothing visible: adds nothing
        std::fill(sr, sr + TILE_KEYS, 0.f);
        return;
    }
    const float new_top = std::max(top, tile_top);
    for (int64_t j = 0; j < TILE_KEYS; ++j) sr[j] -= new_top;
    exp_tile(sr, sr);
    if (new_top != top) {
        const float rescale = top == -INFINITY ? 0.f : std::exp(top - new_top);
        total *= rescale;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= rescale;
        top = new_top;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < TILE_KEYS; ++j) sum += sr[j];
    total += sum;
}
#endif

// Causal attention of whole prompts over their own new keys and values (nothing cached before them), flash
// style: per (sequence, kv head, tile of query positions), key tiles up to the tile's last position with an
// online softmax, so no [queries, keys] matrix is ever written. Rows are [tokens, heads, head_dim] with row
// strides q_row/k_row/v_row/out_row; sequence s is rows starts[s] .. starts[s] + lengths[s] - 1. The query
// rows of an item are its positions x the kv head's group of query heads, padded to a multiple of four.
template <typename T>
void prefill_attention(const T* q, int64_t q_row, const T* k, int64_t k_row, const T* v, int64_t v_row, T* out,
                       int64_t out_row, const int64_t* starts, const int64_t* lengths, int64_t sequences,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, float scale) {
    const int64_t group = heads / kv_heads;
    std::vector<int64_t> items;  // (sequence, kv head, first query), the longest (last) tiles first
    for (int64_t s = 0; s < sequences; ++s)
        for (int64_t q0 = 0; q0 < lengths[s]; q0 += TILE_QUERIES)
            for (int64_t h = 0; h < kv_heads; ++h) items.insert(items.end(), {s, h, q0});
    const int64_t count = static_cast<int64_t>(items.size()) / 3;
    std::vector<int64_t> order(count);
    for (int64_t i = 0; i < count; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return items[3 * a + 2] > items[3 * b + 2]; });
    const int64_t max_rows = (TILE_QUERIES * group + 3) / 4 * 4;
#pragma omp parallel
    {
        std::vector<float> query(max_rows * head_dim), acc(max_rows * head_dim), keys(head_dim * TILE_KEYS),
            values(TILE_KEYS * head_dim), scores(max_rows * TILE_KEYS), top(max_rows), total(max_rows);
#pragma omp for schedule(dynamic, 1)
        for (int64_t index = 0; index < count; ++index) {
            const int64_t* item = items.data() + 3 * order[index];
            const int64_t base = starts[item[0]], kvh = item[1], q0 = item[2];
            const int64_t q1 = std::min(q0 + TILE_QUERIES, lengths[item[0]]);
            const int64_t rows = (q1 - q0) * group;  // row r: position q0 + r / group, head kvh * group + r % group
            const int64_t padded = (rows + 3) / 4 * 4;
            std::fill(query.begin(), query.begin() + padded * head_dim, 0.f);
            for (int64_t r = 0; r < rows; ++r) {
                const T* src = q + (base + q0 + r / group) * q_row + (kvh * group + r % group) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) query[r * head_dim + d] = to_float(src[d]) * scale;
            }
            std::fill(top.begin(), top.begin() + padded, -INFINITY);
            std::fill(total.begin(), total.begin() + padded, 0.f);
            std::fill(acc.begin(), acc.begin() + padded * head_dim, 0.f);
            for (int64_t k0 = 0; k0 < q1; k0 += TILE_KEYS) {
                const int64_t nk = std::min(TILE_KEYS, q1 - k0);
                for (int64_t j = 0; j < TILE_KEYS; ++j) {  // keys transposed [d][j], values [j][d]; zeros past nk
                    const T* kr = k + (base + k0 + j) * k_row + kvh * head_dim;
                    const T* vr = v + (base + k0 + j) * v_row + kvh * head_dim;
                    for (int64_t d = 0; d < head_dim; ++d) {
                        keys[d * TILE_KEYS + j] = j < nk ? to_float(kr[d]) : 0.f;
                        values[j * head_dim + d] = j < nk ? to_float(vr[d]) : 0.f;
                    }
                }
                for (int64_t r = 0; r < padded; r += 4)
                    scores_of_four(query.data() + r * head_dim, head_dim, keys.data(), scores.data() + r * TILE_KEYS);
                for (int64_t r = 0; r < padded; ++r) {  // mask, online softmax; scores become probabilities
                    const int64_t seen = r < rows ? std::max<int64_t>(0, std::min(nk, q0 + r / group - k0 + 1)) : 0;
                    online_softmax(scores.data() + r * TILE_KEYS, seen, top[r], total[r], acc.data() + r * head_dim,
                                   head_dim);
                }
                for (int64_t r = 0; r < padded; r += 4)
                    accumulate_four(scores.data() + r * TILE_KEYS, values.data(), head_dim,
                                    acc.data() + r * head_dim, nk);
            }
            for (int64_t r = 0; r < rows; ++r) {
                T* dst = out + (base + q0 + r / group) * out_row + (kvh * group + r % group) * head_dim;
                const float inverse = 1.f / total[r];
                for (int64_t d = 0; d < head_dim; ++d) store(dst + d, acc[r * head_dim + d] * inverse);
            }
        }
    }
}

}  // namespace

extern "C" {

int kvc_kernels_version() { return 2; }

// The vectors the kernels were built for: "avx512", "avx2" or "portable" (scalar loops).
const char* kvc_kernels_isa() {
#if defined(KVC_SIMD)
    return simd::NAME;
#else
    return "portable";
#endif
}

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

// dtype as above. Returns 0, or -1 for a shape it does not take.
int kvc_prefill_attention(int dtype, const void* q, int64_t q_row, const void* k, int64_t k_row, const void* v,
                          int64_t v_row, void* out, int64_t out_row, const int64_t* starts, const int64_t* lengths,
                          int64_t sequences, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || head_dim <= 0 || head_dim % HEAD_STEP != 0) return -1;
    if (dtype == 0) {
        prefill_attention(static_cast<const float*>(q), q_row, static_cast<const float*>(k), k_row,
                          static_cast<const float*>(v), v_row, static_cast<float*>(out), out_row, starts, lengths,
                          sequences, heads, kv_heads, head_dim, scale);
    } else if (dtype == 1) {
        prefill_attention(static_cast<const uint16_t*>(q), q_row, static_cast<const uint16_t*>(k), k_row,
                          static_cast<const uint16_t*>(v), v_row, static_cast<uint16_t*>(out), out_row, starts,
                          lengths, sequences, heads, kv_heads, head_dim, scale);
    } else {
        return -1;
    }
    return 0;
}

}
