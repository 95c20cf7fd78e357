// Grammar masks on logits (specd.structured.masks, constrained decoding): every logit whose token a
// packed bitmask row forbids becomes -inf, in place. Plain C++ (any x86-64; the compiler vectorizes the
// word loop), no ISA of its own; relies on nothing from the other headers.
//
// bitmask: [rows, W] 32-bit words, bit j of word w = token 32 w + j allowed (xgrammar's layout);
// logits row r is logits + row_idx[r] * ld, V columns; columns at or past 32 W are forbidden.
// A word of all ones (the common case inside a JSON string) costs one compare; a zero word (outside
// one) 32 stores; only mixed words test bit by bit.
#pragma once
#include <cmath>
#include <cstdint>

static void apply_bitmask_rows(float* logits, int64_t ld, const int64_t* row_idx, int64_t rows, int64_t V,
                               const int32_t* bitmask, int64_t W) {
    const float ninf = -INFINITY;
    for (int64_t r = 0; r < rows; ++r) {
        float* x = logits + row_idx[r] * ld;
        const uint32_t* b = reinterpret_cast<const uint32_t*>(bitmask + r * W);
        const int64_t full = V < 32 * W ? V / 32 : W;  // words whose 32 columns all exist
        for (int64_t w = 0; w < full; ++w) {
            const uint32_t m = b[w];
            float* xw = x + 32 * w;
            if (m == 0xFFFFFFFFu) continue;
            if (m == 0) {
                for (int j = 0; j < 32; ++j) xw[j] = ninf;
                continue;
            }
            for (int j = 0; j < 32; ++j) xw[j] = ((m >> j) & 1u) ? xw[j] : ninf;  // a blend, vectorized
        }
        for (int64_t c = 32 * full; c < V; ++c) {  // a partial last word, then columns past the bitmask
            const int64_t w = c / 32;
            if (w >= W || !((b[w] >> (c % 32)) & 1u)) x[c] = ninf;
        }
    }
}
