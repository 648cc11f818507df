// out = x @ wᵀ (+ bias) (+ residual) for few rows of x: the fp32 linear layers of a decode step, where every
// weight is read once per step and oneDNN's GEMM, laid out for many rows, streamed `small`'s weights at 7-14 GB/s
// against the 20 GB/s this CPU reads them at (docs/performance.md, "Decode's linear layers").
//
// w is packed once (`kvc_pack_panels`) into panels of 32 output columns (a last one of 16 where the width is an
// odd number of 16s), each panel [in][32] contiguous, so a panel streams from memory in order. A work item is a
// panel: its accumulators, ROWS rows x 32 columns, stay in registers across the whole input dimension, each
// weight vector loaded once for the ROWS rows and each x element broadcast once for the panel's columns.
//
// Every output element is one sum over the input dimension in order, x[r][0] w[0] + x[r][1] w[1] + ..., fused
// multiply-adds from zero: the same bits whatever the number of rows, the row's place among them or the threads
// (a decode step's logits do not depend on what else is in the batch). bias, then residual, are added after.
//
// x:        [rows, in], row stride `x_row` elements; residual and out likewise with `r_row`, `out_row`
// panels:   what kvc_pack_panels wrote for a [out, in] weight (out a multiple of 16)
// Each panel is a work item for the OpenMP team of the calling thread (torch's, as in attention.cpp).

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 32;      // output columns a panel holds (a last panel may hold 16)
constexpr int64_t ROW_BLOCK = 12;  // rows whose accumulators share the registers: 12 x 2 vectors + 2 weights
// Software prefetch of the panel ahead of the loads, into L1 and (further on) L2: without them the loads of a
// streamed panel did not overlap the multiply-adds, and the weights came in at 7-10 GB/s (at 8-32 rows) against
// 19 GB/s with them (measured in one process while writing it, 2026-11-27).
constexpr int64_t NEAR_AHEAD = 512;   // floats: 2 KiB
constexpr int64_t FAR_AHEAD = 8192;   // floats: 32 KiB

inline int64_t panel_width(int64_t out, int64_t panel) {
    const int64_t left = out - panel * PANEL;
    return left < PANEL ? left : PANEL;
}

#if defined(__AVX512F__)
// ROWS rows against one panel of VECTORS x 16 columns.
template <int ROWS, int VECTORS>
inline void panel_rows(const float* x, int64_t x_row, const float* panel, int64_t in, float* acc_out) {
    __m512 acc[ROWS][VECTORS];
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; ++i) {
        const float* wi = panel + i * (16 * VECTORS);
        __m512 w[VECTORS];
        for (int v = 0; v < VECTORS; ++v) {
            _mm_prefetch(reinterpret_cast<const char*>(wi + NEAR_AHEAD + 16 * v), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(wi + FAR_AHEAD + 16 * v), _MM_HINT_T1);
            w[v] = _mm512_loadu_ps(wi + 16 * v);
        }
        for (int r = 0; r < ROWS; ++r) {
            const __m512 xr = _mm512_set1_ps(x[r * x_row + i]);
            for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_fmadd_ps(xr, w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < VECTORS; ++v) _mm512_storeu_ps(acc_out + r * PANEL + 16 * v, acc[r][v]);
}

template <int VECTORS>
inline void panel_block(const float* x, int64_t x_row, const float* panel, int64_t in, int64_t rows, float* acc) {
    switch (rows) {
        case 1: panel_rows<1, VECTORS>(x, x_row, panel, in, acc); break;
        case 2: panel_rows<2, VECTORS>(x, x_row, panel, in, acc); break;
        case 3: panel_rows<3, VECTORS>(x, x_row, panel, in, acc); break;
        case 4: panel_rows<4, VECTORS>(x, x_row, panel, in, acc); break;
        case 5: panel_rows<5, VECTORS>(x, x_row, panel, in, acc); break;
        case 6: panel_rows<6, VECTORS>(x, x_row, panel, in, acc); break;
        case 7: panel_rows<7, VECTORS>(x, x_row, panel, in, acc); break;
        case 8: panel_rows<8, VECTORS>(x, x_row, panel, in, acc); break;
        case 9: panel_rows<9, VECTORS>(x, x_row, panel, in, acc); break;
        case 10: panel_rows<10, VECTORS>(x, x_row, panel, in, acc); break;
        case 11: panel_rows<11, VECTORS>(x, x_row, panel, in, acc); break;
        default: panel_rows<12, VECTORS>(x, x_row, panel, in, acc);
    }
}
#else
// The same sums without AVX-512: one fused multiply-add chain per output element, in order.
inline void panel_block_plain(const float* x, int64_t x_row, const float* panel, int64_t in, int64_t rows,
                              int64_t width, float* acc) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < width; ++c) {
            float s = 0.f;
            for (int64_t i = 0; i < in; ++i) s = __builtin_fmaf(x[r * x_row + i], panel[i * width + c], s);
            acc[r * PANEL + c] = s;
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
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; ++p) {
        const int64_t width = panel_width(out_width, p), c0 = p * PANEL;
        const float* panel = panels + p * PANEL * in;
        alignas(64) float acc[ROW_BLOCK * PANEL];
        // Rows in blocks of even size (16 rows: 8 + 8, not 12 + 4): the first block streams the panel from memory,
        // the others read it from L2, and a block of 4 would leave the stream with too little work to overlap.
        const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK, even = (rows + blocks - 1) / blocks;
        for (int64_t r0 = 0; r0 < rows; r0 += even) {
            const int64_t block = rows - r0 < even ? rows - r0 : even;
#if defined(__AVX512F__)
            if (width == PANEL)
                panel_block<2>(x + r0 * x_row, x_row, panel, in, block, acc);
            else
                panel_block<1>(x + r0 * x_row, x_row, panel, in, block, acc);
#else
            panel_block_plain(x + r0 * x_row, x_row, panel, in, block, width, acc);
#endif
            for (int64_t r = 0; r < block; ++r) {
                float* dst = out + (r0 + r) * out_row + c0;
                const float* sums = acc + r * PANEL;
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
