// out = x @ wᵀ (+ bias) (+ residual) for few rows of x: the fp32 linear layers of a decode step, where every
// weight is read once per step and oneDNN's GEMM, laid out for many rows, streamed `small`'s weights at 7-14 GB/s
// against the 20 GB/s this CPU reads them at (docs/performance.md, "Decode's linear layers").
//
// w is packed once (`kvc_pack_panels`) into panels of PANEL output columns (32 with AVX-512 or without vectors,
// 16 with AVX2; a last one of 16 where the width is an odd number of 16s), each panel [in][PANEL] contiguous, so
// a panel streams from memory in order. A work item is a strip of adjacent panels (one, or with AVX2 and a few
// rows up to four, read side by side): its accumulators, ROWS rows x the strip's columns, stay in registers
// across the whole input dimension, each weight vector loaded once for the ROWS rows and each x element
// broadcast once for the strip's columns.
//
// Every output element is one sum over the input dimension in order, x[r][0] w[0] + x[r][1] w[1] + ..., fused
// multiply-adds from zero: the same bits whatever the number of rows, the row's place among them or the threads
// (a decode step's logits do not depend on what else is in the batch), and whatever the instruction set.
// bias, then residual, are added after.
//
// x:        [rows, in], row stride `x_row` elements; residual and out likewise with `r_row`, `out_row`
// panels:   what kvc_pack_panels wrote for a [out, in] weight (out a multiple of 16)
// Each strip is a work item for the OpenMP team of the calling thread (torch's, as in attention.cpp).

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace {

// The register tiles, per instruction set (registers: 32 with AVX-512, 16 with AVX2):
// - PANEL: the columns of a panel; ROW_BLOCK: the rows whose accumulators share the registers. AVX-512: 12 rows x
//   2 vectors of accumulators + the 2 weight vectors. AVX2: 6 rows x 2 vectors + 2 weights + the broadcast x, over
//   panels of 16 columns (panels of 32 with 2 or 3 rows x 4 vectors ran 10-35% slower at 32-128 rows).
// - strip_panels(rows): the panels a work item reads side by side when its row blocks are that many rows. With
//   AVX2, one panel at a time left a single row's sums latency-bound on two chains and one stream from memory:
//   0.8-0.9x torch's GEMV at one row, against 1.4-1.6x over four panels; 2 and 3 rows ran 5-15% faster over two
//   (one thread, an AMD EPYC without AVX-512, 2026-11-27).
// - PREFETCH_ROWS: software prefetch from this many rows up (AVX2 on that EPYC: at one row the hardware's
//   prefetcher did 10-20% better alone).
#if KVC_SIMD == 8
constexpr int64_t PANEL = 16;
constexpr int64_t ROW_BLOCK = 6;
constexpr int PREFETCH_ROWS = 2;
constexpr int strip_panels(int64_t rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }
#else
constexpr int64_t PANEL = 32;
constexpr int64_t ROW_BLOCK = 12;
constexpr int PREFETCH_ROWS = 1;
constexpr int strip_panels(int64_t) { return 1; }
#endif
constexpr bool strips_fit(int64_t rows = 1) {  // a block's sums, rows x its strip's columns, in ROW_BLOCK x PANEL
    return rows > ROW_BLOCK || (rows * strip_panels(rows) <= ROW_BLOCK && strips_fit(rows + 1));
}
static_assert(strips_fit(), "a strip of a block's rows fits the block's sums buffer");
// Software prefetch of the panel ahead of the loads, into L1 and (further on) L2: without them the loads of a
// streamed panel did not overlap the multiply-adds, and the weights came in at 7-10 GB/s (at 8-32 rows) against
// 19 GB/s with them (measured in one process while writing it, 2026-11-27).
constexpr int64_t NEAR_AHEAD = 512;   // floats: 2 KiB
constexpr int64_t FAR_AHEAD = 8192;   // floats: 32 KiB
constexpr int64_t LINE = 16;          // floats of a cache line: one prefetch each

inline int64_t panel_width(int64_t out, int64_t panel) {
    const int64_t left = out - panel * PANEL;
    return left < PANEL ? left : PANEL;
}

#if defined(KVC_SIMD)
using simd::vec;
constexpr int LANES = simd::LANES;
static_assert(PANEL % LANES == 0 && 16 % LANES == 0, "a panel is whole vectors, and so is its last one of 16");

// ROWS rows against PANELS adjacent panels of VECTORS vectors of columns each (`stride` floats apart): acc_out[r *
// acc_row + c], each the in-order fused multiply-add chain of its row and column.
template <int ROWS, int PANELS, int VECTORS>
inline void strip_rows(const float* x, int64_t x_row, const float* panel, int64_t stride, int64_t in, float* acc_out,
                       int64_t acc_row) {
    vec acc[ROWS][PANELS][VECTORS];
    for (int r = 0; r < ROWS; ++r)
        for (int p = 0; p < PANELS; ++p)
            for (int v = 0; v < VECTORS; ++v) acc[r][p][v] = simd::zero();
    for (int64_t i = 0; i < in; ++i) {
        vec w[PANELS][VECTORS];
        for (int p = 0; p < PANELS; ++p) {
            const float* wi = panel + p * stride + i * (LANES * VECTORS);
            if constexpr (ROWS >= PREFETCH_ROWS) {
                for (int line = 0; line < LANES * VECTORS; line += LINE) {
                    _mm_prefetch(reinterpret_cast<const char*>(wi + NEAR_AHEAD + line), _MM_HINT_T0);
                    _mm_prefetch(reinterpret_cast<const char*>(wi + FAR_AHEAD + line), _MM_HINT_T1);
                }
            }
            for (int v = 0; v < VECTORS; ++v) w[p][v] = simd::load(wi + LANES * v);
        }
        for (int r = 0; r < ROWS; ++r) {
            const vec xr = simd::set1(x[r * x_row + i]);
            for (int p = 0; p < PANELS; ++p)
                for (int v = 0; v < VECTORS; ++v) acc[r][p][v] = simd::fmadd(xr, w[p][v], acc[r][p][v]);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int p = 0; p < PANELS; ++p)
            for (int v = 0; v < VECTORS; ++v)
                simd::store(acc_out + r * acc_row + p * PANEL + LANES * v, acc[r][p][v]);
}

// ROWS rows against `panels` adjacent panels of `width` columns in all: together where they make the strip
// strip_panels(ROWS) asks for, else one at a time (a last panel may be 16 columns).
template <int ROWS>
inline void rows_of_strip(const float* x, int64_t x_row, const float* panel, int64_t in, int64_t panels,
                          int64_t width, float* acc, int64_t acc_row) {
    constexpr int together = strip_panels(ROWS);
    if constexpr (together > 1) {
        if (panels == together && width == together * PANEL)
            return strip_rows<ROWS, together, PANEL / LANES>(x, x_row, panel, PANEL * in, in, acc, acc_row);
    }
    for (int64_t p = 0; p < panels; ++p) {
        const float* one = panel + p * PANEL * in;
        if (width - p * PANEL >= PANEL)
            strip_rows<ROWS, 1, PANEL / LANES>(x, x_row, one, 0, in, acc + p * PANEL, acc_row);
        else
            strip_rows<ROWS, 1, 16 / LANES>(x, x_row, one, 0, in, acc + p * PANEL, acc_row);
    }
}

static_assert(ROW_BLOCK >= 1 && ROW_BLOCK <= 12, "strip_block switches over 1 .. 12 rows");
constexpr int cap(int rows) { return rows < ROW_BLOCK ? rows : ROW_BLOCK; }

// `rows` (1 .. ROW_BLOCK) rows against a strip. A switch (the compiler drops the cases past ROW_BLOCK): a chain
// of templates calling the next gave the 12-row loop of AVX-512 three more reloads of a row's address a step.
inline void strip_block(const float* x, int64_t x_row, const float* panel, int64_t in, int64_t rows, int64_t panels,
                        int64_t width, float* acc, int64_t acc_row) {
    if (rows < 1 || rows > ROW_BLOCK) __builtin_unreachable();
    switch (rows) {
        case 1: rows_of_strip<cap(1)>(x, x_row, panel, in, panels, width, acc, acc_row); break;
        case 2: rows_of_strip<cap(2)>(x, x_row, panel, in, panels, width, acc, acc_row); break;
        case 3: rows_of_strip<cap(3)>(x, x_row, panel, in, panels, width, acc, acc_row); break;
        case 4: rows_of_strip<cap(4)>(x, x_row, panel, in, panels, width, acc, acc_row); break;
        case 5: rows_of_strip<cap(5)>(x, x_row, panel, in, panels, width, acc, acc_row); break;
        case 6: rows_of_strip<cap(6)>(x, x_row, panel, in, panels, width, acc, acc_row); break;
        case 7: rows_of_strip<cap(7)>(x, x_row, panel, in, panels, width, acc, acc_row); break;
        case 8: rows_of_strip<cap(8)>(x, x_row, panel, in, panels, width, acc, acc_row); break;
        case 9: rows_of_strip<cap(9)>(x, x_row, panel, in, panels, width, acc, acc_row); break;
        case 10: rows_of_strip<cap(10)>(x, x_row, panel, in, panels, width, acc, acc_row); break;
        case 11: rows_of_strip<cap(11)>(x, x_row, panel, in, panels, width, acc, acc_row); break;
        default: rows_of_strip<ROW_BLOCK>(x, x_row, panel, in, panels, width, acc, acc_row);
    }
}
#else
// The same sums without vectors: one fused multiply-add chain per output element, in order, a panel at a time.
inline void strip_block(const float* x, int64_t x_row, const float* panel, int64_t in, int64_t rows, int64_t panels,
                        int64_t width, float* acc, int64_t acc_row) {
    for (int64_t p = 0; p < panels; ++p) {
        const float* one = panel + p * PANEL * in;
        const int64_t columns = width - p * PANEL < PANEL ? width - p * PANEL : PANEL;
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < columns; ++c) {
                float s = 0.f;
                for (int64_t i = 0; i < in; ++i) s = __builtin_fmaf(x[r * x_row + i], one[i * columns + c], s);
                acc[r * acc_row + p * PANEL + c] = s;
            }
    }
}
#endif

}  // namespace

extern "C" {

// w: [out, in] row-major (a torch Linear's weight); panels: out * in floats (every element once). Returns -1 where
// out is not a multiple of 16.
int kvc_pack_panels(const float* w, int64_t out, int64_t in, float* panels) {
    if (out <= 0 || in <= 0 || out % 16 != 0) return -1;
    const int64_t count = (out + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < count; ++p) {
        const int64_t width = panel_width(out, p);
        float* panel = panels + p * PANEL * in;
        for (int64_t i = 0; i < in; ++i)
            for (int64_t c = 0; c < width; ++c) panel[i * width + c] = w[(p * PANEL + c) * in + i];
    }
    return 0;
}

// out[r][c] = sum_i x[r][i] w[c][i] (+ bias[c]) (+ residual[r][c]); bias and residual may be null.
void kvc_small_gemm(const float* x, int64_t x_row, const float* panels, const float* bias, const float* residual,
                    int64_t r_row, float* out, int64_t out_row, int64_t rows, int64_t out_width, int64_t in) {
    const int64_t count = (out_width + PANEL - 1) / PANEL;
    // Rows in blocks of even size (16 rows: 8 + 8, not 12 + 4): the first block streams the strip from memory,
    // the others read it from L2, and a block of 4 would leave the stream with too little work to overlap.
    const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK, even = (rows + blocks - 1) / blocks;
    const int64_t together = strip_panels(even), strips = (count + together - 1) / together;
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < strips; ++s) {
        const int64_t first = s * together, in_strip = std::min(count - first, together);
        const int64_t c0 = first * PANEL, width = std::min(out_width - c0, together * PANEL);
        const float* strip = panels + first * PANEL * in;
        alignas(64) float acc[ROW_BLOCK * PANEL];
        const int64_t acc_row = together * PANEL;
        for (int64_t r0 = 0; r0 < rows; r0 += even) {
            const int64_t block = rows - r0 < even ? rows - r0 : even;
            strip_block(x + r0 * x_row, x_row, strip, in, block, in_strip, width, acc, acc_row);
            for (int64_t r = 0; r < block; ++r) {
                float* dst = out + (r0 + r) * out_row + c0;
                const float* sums = acc + r * acc_row;
                const float* res = residual != nullptr ? residual + (r0 + r) * r_row + c0 : nullptr;
                for (int64_t c = 0; c < width; ++c) {
                    float y = sums[c];
                    if (bias != nullptr) y += bias[c0 + c];
                    if (res != nullptr) y += res[c];
                    dst[c] = y;
                }
            }
        }
    }
}

}
