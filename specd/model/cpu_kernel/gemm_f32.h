// The fp32-activation weight-only GEMMs, int8 or int4 weights (specd_qgemm_i8 / specd_qgemm_i4, and
// the fused layer's Lin kinds 0 / 1): gemm. ISA: AVX2 + FMA only. Relies on common.h (hsum8); the
// int4 weights' min term reads the group sums of x (group_sums, quantize.h), which its caller fills.
//
// Weight-only quantized matmul for x86 CPUs with AVX2 + FMA: y[M,N] = x[M,K] @ W^T (+ add) (+ bias).
//
// Weights stay quantized in memory and are read once per call for all M rows: the loop over output
// rows n is outside the loop over row chunks of x, so a weight row (K bytes or K/2 bytes) is
// fetched from memory once and re-read from L1 for the next chunk of rows. Every output element is
// summed in the same order whatever M is (per 8 lanes, per group, then lanes), so a row's result
// does not depend on the other rows of the batch: a verification of several rows and a decode of
// one give bitwise-equal outputs for the same row (speculative decoding stays lossless).
//
// Formats (one group = G consecutive weights of a row, G a multiple of 32):
//   int8: q int8 [N, K], scale fp32 [N, K/G]                    w = scale * q
//   int4: q uint8 [N, K/2] in 32-weight blocks of 16 bytes,      w = scale * q + min
//         byte j of a block holding weight j (low nibble) and weight j + 16 (high nibble)
//         (GGUF Q4_0 / Q4_1 block order), scale and min fp32 [N, K/G]
// Threads: OpenMP over output rows, linked against the OpenMP runtime torch already loaded.
#pragma once

#include "common.h"

#define PF_ROWS 8  // software prefetch distance in weight rows

static inline __m256 load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// NB output rows (n .. n+NB-1) of an int8 weight for R rows of x: R * NB independent accumulator
// chains hide the FMA latency; each element's own chain (per group: lanes over k in steps of 8, then
// scale, then the 8 lanes) is the same for every (R, NB), so results do not depend on the blocking.
template <int R, int NB>
static inline void tile_i8(const float* x, int64_t K, int64_t G, const int8_t* q, const float* sc, int64_t ng,
                           float* out /* [R, NB] */) {
    __m256 acc[R][NB];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        __m256 ga[R][NB];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NB; j++) ga[r][j] = _mm256_setzero_ps();
        for (int64_t k = g0; k < g0 + G; k += 8) {
            if ((k & 63) == 0)  // the rows PF_ROWS ahead, one cache line per row per 64 weights
                for (int j = 0; j < NB; j++) _mm_prefetch((const char*)(q + (j + PF_ROWS) * K + k), _MM_HINT_T0);
            __m256 w[NB];
            for (int j = 0; j < NB; j++) w[j] = load_i8(q + j * K + k);
            for (int r = 0; r < R; r++) {
                __m256 xv = _mm256_loadu_ps(x + r * K + k);
                for (int j = 0; j < NB; j++) ga[r][j] = _mm256_fmadd_ps(xv, w[j], ga[r][j]);
            }
        }
        for (int j = 0; j < NB; j++) {
            __m256 s = _mm256_set1_ps(sc[j * ng + g0 / G]);
            for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(s, ga[r][j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) out[r * NB + j] = hsum8(acc[r][j]);
}

// the same for an int4 weight (the min term is added by the caller from the group sums of x)
template <int R, int NB>
static inline void tile_i4(const float* x, int64_t K, int64_t G, const uint8_t* q, const float* sc, int64_t ng,
                           float* out) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m256 acc[R][NB];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        __m256 ga[R][NB];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NB; j++) ga[r][j] = _mm256_setzero_ps();
        for (int64_t b = g0; b < g0 + G; b += 32) {
            if ((b & 127) == 0)
                for (int j = 0; j < NB; j++)
                    _mm_prefetch((const char*)(q + (j + PF_ROWS) * (K / 2) + b / 2), _MM_HINT_T0);
            for (int half = 0; half < 2; half++) {  // weights b..b+15 (low nibbles), b+16..b+31 (high)
                __m256 w0[NB], w1[NB];
                for (int j = 0; j < NB; j++) {
                    __m128i v = _mm_loadu_si128((const __m128i*)(q + j * (K / 2) + b / 2));
                    __m128i n4 = _mm_and_si128(half ? _mm_srli_epi16(v, 4) : v, mask);
                    w0[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(n4));
                    w1[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(n4, 8)));
                }
                for (int r = 0; r < R; r++) {
                    const float* xr = x + r * K + b + 16 * half;
                    __m256 x0 = _mm256_loadu_ps(xr), x1 = _mm256_loadu_ps(xr + 8);
                    for (int j = 0; j < NB; j++) {
                        ga[r][j] = _mm256_fmadd_ps(x0, w0[j], ga[r][j]);
                        ga[r][j] = _mm256_fmadd_ps(x1, w1[j], ga[r][j]);
                    }
                }
            }
        }
        for (int j = 0; j < NB; j++) {
            __m256 s = _mm256_set1_ps(sc[j * ng + g0 / G]);
            for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(s, ga[r][j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) out[r * NB + j] = hsum8(acc[r][j]);
}

template <bool INT4, int R, int NB>
static inline void tile(const float* x, int64_t K, int64_t G, const void* qv, int64_t n, const float* scale,
                        int64_t ng, float* out) {
    if (INT4)
        tile_i4<R, NB>(x, K, G, (const uint8_t*)qv + n * (K / 2), scale + n * ng, ng, out);
    else
        tile_i8<R, NB>(x, K, G, (const int8_t*)qv + n * K, scale + n * ng, ng, out);
}

// rows m0 .. m0+r-1 of x against weight rows n .. n+nb-1 (r <= RB; nb 4 for one row, 2 for two, else 1)
template <bool INT4>
static inline void block(const float* xm, int64_t r, int64_t K, int64_t G, const void* q, int64_t n, int64_t nb,
                         const float* scale, int64_t ng, float* out) {
    if (nb == 4) tile<INT4, 1, 4>(xm, K, G, q, n, scale, ng, out);
    else if (nb == 2) tile<INT4, 2, 2>(xm, K, G, q, n, scale, ng, out);
    else if (r == 6) tile<INT4, 6, 1>(xm, K, G, q, n, scale, ng, out);
    else if (r == 5) tile<INT4, 5, 1>(xm, K, G, q, n, scale, ng, out);
    else if (r == 4) tile<INT4, 4, 1>(xm, K, G, q, n, scale, ng, out);
    else if (r == 3) tile<INT4, 3, 1>(xm, K, G, q, n, scale, ng, out);
    else if (r == 2) tile<INT4, 2, 1>(xm, K, G, q, n, scale, ng, out);
    else tile<INT4, 1, 1>(xm, K, G, q, n, scale, ng, out);
}

#define RB 6  // rows of x per pass over a weight tile (6 x 2 accumulators + weight + x: 14 registers)

template <bool INT4>
static void gemm(const float* x, int64_t M, int64_t K, const void* qv, const float* scale, const float* mins,
                 int64_t N, int64_t G, const float* add, const float* bias, float* y, const float* xsum) {
    const int64_t ng = K / G;
    const int64_t NT = (N + 3) / 4;  // tiles of 4 output rows
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < NT; t++) {
        const int64_t n0 = t * 4, n1 = n0 + 4 < N ? n0 + 4 : N;
        float out[RB * 4];
        for (int64_t m0 = 0; m0 < M; m0 += RB) {
            const int64_t r = M - m0 < RB ? M - m0 : RB;
            const int64_t nb = (r == 1 && n1 - n0 == 4) ? 4 : (r == 2 && n1 - n0 == 4) ? 2 : 1;
            for (int64_t n = n0; n < n1; n += nb) {
                block<INT4>(x + m0 * K, r, K, G, qv, n, nb, scale, ng, out);
                for (int64_t i = 0; i < r; i++)
                    for (int64_t j = 0; j < nb; j++) {
                        const int64_t m = m0 + i, nn = n + j;
                        float v = out[i * nb + j];
                        if (INT4 && mins) {
                            const float* mn = mins + nn * ng;
                            const float* xs = xsum + m * ng;
                            float s = 0.f;
                            for (int64_t g = 0; g < ng; g++) s += mn[g] * xs[g];
                            v += s;
                        }
                        if (bias) v += bias[nn];
                        if (add) v += add[m * N + nn];
                        y[m * N + nn] = v;
                    }
            }
        }
    }
}
