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
//
// The *_q8 entry points quantize each row of x to int8 first (blocks of 32: d = max|x| / 127,
// q = round(x / d), GGUF Q8_0 / llama.cpp's activation format) and multiply codes by codes in
// integers (maddubs: 32 products per instruction), each 32-block's integer sum then scaled in fp32.
// A row's result still depends on that row alone (its own blocks and scales), so speculation stays
// lossless; it is no longer equal to the fp32-activation result (a relative error ~1e-3 per output).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#define PF_ROWS 8  // software prefetch distance in weight rows

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

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

// ---------------------------------------------------------------------------------------------------
// int8 activations (see the top): qx int8 [M, K], dx fp32 [M, K/32]
static void quantize_q8(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx) {
    const int64_t nb = K / 32;
    const __m256 signbit = _mm256_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t i = 0; i < M * nb; i++) {
        const float* xb = x + i * 32;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int t = 0; t < 4; t++) {
            v[t] = _mm256_loadu_ps(xb + 8 * t);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(signbit, v[t]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f;
        dx[i] = d;
        const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        __m256i q[4];
        for (int t = 0; t < 4; t++)
            q[t] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[t], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // pack 32 int32 -> 32 int8 in order (packs work per 128-bit lane: fix the order after)
        __m256i a = _mm256_packs_epi32(q[0], q[1]), b = _mm256_packs_epi32(q[2], q[3]);
        __m256i c = _mm256_packs_epi16(a, b);
        c = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(qx + i * 32), c);
    }
}

// 8 int32 lanes of sum(u[i] * s[i]) over 32 bytes: u unsigned (<= 128), s signed (|s| <= 127)
static inline __m256 dot32(__m256i u, __m256i s) {
    const __m256i p16 = _mm256_maddubs_epi16(u, s);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

template <int R, int NB>
static inline void tile_i8_q8(const int8_t* qx, const float* dx, int64_t K, int64_t G, const int8_t* q, const float* sc,
                              int64_t ng, float* out) {
    const int64_t nbk = K / 32;
    __m256 acc[R][NB];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        __m256 ga[R][NB];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NB; j++) ga[r][j] = _mm256_setzero_ps();
        for (int64_t k = g0; k < g0 + G; k += 32) {
            if ((k & 63) == 0)
                for (int j = 0; j < NB; j++) _mm_prefetch((const char*)(q + (j + PF_ROWS) * K + k), _MM_HINT_T0);
            __m256i w[NB], aw[NB];
            for (int j = 0; j < NB; j++) {
                w[j] = _mm256_loadu_si256((const __m256i*)(q + j * K + k));
                aw[j] = _mm256_sign_epi8(w[j], w[j]);  // |w|
            }
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(qx + r * K + k));
                const __m256 d = _mm256_broadcast_ss(dx + r * nbk + k / 32);
                for (int j = 0; j < NB; j++)
                    ga[r][j] = _mm256_fmadd_ps(d, dot32(aw[j], _mm256_sign_epi8(xv, w[j])), ga[r][j]);
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

template <int R, int NB>
static inline void tile_i4_q8(const int8_t* qx, const float* dx, int64_t K, int64_t G, const uint8_t* q,
                              const float* sc, int64_t ng, float* out) {
    const int64_t nbk = K / 32;
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
            __m256i w[NB];
            for (int j = 0; j < NB; j++) {
                const __m128i v = _mm_loadu_si128((const __m128i*)(q + j * (K / 2) + b / 2));
                w[j] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
            }
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(qx + r * K + b));
                const __m256 d = _mm256_broadcast_ss(dx + r * nbk + b / 32);
                for (int j = 0; j < NB; j++) ga[r][j] = _mm256_fmadd_ps(d, dot32(w[j], xv), ga[r][j]);
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
static inline void tile_q8(const int8_t* qx, const float* dx, int64_t K, int64_t G, const void* qv, int64_t n,
                           const float* scale, int64_t ng, float* out) {
    if (INT4)
        tile_i4_q8<R, NB>(qx, dx, K, G, (const uint8_t*)qv + n * (K / 2), scale + n * ng, ng, out);
    else
        tile_i8_q8<R, NB>(qx, dx, K, G, (const int8_t*)qv + n * K, scale + n * ng, ng, out);
}

template <bool INT4>
static inline void block_q8(const int8_t* qx, const float* dx, int64_t r, int64_t K, int64_t G, const void* q,
                            int64_t n, int64_t nb, const float* scale, int64_t ng, float* out) {
    if (nb == 4) tile_q8<INT4, 1, 4>(qx, dx, K, G, q, n, scale, ng, out);
    else if (nb == 2) tile_q8<INT4, 2, 2>(qx, dx, K, G, q, n, scale, ng, out);
    else if (r == 6) tile_q8<INT4, 6, 1>(qx, dx, K, G, q, n, scale, ng, out);
    else if (r == 5) tile_q8<INT4, 5, 1>(qx, dx, K, G, q, n, scale, ng, out);
    else if (r == 4) tile_q8<INT4, 4, 1>(qx, dx, K, G, q, n, scale, ng, out);
    else if (r == 3) tile_q8<INT4, 3, 1>(qx, dx, K, G, q, n, scale, ng, out);
    else if (r == 2) tile_q8<INT4, 2, 1>(qx, dx, K, G, q, n, scale, ng, out);
    else tile_q8<INT4, 1, 1>(qx, dx, K, G, q, n, scale, ng, out);
}

template <bool INT4>
static void gemm_q8(const int8_t* qx, const float* dx, int64_t M, int64_t K, const void* qv, const float* scale,
                    const float* mins, int64_t N, int64_t G, const float* add, const float* bias, float* y,
                    const float* xsum) {
    const int64_t ng = K / G, nbk = K / 32;
    const int64_t NT = (N + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < NT; t++) {
        const int64_t n0 = t * 4, n1 = n0 + 4 < N ? n0 + 4 : N;
        float out[RB * 4];
        for (int64_t m0 = 0; m0 < M; m0 += RB) {
            const int64_t r = M - m0 < RB ? M - m0 : RB;
            const int64_t nb = (r == 1 && n1 - n0 == 4) ? 4 : (r == 2 && n1 - n0 == 4) ? 2 : 1;
            for (int64_t n = n0; n < n1; n += nb) {
                block_q8<INT4>(qx + m0 * K, dx + m0 * nbk, r, K, G, qv, n, nb, scale, ng, out);
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

static void group_sums(const float* x, int64_t M, int64_t K, int64_t G, float* xsum) {
    const int64_t ng = K / G;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            __m256 s = _mm256_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + m * K + k));
            xsum[m * ng + g] = hsum8(s);
        }
}

// ---------------------------------------------------------------------------------------------------
// Attention over gathered keys, one query row at a time: every row's result is computed by the same
// loop whatever the other rows are (torch's SDPA blocks query rows through GEMMs whose kernels, and
// so sum orders, change with the number of rows). Scores sum over D in a fixed order, the softmax
// and the weighted sum over keys run key by key in order; keys whose mask is -inf are skipped
// (adding exact zeros), so a row's keys padded out to a longer batch do not change it either.
//   q    [B, KVH, R, D]  query rows grouped under their KV head (row r uses mask row r % Q)
//   kv   [2, B, L, KVH, D] keys then values
//   mask [B, Q, L] additive (0 or -inf)
//   out  [B, KVH, R, D]
static inline float dot_d(const float* a, const float* b, int64_t D) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float t = hsum8(s);
    for (; i < D; i++) t += a[i] * b[i];
    return t;
}

#define ATT_ROWS 16  // query rows per task (they share one pass over the keys)

// exp of x <= 0 (a score minus its row's max), 8 lanes, Cephes' expf polynomial (about 1 ulp);
// below -87.3 (and -inf, a masked key) exactly 0. Every key goes through this one function, so a
// key's weight never depends on where it falls in a vector.
static inline __m256 exp_nonpos(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 xc = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 v = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
}

// out rows a, b (64 wide) = sum_j p[j] * v_j in key order, then * inv; a key whose weight is 0 is
// skipped for that row (its value is never read for it). Per element: fmaf(p, v, o) in key order,
// the same as the one-row loop computes.
static void weighted_sum_2x64(const float* pa, const float* pb, int64_t L, const float* vb, int64_t KVH,
                              const float* inv, float* out) {
    for (int half = 0; half < 2; half++) {
        __m256 oa[4], ob[4];
        for (int t = 0; t < 4; t++) oa[t] = ob[t] = _mm256_setzero_ps();
        for (int64_t j = 0; j < L; j++) {
            const float a = pa[j], b = pb[j];
            if (a == 0.f && b == 0.f) continue;
            const float* vj = vb + j * KVH * 64 + 32 * half;
            __m256 v[4];
            for (int t = 0; t < 4; t++) v[t] = _mm256_loadu_ps(vj + 8 * t);
            if (a != 0.f) {
                const __m256 av = _mm256_set1_ps(a);
                for (int t = 0; t < 4; t++) oa[t] = _mm256_fmadd_ps(av, v[t], oa[t]);
            }
            if (b != 0.f) {
                const __m256 bv = _mm256_set1_ps(b);
                for (int t = 0; t < 4; t++) ob[t] = _mm256_fmadd_ps(bv, v[t], ob[t]);
            }
        }
        const __m256 ia = _mm256_set1_ps(inv[0]), ib = _mm256_set1_ps(inv[1]);
        for (int t = 0; t < 4; t++) {
            _mm256_storeu_ps(out + 32 * half + 8 * t, _mm256_mul_ps(oa[t], ia));
            _mm256_storeu_ps(out + 64 + 32 * half + 8 * t, _mm256_mul_ps(ob[t], ib));
        }
    }
}

// Rows r0 .. r0+nr-1 of one (sequence, KV head): they share its keys and values. Scores come 8 keys
// at a time from the keys transposed (KT [D, L8], packed by the caller): each score is a sum over d
// in order 0..D-1 in one vector lane, the same computation for every row and key whichever rows or
// keys share the vector. S: scratch [nr, L8] (L8 = L rounded up to 8).
// NI rows' scores for keys j .. j+7: sum over d in order, one lane per key
template <int NI>
static inline void scores8(const float* q, int64_t D, const float* KT, int64_t L8, int64_t j, __m256* acc) {
    for (int i = 0; i < NI; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 kd = _mm256_loadu_ps(KT + d * L8 + j);
        for (int i = 0; i < NI; i++) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + i * D + d), kd, acc[i]);
    }
}

static void score_rows(const float* q, int64_t r0, int64_t nr, const float* KT, const float* mask, int64_t Q,
                       int64_t L, int64_t D, float scale, float* S) {
    const int64_t L8 = (L + 7) / 8 * 8;
    const __m256 ninf = _mm256_set1_ps(-INFINITY), sc8 = _mm256_set1_ps(scale);
    float mtmp[8];
    __m256 acc[4];
    for (int64_t i0 = 0; i0 < nr; i0 += 4) {
        const int64_t ni = nr - i0 < 4 ? nr - i0 : 4;
        const float* qi = q + (r0 + i0) * D;
        for (int64_t j = 0; j < L8; j += 8) {
            switch (ni) {
                case 4: scores8<4>(qi, D, KT, L8, j, acc); break;
                case 3: scores8<3>(qi, D, KT, L8, j, acc); break;
                case 2: scores8<2>(qi, D, KT, L8, j, acc); break;
                default: scores8<1>(qi, D, KT, L8, j, acc);
            }
            for (int64_t i = 0; i < ni; i++) {
                const float* mrow = mask + ((r0 + i0 + i) % Q) * L;
                __m256 mk;
                if (j + 8 <= L) {
                    mk = _mm256_loadu_ps(mrow + j);
                } else {
                    for (int t = 0; t < 8; t++) mtmp[t] = j + t < L ? mrow[j + t] : -INFINITY;
                    mk = _mm256_loadu_ps(mtmp);
                }
                const __m256 sv = _mm256_add_ps(_mm256_mul_ps(acc[i], sc8), mk);
                // a masked key is -inf whatever its (possibly uninitialised) key held
                _mm256_storeu_ps(S + (i0 + i) * L8 + j, _mm256_blendv_ps(sv, ninf, _mm256_cmp_ps(mk, ninf, _CMP_EQ_OQ)));
            }
        }
    }
}

// Rows r0 .. r0+nr-1 of one (sequence, KV head): they share its keys and values. Scores come 8 keys
// at a time from the keys transposed (KT [D, L8], packed by the caller): each score is a sum over d
// in order 0..D-1 in one vector lane, the same computation for every row and key whichever rows or
// keys share the vector. S: scratch [nr, L8] (L8 = L rounded up to 8).
static void attn_rows(const float* q, int64_t r0, int64_t nr, const float* KT, const float* vb, const float* mask,
                      int64_t Q, int64_t L, int64_t KVH, int64_t D, float scale, float* S, float* out) {
    const int64_t L8 = (L + 7) / 8 * 8;
    score_rows(q, r0, nr, KT, mask, Q, L, D, scale, S);
    float inv[ATT_ROWS];
    for (int64_t i = 0; i < nr; i++) {
        float* si = S + i * L8;
        float mx = -INFINITY;
        for (int64_t j = 0; j < L; j++) mx = si[j] > mx ? si[j] : mx;
        const __m256 m8 = _mm256_set1_ps(mx == -INFINITY ? 0.f : mx);
        for (int64_t j = 0; j < L8; j += 8)
            _mm256_storeu_ps(si + j, exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(si + j), m8)));
        float l = 0.f;
        for (int64_t j = 0; j < L; j++) l += si[j];
        inv[i] = l > 0.f ? 1.f / l : 0.f;
    }
    int64_t i = 0;
    if (D == 64)  // the common head size: two rows at a time, half a row in registers each
        for (; i + 2 <= nr; i += 2) weighted_sum_2x64(S + i * L8, S + (i + 1) * L8, L, vb, KVH, inv + i, out + (r0 + i) * D);
    for (; i < nr; i++) {
        const float* si = S + i * L8;
        float* o = out + (r0 + i) * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.f;
        for (int64_t j = 0; j < L; j++) {
            const float p = si[j];
            if (p == 0.f) continue;  // masked or negligible: never read its value (padding may hold anything)
            const float* vj = vb + j * KVH * D;
            for (int64_t d = 0; d < D; d++) o[d] = fmaf(p, vj[d], o[d]);
        }
        for (int64_t d = 0; d < D; d++) o[d] *= inv[i];
    }
}

static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// keys of one (sequence, KV head) transposed: KT [D, L8], zero past L (a copy: exact)
static void pack_kt(const float* kb, int64_t L, int64_t KVH, int64_t D, float* KT) {
    const int64_t L8 = (L + 7) / 8 * 8;
    if (D % 8 == 0) {
        for (int64_t j = 0; j < L8; j += 8)
            for (int64_t d = 0; d < D; d += 8) {
                __m256 r[8];
                for (int t = 0; t < 8; t++)
                    r[t] = j + t < L ? _mm256_loadu_ps(kb + (j + t) * KVH * D + d) : _mm256_setzero_ps();
                transpose8(r);
                for (int t = 0; t < 8; t++) _mm256_storeu_ps(KT + (d + t) * L8 + j, r[t]);
            }
        return;
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = L; j < L8; j++) KT[d * L8 + j] = 0.f;
    for (int64_t j = 0; j < L; j++) {
        const float* kj = kb + j * KVH * D;
        for (int64_t d = 0; d < D; d++) KT[d * L8 + j] = kj[d];
    }
}

extern "C" {
// y = x @ W^T (+ add[M,N]) (+ bias[N]); add/bias may be NULL; add may alias y.
void specd_qgemm_i8(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale, int64_t N,
                    int64_t G, const float* add, const float* bias, float* y) {
    gemm<false>(x, M, K, q, scale, nullptr, N, G, add, bias, y, nullptr);
}

// xsum [M, K/G]: per-group sums of x (the caller's scratch; filled here when mins is not NULL)
void specd_qgemm_i4(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scale, const float* mins,
                    int64_t N, int64_t G, const float* add, const float* bias, float* y, float* xsum) {
    if (mins) group_sums(x, M, K, G, xsum);
    gemm<true>(x, M, K, q, scale, mins, N, G, add, bias, y, xsum);
}

// The same with int8 activations: qx int8 [M, K] and dx fp32 [M, K/32] are the caller's scratch,
// filled here from x (see the top).
void specd_qgemm_i8_q8(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale, int64_t N,
                       int64_t G, const float* add, const float* bias, float* y, int8_t* qx, float* dx) {
    quantize_q8(x, M, K, qx, dx);
    gemm_q8<false>(qx, dx, M, K, q, scale, nullptr, N, G, add, bias, y, nullptr);
}

void specd_qgemm_i4_q8(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scale,
                       const float* mins, int64_t N, int64_t G, const float* add, const float* bias, float* y,
                       float* xsum, int8_t* qx, float* dx) {
    if (mins) group_sums(x, M, K, G, xsum);
    quantize_q8(x, M, K, qx, dx);
    gemm_q8<true>(qx, dx, M, K, q, scale, mins, N, G, add, bias, y, xsum);
}

void specd_attention(const float* q, const float* kv, const float* mask, int64_t B, int64_t KVH, int64_t R,
                     int64_t Q, int64_t L, int64_t D, float scale, float* out) {
    const float* kbase = kv;
    const float* vbase = kv + B * L * KVH * D;
    const int64_t L8 = (L + 7) / 8 * 8;
#pragma omp parallel
    {
        float* S = new float[ATT_ROWS * (L8 > 0 ? L8 : 8)];
        float* KT = new float[D * (L8 > 0 ? L8 : 8)];
#pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++) {
                pack_kt(kbase + (b * L * KVH + h) * D, L, KVH, D, KT);
                for (int64_t r0 = 0; r0 < R; r0 += ATT_ROWS) {
                    const int64_t nr = R - r0 < ATT_ROWS ? R - r0 : ATT_ROWS;
                    attn_rows(q + (b * KVH + h) * R * D, r0, nr, KT, vbase + (b * L * KVH + h) * D, mask + b * Q * L,
                              Q, L, KVH, D, scale, S, out + (b * KVH + h) * R * D);
                }
            }
        delete[] S;
        delete[] KT;
    }
}
}
