// Weight-only quantized matmul for x86 CPUs with AVX2 + FMA: y[M,N] = x[M,K] @ W^T (+ add) (+ bias).
// (The int8-activation GEMM also has AVX512-VNNI and AMX tiles, chosen at run time: gemm_x8_512, gemm_x8_amx.)
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
// specd_qgemm_x8 (int8 activations) quantizes each row of x to int8 first (blocks of 32: d = max|x| /
// 127, q = round(x / d), GGUF Q8_0 / llama.cpp's activation format) and multiplies codes by codes in
// integers (maddubs: 32 products per instruction) from the interleaved weight layout of gemm_x8, each
// 32-block's integer sum then scaled in fp32.
// A row's result still depends on that row alone (its own blocks and scales), so speculation stays
// lossless; it is no longer equal to the fp32-activation result (a relative error ~1e-3 per output).
// Its block scales and mins are fp16 where they are halves exactly (GGUF's own, as llama.cpp reads
// them): 20 bytes per int4 block instead of 24, the same bits; a decode step streams its weights from
// memory (2-core Xeon: the int8-activation GEMMs of a step from L3 twice as long as from L2), so the
// smaller stream made a whole plain step ~20% faster there.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

#define PF_ROWS 8  // software prefetch distance in weight rows

// IEEE half (the bits torch.float16 stores): K/V cache elements, and the x8 layout's block scales and
// mins where they are halves exactly (GGUF stores Q4_0 / Q4_1 / Q8_0 ones so); widened to fp32 exactly
// on load (F16C), so every computation after the load is the same as from fp32 copies, bit for bit.
typedef uint16_t half_t;
static inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8(const half_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

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

// The x8 kernels' weights stream from memory once per call (a layer's are far larger than L2), each
// tile's blocks in order and a pass's tiles side by side in one contiguous run: the hardware's
// prefetchers stop at 4 KiB pages and fall behind once a pass also computes several rows, so each
// block asks for the bytes W_PREFETCH ahead of itself (measured on a 2-core Xeon, whole forward at a
// short context against no prefetch: 1 row -20%, 4 rows -30%; 8 KiB beat 1-4 KiB and tied 16 KiB;
// past the end of a weight it only wastes a few lines). SPECD_QGEMM_PREFETCH sets it (0: off).
static const int64_t W_PREFETCH = getenv("SPECD_QGEMM_PREFETCH") ? atol(getenv("SPECD_QGEMM_PREFETCH")) : 8192;

static inline void prefetch_w(const uint8_t* p, int64_t bytes) {
    if (W_PREFETCH > 0)
        for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch((const char*)p + W_PREFETCH + c, _MM_HINT_T0);
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

// ---------------------------------------------------------------------------------------------------
// The interleaved ("x8") layout for int8 activations: output rows in tiles of 8 (zero rows pad the
// last tile), and within a tile, per 32-block of k, 8 steps of 4 consecutive k for the 8 rows, so one
// 32-byte vector holds 4 weights for each of 8 output rows and a broadcast of 4 activation bytes
// multiplies all 8 rows at once (maddubs): the 8 outputs stay in the 8 lanes of one accumulator (no
// horizontal sums), and an int4 block's 8 steps sum in int16 before one widening (|sum| <= 8 * 2 *
// 15 * 127 < 2^15). A tile's weights are read once per call and kept in L1 for the next rows.
//   int4: per (tile, block) 128 bytes, vector v (0..3) byte 4c + i: low nibble code[8t + c][32b + 4v + i],
//         high nibble code[8t + c][32b + 16 + 4v + i]
//   int8: per (tile, block) 256 bytes, vector s (0..7) byte 4c + i: q[8t + c][32b + 4s + i]
//   scale, min: [tiles, K/32, 8] (a group of G > 32 repeated per block), fp32 or fp16 (S: half_t)
// A row's outputs: per block in order, acc = fma(float(isum), dw * dx, acc) then (int4 with mins)
// acc = fma(min, xsum_block, acc), xsum_block the fp32 sum of the row's 32 activations: the same ops
// for every row whatever M is, so a row's result depends on that row alone.
static inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

template <bool INT4, int R, class S>
static inline void x8_tile(const int8_t* qx, const float* dx, const float* xs, int64_t K, const uint8_t* w,
                           const S* sc, const S* mn, float* out /* [R, 8] */) {
    const int64_t nbk = K / 32;
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nbk; b++) {
        __m256i is[R];
        for (int r = 0; r < R; r++) is[r] = _mm256_setzero_si256();
        const int8_t* xb = qx + 32 * b;
        if (INT4) {
            const uint8_t* wb = w + 128 * b;
            prefetch_w(wb, 128);
            for (int v = 0; v < 4; v++) {
                const __m256i W = _mm256_loadu_si256((const __m256i*)(wb + 32 * v));
                const __m256i lo = _mm256_and_si256(W, mask), hi = _mm256_and_si256(_mm256_srli_epi16(W, 4), mask);
                for (int r = 0; r < R; r++) {
                    is[r] = _mm256_add_epi16(is[r], _mm256_maddubs_epi16(lo, bcast4(xb + r * K + 4 * v)));
                    is[r] = _mm256_add_epi16(is[r], _mm256_maddubs_epi16(hi, bcast4(xb + r * K + 16 + 4 * v)));
                }
            }
            for (int r = 0; r < R; r++) is[r] = _mm256_madd_epi16(is[r], ones);
        } else {
            const uint8_t* wb = w + 256 * b;
            prefetch_w(wb, 256);
            for (int s = 0; s < 8; s++) {
                const __m256i W = _mm256_loadu_si256((const __m256i*)(wb + 32 * s));
                const __m256i aw = _mm256_sign_epi8(W, W);
                for (int r = 0; r < R; r++) {
                    const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(xb + r * K + 4 * s), W));
                    is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(p, ones));
                }
            }
        }
        const __m256 dw = ld8(sc + 8 * b);
        const __m256 mv = INT4 && mn ? ld8(mn + 8 * b) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(dw, _mm256_broadcast_ss(dx + r * nbk + b)),
                                     acc[r]);
            if (INT4 && mn) acc[r] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(xs + r * nbk + b), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// Up to X8_RB rows of x per pass over a tile; M rows split into equal passes (9 = 5 + 4, not 8 + 1:
// a one-row pass costs nearly what a full one does).
#define X8_RB 8

template <bool INT4, class S>
static inline void x8_pass(int64_t r, const int8_t* xm, const float* dm, const float* sm, int64_t K,
                           const uint8_t* wt, const S* st, const S* mt, float* acc) {
    switch (r) {
        case 8: x8_tile<INT4, 8, S>(xm, dm, sm, K, wt, st, mt, acc); break;
        case 7: x8_tile<INT4, 7, S>(xm, dm, sm, K, wt, st, mt, acc); break;
        case 6: x8_tile<INT4, 6, S>(xm, dm, sm, K, wt, st, mt, acc); break;
        case 5: x8_tile<INT4, 5, S>(xm, dm, sm, K, wt, st, mt, acc); break;
        case 4: x8_tile<INT4, 4, S>(xm, dm, sm, K, wt, st, mt, acc); break;
        case 3: x8_tile<INT4, 3, S>(xm, dm, sm, K, wt, st, mt, acc); break;
        case 2: x8_tile<INT4, 2, S>(xm, dm, sm, K, wt, st, mt, acc); break;
        default: x8_tile<INT4, 1, S>(xm, dm, sm, K, wt, st, mt, acc);
    }
}

// ---- the same tiles on AVX512-VNNI (chosen at run time where the CPU has it) ----------------------
// Two 8-row tiles side by side in one 512-bit vector (16 output rows), and vpdpbusd (64 products summed
// into int32 per instruction) in place of maddubs + add + madd. The integer sums are exact in both
// (the int16 sums of the AVX2 path never saturate, see above), and the fp32 steps per output element
// (cvt, dw * dx, fma, the min's fma, block by block) are the same instructions lane by lane: the
// results are bitwise those of x8_tile, so which path runs never changes a token.
#define X512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni")))

X512 static inline __m512i cat256(const uint8_t* a, const uint8_t* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                              _mm256_loadu_si256((const __m256i*)b), 1);
}

X512 static inline __m512 cat256ps(const float* a, const float* b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

// the same from halves (block scales or mins stored as fp16), widened exactly
X512 static inline __m512 cat256ps(const half_t* a, const half_t* b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                                                   _mm_loadu_si128((const __m128i*)b), 1));
}

X512 static inline __m512i bcast4_512(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// tiles a and b (their weights wa / wb, scales sa / sb, mins ma / mb): out [R, 16], a's 8 rows then b's
template <bool INT4, int R, class S>
X512 static inline void x8_tile2(const int8_t* qx, const float* dx, const float* xs, int64_t K, const uint8_t* wa,
                                 const uint8_t* wb, const S* sa, const S* sb, const S* ma, const S* mb, float* out) {
    const int64_t nbk = K / 32;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nbk; b++) {
        __m512i is[R];
        for (int r = 0; r < R; r++) is[r] = _mm512_setzero_si512();
        const int8_t* xb = qx + 32 * b;
        if (INT4) {
            const uint8_t *pa = wa + 128 * b, *pb = wb + 128 * b;
            prefetch_w(pa, 128), prefetch_w(pb, 128);
            for (int v = 0; v < 4; v++) {
                const __m512i W = cat256(pa + 32 * v, pb + 32 * v);
                const __m512i lo = _mm512_and_si512(W, mask), hi = _mm512_and_si512(_mm512_srli_epi16(W, 4), mask);
                for (int r = 0; r < R; r++) {
                    is[r] = _mm512_dpbusd_epi32(is[r], lo, bcast4_512(xb + r * K + 4 * v));
                    is[r] = _mm512_dpbusd_epi32(is[r], hi, bcast4_512(xb + r * K + 16 + 4 * v));
                }
            }
        } else {
            const uint8_t *pa = wa + 256 * b, *pb = wb + 256 * b;
            prefetch_w(pa, 256), prefetch_w(pb, 256);
            for (int s = 0; s < 8; s++) {
                const __m512i W = cat256(pa + 32 * s, pb + 32 * s);
                const __m512i aw = _mm512_abs_epi8(W);
                const __mmask64 neg = _mm512_movepi8_mask(W);  // w < 0: the activation byte is negated
                for (int r = 0; r < R; r++) {
                    const __m512i x = bcast4_512(xb + r * K + 4 * s);
                    const __m512i sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
                    // sign_epi8 zeroes x where w == 0; |w| = 0 there, so the product is 0 either way
                    is[r] = _mm512_dpbusd_epi32(is[r], aw, sx);
                }
            }
        }
        const __m512 dw = cat256ps(sa + 8 * b, sb + 8 * b);
        const __m512 mv = INT4 && ma ? cat256ps(ma + 8 * b, mb + 8 * b) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nbk + b])),
                                     acc[r]);
            if (INT4 && ma) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nbk + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <bool INT4, class S>
X512 static inline void x8_pass2(int64_t r, const int8_t* xm, const float* dm, const float* sm, int64_t K,
                                 const uint8_t* wa, const uint8_t* wb, const S* sa, const S* sb, const S* ma,
                                 const S* mb, float* acc) {
#define X8_CASE(n) \
    case n: x8_tile2<INT4, n, S>(xm, dm, sm, K, wa, wb, sa, sb, ma, mb, acc); break;
    switch (r) {
        X8_CASE(8) X8_CASE(7) X8_CASE(6) X8_CASE(5) X8_CASE(4) X8_CASE(3) X8_CASE(2)
        default: x8_tile2<INT4, 1, S>(xm, dm, sm, K, wa, wb, sa, sb, ma, mb, acc);
    }
#undef X8_CASE
}

// 2: AMX (int8 tiles) for calls of AMX_MIN_ROWS rows or more, the AVX512-VNNI path below that;
// 1: the AVX512-VNNI path; 0: AVX2; -1 (start): the CPU decides (SPECD_QGEMM_AVX512=0 forces AVX2,
// SPECD_QGEMM_AMX=0 stops at AVX512-VNNI).
static int g_x8_isa = -1;

static bool env_off(const char* name) {
    const char* env = getenv(name);
    return env && strcmp(env, "0") == 0;
}

static bool cpu_avx512_vnni() {
    return !env_off("SPECD_QGEMM_AVX512") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
}

// AMX needs the CPU's tiles and the kernel's leave to use their state (Linux: arch_prctl, once per process)
static bool cpu_amx() {
    unsigned a, b, c, d;
    if (env_off("SPECD_QGEMM_AMX") || !cpu_avx512_vnni() || !__get_cpuid_count(7, 0, &a, &b, &c, &d) ||
        !(d & (1u << 24)) || !(d & (1u << 25)))  // AMX-TILE, AMX-INT8
        return false;
    static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}

static int x8_isa() {
    if (g_x8_isa < 0) g_x8_isa = cpu_amx() ? 2 : cpu_avx512_vnni() ? 1 : 0;
    return g_x8_isa;
}

// y's rows m0 .. m0+r-1, columns n0 .. n0+nc-1 from acc [r, 8] (+ bias, + add)
static inline void x8_store(const float* acc, int64_t r, int64_t m0, int64_t n0, int64_t nc, int64_t N,
                            const float* add, const float* bias, float* y) {
    for (int64_t i = 0; i < r; i++) {
        const int64_t m = m0 + i;
        for (int64_t j = 0; j < nc; j++) {
            float v = acc[8 * i + j];
            if (bias) v += bias[n0 + j];
            if (add) v += add[m * N + n0 + j];
            y[m * N + n0 + j] = v;
        }
    }
}

// x8_store (the same adds in the same order per element: the same bits) for acc rows of 16 columns on
// AVX512: a masked vector per row instead of a scalar loop with two tests per element (3-8% of the
// GEMMs at 4-32 rows)
X512 static inline void x8_store16(const float* acc, int64_t r, int64_t m0, int64_t n0, int64_t nc, int64_t N,
                                   const float* add, const float* bias, float* y) {
    const __mmask16 k = nc >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nc) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < r; i++) {
        const int64_t m = m0 + i;
        __m512 v = _mm512_loadu_ps(acc + 16 * i);
        if (bias) v = _mm512_add_ps(v, bv);
        if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, add + m * N + n0));
        _mm512_mask_storeu_ps(y + m * N + n0, k, v);
    }
}

// Output tile pair p of an x8-layout weight (tiles ta, tb; an odd last tile pairs with itself and its
// copy is dropped): its first output row n0, its nc live columns, each tile's mins (int4) or null
template <class S>
struct TilePair {
    int64_t ta, tb, n0, nc;
    const S *ma, *mb;
};

template <class S>
static inline TilePair<S> tile_pair(int64_t p, int64_t NT, int64_t N, int64_t nbk, const S* mins) {
    const int64_t ta = 2 * p, tb = ta + 1 < NT ? ta + 1 : ta, n0 = 8 * ta;
    const int64_t nc = tb == ta ? (N - n0 < 8 ? N - n0 : 8) : (N - n0 < 16 ? N - n0 : 16);
    return {ta, tb, n0, nc, mins ? mins + ta * nbk * 8 : nullptr, mins ? mins + tb * nbk * 8 : nullptr};
}

template <bool INT4, class S>
X512 static void gemm_x8_512(const int8_t* qx, const float* dx, const float* xs, int64_t M, int64_t K,
                             const uint8_t* w, const S* scale, const S* mins, int64_t N, const float* add,
                             const float* bias, float* y) {
    const int64_t nbk = K / 32, NT = (N + 7) / 8, tile_bytes = nbk * (INT4 ? 128 : 256);
    const int64_t passes = (M + X8_RB - 1) / X8_RB, rp = (M + passes - 1) / passes;
    const int64_t NP = (NT + 1) / 2;  // tile pairs; an odd last tile pairs with itself (its copy is dropped)
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < NP; p++) {
        const TilePair<S> tp = tile_pair(p, NT, N, nbk, mins);
        const int64_t ta = tp.ta, tb = tp.tb, n0 = tp.n0, nc = tp.nc;
        const S *ma = tp.ma, *mb = tp.mb;
        alignas(64) float acc[X8_RB * 16];
        for (int64_t m0 = 0; m0 < M; m0 += rp) {
            const int64_t r = M - m0 < rp ? M - m0 : rp;
            x8_pass2<INT4, S>(r, qx + m0 * K, dx + m0 * nbk, xs + m0 * nbk, K, w + ta * tile_bytes, w + tb * tile_bytes,
                           scale + ta * nbk * 8, scale + tb * nbk * 8, ma, mb, acc);
            x8_store16(acc, r, m0, n0, nc, N, add, bias, y);
        }
    }
}

// ---- AMX (Sapphire Rapids and later): the same integer sums from int8 tiles --------------------------
// Per pair of 8-row weight tiles (16 output rows) and 32-block of k, one tile op multiplies every
// activation row of the pass (up to 16) at once: A = the rows' 32 activation codes (signed), B = the
// block's weights as 8 rows of 4 k x 16 outputs (the x8 layout's vectors, int4 nibbles unpacked to
// bytes: unsigned; int8: signed), C = int32 [rows, 16]. The block's integer sums are exact, as
// vpdpbusd's are, and each row's fp32 steps are x8_tile2's (cvt, dw * dx, fma, the min's fma, block
// by block): the results are bitwise those of the other paths. A tile op costs the same for 1 or 16
// rows, so what a row adds is its fp32 steps; narrower calls (AMX_MIN_ROWS) stay on the AVX512-VNNI
// path. 17-32 rows share each unpacked B tile between two halves (amx_tile2_halves).
#define XAMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni,amx-tile,amx-int8")))
// rows from which the tiles win (measured on a 2-core Xeon: the unpacked int4 weights cost more to feed)
#define AMX_MIN_ROWS(INT4) ((INT4) ? 7 : 5)
#define AMX_ROWS 16
#define AMX_TAIL 3

struct TileCfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// ldtilecfg of c. GCC 12 drops the stores into c where the caller is not inlined (the instruction's
// read of c is invisible to it: the tiles then fault), so a barrier makes them happen first.
XAMX static inline void load_tile_config(const TileCfg& c) {
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

// tiles 0-3: C of up to 4 blocks [m, 16] int32; 4, 5: A [m, 32] int8; 6, 7: B [8, 64]
XAMX static void amx_config(int64_t m) {
    TileCfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = (uint8_t)m, c.colsb[t] = 64;
    for (int t = 4; t < 6; t++) c.rows[t] = (uint8_t)m, c.colsb[t] = 32;
    for (int t = 6; t < 8; t++) c.rows[t] = 8, c.colsb[t] = 64;
    load_tile_config(c);
}

// block b's weights of tiles a and b as a B tile [8, 64] in bb
template <bool INT4>
XAMX static inline void amx_unpack(const uint8_t* wa, const uint8_t* wb, int64_t b, uint8_t* bb) {
    const int64_t bytes = INT4 ? 128 : 256;  // one block of one tile
    prefetch_w(wa + bytes * b, bytes), prefetch_w(wb + bytes * b, bytes);
    if (INT4) {
        const __m512i mask = _mm512_set1_epi8(0x0F);
        for (int v = 0; v < 4; v++) {
            const __m512i W = cat256(wa + 128 * b + 32 * v, wb + 128 * b + 32 * v);
            _mm512_store_si512((__m512i*)(bb + 64 * v), _mm512_and_si512(W, mask));
            _mm512_store_si512((__m512i*)(bb + 64 * (4 + v)), _mm512_and_si512(_mm512_srli_epi16(W, 4), mask));
        }
    } else {
        for (int s = 0; s < 8; s++)
            _mm512_store_si512((__m512i*)(bb + 64 * s), cat256(wa + 256 * b + 32 * s, wb + 256 * b + 32 * s));
    }
}

#define AMX_DP(c, a, b)                  \
    do {                                 \
        if (INT4) _tile_dpbsud(c, a, b); \
        else _tile_dpbssd(c, a, b);      \
    } while (0)

// blocks b .. b+nb-1 (nb <= 4) of the pass's rows qx [m, K]: their int32 sums into cs [nb][m][16]
// (four C tiles, A and B tiles alternating, so consecutive tile ops do not wait on each other's loads)
template <bool INT4>
XAMX static inline void amx_blocks(const int8_t* qx, int64_t K, const uint8_t* wa, const uint8_t* wb, int64_t b,
                                   int nb, uint8_t* bb, int32_t* cs, int64_t m) {
    for (int i = 0; i < nb; i++) amx_unpack<INT4>(wa, wb, b + i, bb + 512 * i);
    _tile_zero(0);
    _tile_loadd(4, qx + 32 * b, K);
    _tile_loadd(6, bb, 64);
    AMX_DP(0, 4, 6);
    if (nb > 1) {
        _tile_zero(1);
        _tile_loadd(5, qx + 32 * (b + 1), K);
        _tile_loadd(7, bb + 512, 64);
        AMX_DP(1, 5, 7);
    }
    if (nb > 2) {
        _tile_zero(2);
        _tile_loadd(4, qx + 32 * (b + 2), K);
        _tile_loadd(6, bb + 1024, 64);
        AMX_DP(2, 4, 6);
    }
    if (nb > 3) {
        _tile_zero(3);
        _tile_loadd(5, qx + 32 * (b + 3), K);
        _tile_loadd(7, bb + 1536, 64);
        AMX_DP(3, 5, 7);
    }
    _tile_stored(0, cs, 64);
    if (nb > 1) _tile_stored(1, cs + 16 * m, 64);
    if (nb > 2) _tile_stored(2, cs + 32 * m, 64);
    if (nb > 3) _tile_stored(3, cs + 48 * m, 64);
}

// R rows of x (a pass) against tiles a and b: out [R, 16], as x8_tile2
template <bool INT4, int R, class S>
XAMX static void amx_tile2(const int8_t* qx, const float* dx, const float* xs, int64_t K, const uint8_t* wa,
                           const uint8_t* wb, const S* sa, const S* sb, const S* ma, const S* mb, float* out) {
    const int64_t nbk = K / 32;
    alignas(64) uint8_t bb[4 * 512];
    alignas(64) int32_t cs[4 * AMX_ROWS * 16];
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nbk; b0 += 4) {
        const int nb = nbk - b0 < 4 ? (int)(nbk - b0) : 4;
        amx_blocks<INT4>(qx, K, wa, wb, b0, nb, bb, cs, R);
        for (int i = 0; i < nb; i++) {
            const int64_t b = b0 + i;
            const __m512 dw = cat256ps(sa + 8 * b, sb + 8 * b);
            const __m512 mv = INT4 && ma ? cat256ps(ma + 8 * b, mb + 8 * b) : _mm512_setzero_ps();
            const int32_t* c = cs + 16 * R * i;
            for (int r = 0; r < R; r++) {
                const __m512 is = _mm512_cvtepi32_ps(_mm512_load_si512((const __m512i*)(c + 16 * r)));
                acc[r] = _mm512_fmadd_ps(is, _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nbk + b])), acc[r]);
                if (INT4 && ma) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nbk + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <bool INT4, class S>
XAMX static void amx_pass(int64_t r, const int8_t* xm, const float* dm, const float* sm, int64_t K, const uint8_t* wa,
                          const uint8_t* wb, const S* sa, const S* sb, const S* ma, const S* mb, float* acc) {
#define AMX_CASE(n) \
    case n: amx_tile2<INT4, n, S>(xm, dm, sm, K, wa, wb, sa, sb, ma, mb, acc); break;
    switch (r) {
        AMX_CASE(16) AMX_CASE(15) AMX_CASE(14) AMX_CASE(13) AMX_CASE(12) AMX_CASE(11) AMX_CASE(10) AMX_CASE(9)
        AMX_CASE(8) AMX_CASE(7) AMX_CASE(6) AMX_CASE(5) AMX_CASE(4) AMX_CASE(3) AMX_CASE(2)
        default: amx_tile2<INT4, 1, S>(xm, dm, sm, K, wa, wb, sa, sb, ma, mb, acc);
    }
#undef AMX_CASE
}

// 17-32 rows: two row halves (r0 + r1, each <= 16) against each block's B tile, loaded once for both
// (tiles 0, 2: C of blocks b, b+1 for the first half; 1, 3: for the second; 4, 5: A of the halves),
// the accumulators in memory (acc [r0 + r1, 16]); the same fp32 steps per row as amx_tile2
XAMX static void amx_config2(int64_t r0, int64_t r1) {
    TileCfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = (uint8_t)(t % 2 ? r1 : r0), c.colsb[t] = 64;
    c.rows[4] = (uint8_t)r0, c.rows[5] = (uint8_t)r1, c.colsb[4] = c.colsb[5] = 32;
    for (int t = 6; t < 8; t++) c.rows[t] = 8, c.colsb[t] = 64;
    load_tile_config(c);
}

template <bool INT4, class S>
XAMX static void amx_tile2_halves(int64_t r0, int64_t r1, const int8_t* qx, const float* dx, const float* xs,
                                  int64_t K, const uint8_t* wa, const uint8_t* wb, const S* sa, const S* sb,
                                  const S* ma, const S* mb, float* acc) {
    const int64_t nbk = K / 32, R = r0 + r1;
    const int8_t* q1 = qx + r0 * K;
    alignas(64) uint8_t bb[2 * 512];
    alignas(64) int32_t cs[2 * 2 * AMX_ROWS * 16];  // [block of the pair][row of the pass][16]
    for (int64_t r = 0; r < R; r++) _mm512_storeu_ps(acc + 16 * r, _mm512_setzero_ps());
    for (int64_t b0 = 0; b0 < nbk; b0 += 2) {
        const int nb = nbk - b0 < 2 ? 1 : 2;
        amx_unpack<INT4>(wa, wb, b0, bb);
        _tile_loadd(6, bb, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(4, qx + 32 * b0, K);
        _tile_loadd(5, q1 + 32 * b0, K);
        AMX_DP(0, 4, 6);
        AMX_DP(1, 5, 6);
        if (nb > 1) {
            amx_unpack<INT4>(wa, wb, b0 + 1, bb + 512);
            _tile_loadd(7, bb + 512, 64);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, qx + 32 * (b0 + 1), K);
            _tile_loadd(5, q1 + 32 * (b0 + 1), K);
            AMX_DP(2, 4, 7);
            AMX_DP(3, 5, 7);
        }
        _tile_stored(0, cs, 64);
        _tile_stored(1, cs + 16 * r0, 64);
        if (nb > 1) {
            _tile_stored(2, cs + 16 * R, 64);
            _tile_stored(3, cs + 16 * (R + r0), 64);
        }
        for (int i = 0; i < nb; i++) {
            const int64_t b = b0 + i;
            const __m512 dw = cat256ps(sa + 8 * b, sb + 8 * b);
            const __m512 mv = INT4 && ma ? cat256ps(ma + 8 * b, mb + 8 * b) : _mm512_setzero_ps();
            const int32_t* c = cs + 16 * R * i;
            for (int64_t r = 0; r < R; r++) {
                const __m512 is = _mm512_cvtepi32_ps(_mm512_load_si512((const __m512i*)(c + 16 * r)));
                __m512 a = _mm512_loadu_ps(acc + 16 * r);
                a = _mm512_fmadd_ps(is, _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nbk + b])), a);
                if (INT4 && ma) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nbk + b]), a);
                _mm512_storeu_ps(acc + 16 * r, a);
            }
        }
    }
}
#undef AMX_DP

template <bool INT4, class S>
XAMX static void gemm_x8_amx(const int8_t* qx, const float* dx, const float* xs, int64_t M, int64_t K,
                             const uint8_t* w, const S* scale, const S* mins, int64_t N, const float* add,
                             const float* bias, float* y) {
    const int64_t nbk = K / 32, NT = (N + 7) / 8, tile_bytes = nbk * (INT4 ? 128 : 256);
    // up to AMX_TAIL rows past a multiple of AMX_ROWS (a 16-request batch's few draft tokens) take the
    // AVX512-VNNI tile right after the tile ops, on the same weights (hot in L1), instead of a second
    // tile pass (2-core Xeon, whole forward: 17 rows 8.8-9.3 -> 8.0-8.4 ms, 33 rows 16.2-16.7 ->
    // 14.9-15.8; 6 such rows cost more than the tile pass)
    const int64_t tail = M > AMX_ROWS && M % AMX_ROWS <= AMX_TAIL ? M % AMX_ROWS : 0, Ma = M - tail;
    // passes of up to 2 * AMX_ROWS rows (two halves sharing each B tile), Ma split into equal passes
    const int64_t passes = (Ma + 2 * AMX_ROWS - 1) / (2 * AMX_ROWS), rp = (Ma + passes - 1) / passes;
    const int64_t NP = (NT + 1) / 2;
#pragma omp parallel
    {
        int64_t cfg = 0;  // the row count the tiles are configured for (per thread)
#pragma omp for schedule(static)
        for (int64_t p = 0; p < NP; p++) {
            const TilePair<S> tp = tile_pair(p, NT, N, nbk, mins);
            const int64_t ta = tp.ta, tb = tp.tb, n0 = tp.n0, nc = tp.nc;
            const S *ma = tp.ma, *mb = tp.mb;
            alignas(64) float acc[2 * AMX_ROWS * 16];
            for (int64_t m0 = 0; m0 < Ma; m0 += rp) {
                const int64_t r = Ma - m0 < rp ? Ma - m0 : rp, h0 = (r + 1) / 2;
                if (r != cfg) {
                    if (r <= AMX_ROWS) amx_config(r);
                    else amx_config2(h0, r - h0);
                    cfg = r;
                }
                const uint8_t *wa = w + ta * tile_bytes, *wb = w + tb * tile_bytes;
                const S *sa = scale + ta * nbk * 8, *sb = scale + tb * nbk * 8;
                if (r <= AMX_ROWS)
                    amx_pass<INT4, S>(r, qx + m0 * K, dx + m0 * nbk, xs + m0 * nbk, K, wa, wb, sa, sb, ma, mb, acc);
                else
                    amx_tile2_halves<INT4, S>(h0, r - h0, qx + m0 * K, dx + m0 * nbk, xs + m0 * nbk, K, wa, wb, sa, sb,
                                           ma, mb, acc);
                x8_store16(acc, r, m0, n0, nc, N, add, bias, y);
            }
            if (tail) {
                x8_pass2<INT4, S>(tail, qx + Ma * K, dx + Ma * nbk, xs + Ma * nbk, K, w + ta * tile_bytes,
                               w + tb * tile_bytes, scale + ta * nbk * 8, scale + tb * nbk * 8, ma, mb, acc);
                x8_store16(acc, tail, Ma, n0, nc, N, add, bias, y);
            }
        }
        if (cfg) _tile_release();
    }
}

template <bool INT4, class S>
static void gemm_x8(const int8_t* qx, const float* dx, const float* xs, int64_t M, int64_t K, const uint8_t* w,
                    const S* scale, const S* mins, int64_t N, const float* add, const float* bias, float* y) {
    const int isa = x8_isa();
    if (isa == 2 && M >= AMX_MIN_ROWS(INT4))
        return gemm_x8_amx<INT4, S>(qx, dx, xs, M, K, w, scale, mins, N, add, bias, y);
    if (isa >= 1) return gemm_x8_512<INT4, S>(qx, dx, xs, M, K, w, scale, mins, N, add, bias, y);
    const int64_t nbk = K / 32, NT = (N + 7) / 8, tile_bytes = nbk * (INT4 ? 128 : 256);
    const int64_t passes = (M + X8_RB - 1) / X8_RB, rp = (M + passes - 1) / passes;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < NT; t++) {
        const uint8_t* wt = w + t * tile_bytes;
        const S* st = scale + t * nbk * 8;
        const S* mt = mins ? mins + t * nbk * 8 : nullptr;
        const int64_t n0 = 8 * t, nc = N - n0 < 8 ? N - n0 : 8;
        alignas(32) float acc[X8_RB * 8];
        for (int64_t m0 = 0; m0 < M; m0 += rp) {
            const int64_t r = M - m0 < rp ? M - m0 : rp;
            x8_pass<INT4, S>(r, qx + m0 * K, dx + m0 * nbk, xs + m0 * nbk, K, wt, st, mt, acc);
            x8_store(acc, r, m0, n0, nc, N, add, bias, y);
        }
    }
}

// f(0) .. f(T-1), on every thread from ROWS_PAR rows (a layer's row-wise steps: norms, RoPE, SiLU, KV
// writes, group sums; each row its own computation, so the same bits), else on this one (an OpenMP
// region costs more than a few rows)
#define ROWS_PAR 32
template <class F>
static inline void for_rows(int64_t T, F f) {
    if (T >= ROWS_PAR) {
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; t++) f(t);
    } else {
        for (int64_t t = 0; t < T; t++) f(t);
    }
}

static void group_sums(const float* x, int64_t M, int64_t K, int64_t G, float* xsum) {
    const int64_t ng = K / G;
    for_rows(M, [&](int64_t m) {
        for (int64_t g = 0; g < ng; g++) {
            __m256 s = _mm256_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + m * K + k));
            xsum[m * ng + g] = hsum8(s);
        }
    });
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
// Keys ahead whose key / value rows are prefetched: the paged cache's rows (one head's 256 bytes of
// every 768 at SmolLM2's 3 KV heads, a new block every 16 keys) defeat the hardware prefetcher, and
// at batch 16 x 150 tokens the cache read per step is as large as the weights'.
#define KV_PREFETCH 16

// exp of x <= 0 (a score minus its row's max), 8 lanes, Cephes' expf polynomial (about 1 ulp);
// below -87.3 (and -inf, a masked key) exactly 0. Every key goes through this one function, so a
// key's weight never depends on where it falls in a vector.
// its constants, shared with the 16-lane version (exp_nonpos16) so the two cannot drift apart
static constexpr float EXP_LO = -87.3f, EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f,
                       EXP_LN2_LO = -2.12194440e-4f;
static constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
static inline __m256 exp_nonpos(__m256 x) {
    const __m256 lo = _mm256_set1_ps(EXP_LO);
    const __m256 xc = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 y = _mm256_set1_ps(EXP_P[0]);
    for (int k = 1; k < 6; k++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P[k]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 v = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
}

// K/V cache elements: fp32, or fp16 (half_t, see the top), widened to fp32 exactly on load (F16C),
// so every computation after the load is the fp32 cache's.
static inline float ld1(const float* p) { return *p; }
static inline float ld1(const half_t* p) { return _cvtsh_ss(*p); }
X512 static inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
X512 static inline __m512 ld16(const half_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// A value row's 32-column slice at p, fetched ahead: 128 bytes in fp32, 64 in fp16
template <class T>
static inline void prefetch_slice(const T* p) {
    _mm_prefetch((const char*)p, _MM_HINT_T0);
    if (sizeof(T) == 4) _mm_prefetch((const char*)p + 64, _MM_HINT_T0);
}

// Weighted sums of NR rows over one 32-column slice c0 .. c0+31 of the values: out_i[c] = (sum_j
// p_i[j] * v_j[c], one fmaf per key in key order) * inv_i; a key whose weight is 0 is skipped for
// that row (its value is never read for it). Every output element is its own fma chain over the keys
// in order, so which rows or columns share a pass (or an instruction set) changes no bit; the rows
// share each value row's load. p: the rows' weights, NR rows L8 apart; out: the rows' outputs.
#define WS_COLS 32
#define WS_MAX_ROWS 3  // AVX2: 3 rows x 4 accumulators + a broadcast fit the 16 ymm registers
template <int NR, class VRow>
static void wsum32(const float* p, int64_t L8, int64_t L, VRow vrow, int64_t c0, const float* inv,
                   float* const* out) {
    __m256 acc[NR][4];
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < 4; t++) acc[i][t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        if (j + KV_PREFETCH < L) prefetch_slice(vrow(j + KV_PREFETCH) + c0);
        const auto* vj = vrow(j) + c0;
        for (int i = 0; i < NR; i++) {
            const float w = p[i * L8 + j];
            if (w == 0.f) continue;
            const __m256 wv = _mm256_set1_ps(w);
            for (int t = 0; t < 4; t++) acc[i][t] = _mm256_fmadd_ps(wv, ld8(vj + 8 * t), acc[i][t]);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < 4; t++) _mm256_storeu_ps(out[i] + c0 + 8 * t, _mm256_mul_ps(acc[i][t], _mm256_set1_ps(inv[i])));
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

// rows a .. a+ni-1's scores of keys j .. j+7 (acc) scaled, masked (row r uses mask row r % Q) and
// stored at S [ni, L8] column j; a masked key is -inf whatever its (possibly uninitialised) key held
static inline void store_scores(const __m256* acc, int64_t ni, int64_t a, int64_t j, const float* mask, int64_t Q,
                                int64_t L, float scale, float* S, int64_t L8) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY), sc8 = _mm256_set1_ps(scale);
    float mtmp[8];
    for (int64_t i = 0; i < ni; i++) {
        const float* mrow = mask + ((a + i) % Q) * L;
        __m256 mk;
        if (j + 8 <= L) {
            mk = _mm256_loadu_ps(mrow + j);
        } else {
            for (int t = 0; t < 8; t++) mtmp[t] = j + t < L ? mrow[j + t] : -INFINITY;
            mk = _mm256_loadu_ps(mtmp);
        }
        const __m256 sv = _mm256_add_ps(_mm256_mul_ps(acc[i], sc8), mk);
        _mm256_storeu_ps(S + i * L8 + j, _mm256_blendv_ps(sv, ninf, _mm256_cmp_ps(mk, ninf, _CMP_EQ_OQ)));
    }
}

static void score_rows(const float* q, int64_t r0, int64_t nr, const float* KT, const float* mask, int64_t Q,
                       int64_t L, int64_t D, float scale, float* S) {
    const int64_t L8 = (L + 7) / 8 * 8;
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
            store_scores(acc, ni, r0 + i0, j, mask, Q, L, scale, S + i0 * L8, L8);
        }
    }
}

static inline void transpose8(__m256 r[8]);

// Keys j .. j+7 of the keys behind ``kptr`` (one pointer per key, the paged cache's rows; zero past
// L) transposed into KT8 [D, 8]: the 8-key slice of pack_kt's KT, built in L1 where it is used.
template <class T>
static inline void prefetch_rows(const T* const* ptr, int64_t j, int64_t n, int64_t L, int64_t bytes) {
    for (int64_t t = j; t < j + n && t < L; t++)
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)ptr[t] + b, _MM_HINT_T0);
}

template <class T>
static inline void pack8(const T* const* kptr, int64_t j, int64_t L, int64_t D, float* KT8, int64_t ld = 8) {
    prefetch_rows(kptr, j + KV_PREFETCH, 8, L, D * sizeof(T));
    if (D % 8 == 0) {
        for (int64_t d = 0; d < D; d += 8) {
            __m256 r[8];
            for (int t = 0; t < 8; t++) r[t] = j + t < L ? ld8(kptr[j + t] + d) : _mm256_setzero_ps();
            transpose8(r);
            for (int t = 0; t < 8; t++) _mm256_storeu_ps(KT8 + (d + t) * ld, r[t]);
        }
        return;
    }
    for (int64_t d = 0; d < D; d++)
        for (int t = 0; t < 8; t++) KT8[d * ld + t] = j + t < L ? ld1(kptr[j + t] + d) : 0.f;
}

// score_rows for keys j0 .. j1-1 (multiples of 8) read through ``kptr`` (no packed copy of the keys):
// the same scores, bit for bit (the same 8-key vectors, the same sum over d in order), keys in the
// outer loop; rows r0 .. r0+nr-1 of q (mask row r % Q) into S [nr, L8] (L8 = L rounded up to 8).
template <class T>
static void score_keys(const float* q, int64_t r0, int64_t nr, const T* const* kptr, int64_t j0, int64_t j1,
                       const float* mask, int64_t Q, int64_t L, int64_t D, float scale, float* S) {
    const int64_t L8 = (L + 7) / 8 * 8;
    alignas(32) float KT8[8 * 256];  // head_dim <= 256 (checked by the caller: fused.py)
    __m256 acc[4];
    prefetch_rows(kptr, j0, KV_PREFETCH, L, D * sizeof(T));  // (pack8 asks for the later ones)
    for (int64_t j = j0; j < j1; j += 8) {
        pack8(kptr, j, L, D, KT8);
        for (int64_t i0 = 0; i0 < nr; i0 += 4) {
            const int64_t ni = nr - i0 < 4 ? nr - i0 : 4;
            const float* qi = q + (r0 + i0) * D;
            switch (ni) {
                case 4: scores8<4>(qi, D, KT8, 8, 0, acc); break;
                case 3: scores8<3>(qi, D, KT8, 8, 0, acc); break;
                case 2: scores8<2>(qi, D, KT8, 8, 0, acc); break;
                default: scores8<1>(qi, D, KT8, 8, 0, acc);
            }
            store_scores(acc, ni, r0 + i0, j, mask, Q, L, scale, S + i0 * L8, L8);
        }
    }
}

// ---- the paged attention's scores and weighted sums on AVX512 (where the kernel's instruction set is
// AVX512-VNNI or AMX: x8_isa): 16 keys per score vector, a 64-wide value row in 4 vectors. Each score
// is still its own lane's sum over d in order, and each output element its own fma chain over keys
// in order: the AVX2 functions' bits.
static bool att_avx512() { return x8_isa() >= 1; }

template <int NI>
X512 static inline void scores16(const float* q, int64_t D, const float* KT16, __m512* acc) {
    for (int i = 0; i < NI; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 kd = _mm512_load_ps(KT16 + d * 16);
        for (int i = 0; i < NI; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * D + d]), kd, acc[i]);
    }
}

// scores16 for 32 keys (KT32 [D, 32]): each query broadcast feeds two key vectors, so a pass is
// bound by the FMAs rather than the loads; acc[i] keys 0-15, acc[4 + i] keys 16-31
template <int NI>
X512 static inline void scores32(const float* q, int64_t D, const float* KT32, __m512* acc) {
    for (int i = 0; i < NI; i++) acc[i] = acc[4 + i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 k0 = _mm512_load_ps(KT32 + d * 32), k1 = _mm512_load_ps(KT32 + d * 32 + 16);
        for (int i = 0; i < NI; i++) {
            const __m512 qb = _mm512_set1_ps(q[i * D + d]);
            acc[i] = _mm512_fmadd_ps(qb, k0, acc[i]), acc[4 + i] = _mm512_fmadd_ps(qb, k1, acc[4 + i]);
        }
    }
}

// store_scores for keys j .. j+15
X512 static inline void store_scores16(const __m512* acc, int64_t ni, int64_t a, int64_t j, const float* mask,
                                       int64_t Q, int64_t L, float scale, float* S, int64_t L8) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
    alignas(64) float mtmp[16];
    for (int64_t i = 0; i < ni; i++) {
        const float* mrow = mask + ((a + i) % Q) * L;
        __m512 mk;
        if (j + 16 <= L) {
            mk = _mm512_loadu_ps(mrow + j);
        } else {
            for (int t = 0; t < 16; t++) mtmp[t] = j + t < L ? mrow[j + t] : -INFINITY;
            mk = _mm512_load_ps(mtmp);
        }
        const __m512 sv = _mm512_add_ps(_mm512_mul_ps(acc[i], sc), mk);
        _mm512_storeu_ps(S + i * L8 + j, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mk, ninf, _CMP_EQ_OQ), sv, ninf));
    }
}

// scores16 or scores32 by NK
template <int NK, int NI>
X512 static inline void scores_nk(const float* qi, int64_t D, const float* KT, __m512* acc) {
    if constexpr (NK == 32)
        scores32<NI>(qi, D, KT, acc);
    else
        scores16<NI>(qi, D, KT, acc);
}

// rows r0 .. r0+nr-1's scores of the NK (16 or 32) keys at j, packed in KT [D, NK], into S (score_keys)
template <int NK>
X512 static inline void score_block(const float* q, int64_t r0, int64_t nr, const float* KT, int64_t j,
                                    const float* mask, int64_t Q, int64_t L, int64_t D, float scale, float* S) {
    const int64_t L8 = (L + 7) / 8 * 8;
    __m512 acc[8];
    for (int64_t i0 = 0; i0 < nr; i0 += 4) {
        const int64_t ni = nr - i0 < 4 ? nr - i0 : 4;
        const float* qi = q + (r0 + i0) * D;
        switch (ni) {
            case 4: scores_nk<NK, 4>(qi, D, KT, acc); break;
            case 3: scores_nk<NK, 3>(qi, D, KT, acc); break;
            case 2: scores_nk<NK, 2>(qi, D, KT, acc); break;
            default: scores_nk<NK, 1>(qi, D, KT, acc);
        }
        for (int h = 0; h < NK / 16; h++)
            store_scores16(acc + 4 * h, ni, r0 + i0, j + 16 * h, mask, Q, L, scale, S + i0 * L8, L8);
    }
}

// score_keys (the same arguments and bits), 32 keys at a time, then 16 (a last 8 through score_keys)
template <class T>
X512 static void score_keys_512(const float* q, int64_t r0, int64_t nr, const T* const* kptr, int64_t j0,
                                int64_t j1, const float* mask, int64_t Q, int64_t L, int64_t D, float scale, float* S) {
    alignas(64) float KT[32 * 256];  // head_dim <= 256 (checked by the caller: fused.py)
    prefetch_rows(kptr, j0, KV_PREFETCH, L, D * sizeof(T));
    int64_t j = j0;
    for (; j + 32 <= j1; j += 32) {
        for (int t = 0; t < 4; t++) pack8(kptr, j + 8 * t, L, D, KT + 8 * t, 32);
        score_block<32>(q, r0, nr, KT, j, mask, Q, L, D, scale, S);
    }
    for (; j + 16 <= j1; j += 16) {
        for (int t = 0; t < 2; t++) pack8(kptr, j + 8 * t, L, D, KT + 8 * t, 16);
        score_block<16>(q, r0, nr, KT, j, mask, Q, L, D, scale, S);
    }
    if (j < j1) score_keys(q, r0, nr, kptr, j, j1, mask, Q, L, D, scale, S);
}

// wsum32 (the same bits) on AVX512: up to 8 rows x 2 accumulators in registers. Keys go 16 at a
// time: where none of the block's weights is 0 in any row (a decode row's keys, nearly always), the
// block runs without the per-key zero tests (each weight broadcast straight into its fma); a block
// with a zero weight, and the last keys, take them key by key. Either way every accumulator gets the
// same fmas in the same key order, so the same bits.
#define WS_MAX_ROWS_512 8
// key j's value slice into NR rows' accumulators; ZEROS: skip a row whose weight is 0 (its value is
// then never read for it), else every weight is known non-zero
template <int NR, bool ZEROS, class VRow>
X512 static inline void wsum_key_512(const float* p, int64_t L8, int64_t L, int64_t j, VRow vrow, int64_t c0,
                                     __m512 (*acc)[2]) {
    if (j + KV_PREFETCH < L) prefetch_slice(vrow(j + KV_PREFETCH) + c0);
    const auto* vj = vrow(j) + c0;
    const __m512 v0 = ld16(vj), v1 = ld16(vj + 16);
    for (int i = 0; i < NR; i++) {
        const float w = p[i * L8 + j];
        if (ZEROS && w == 0.f) continue;
        const __m512 wv = _mm512_set1_ps(w);
        acc[i][0] = _mm512_fmadd_ps(wv, v0, acc[i][0]), acc[i][1] = _mm512_fmadd_ps(wv, v1, acc[i][1]);
    }
}

template <int NR, class VRow>
X512 static void wsum32_512(const float* p, int64_t L8, int64_t L, VRow vrow, int64_t c0, const float* inv,
                            float* const* out) {
    __m512 acc[NR][2];
    for (int i = 0; i < NR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const __m512 zero = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
        __mmask16 z = 0;
        for (int i = 0; i < NR; i++) z |= _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i * L8 + j), zero, _CMP_EQ_OQ);
        if (z)
            for (int64_t t = j; t < j + 16; t++) wsum_key_512<NR, true>(p, L8, L, t, vrow, c0, acc);
        else
            for (int64_t t = j; t < j + 16; t++) wsum_key_512<NR, false>(p, L8, L, t, vrow, c0, acc);
    }
    for (; j < L; j++) wsum_key_512<NR, true>(p, L8, L, j, vrow, c0, acc);
    for (int i = 0; i < NR; i++) {
        const __m512 s = _mm512_set1_ps(inv[i]);
        _mm512_storeu_ps(out[i] + c0, _mm512_mul_ps(acc[i][0], s));
        _mm512_storeu_ps(out[i] + c0 + 16, _mm512_mul_ps(acc[i][1], s));
    }
}

// The most rows one weighted-sum pass takes on this machine's instruction set
static int64_t ws_max_rows() { return att_avx512() ? WS_MAX_ROWS_512 : WS_MAX_ROWS; }

// n (1 .. ws_max_rows()) rows' weighted sums over columns c0 .. c0+31 (wsum32 / wsum32_512)
template <class VRow>
static void wsum_rows(int64_t n, const float* p, int64_t L8, int64_t L, VRow vrow, int64_t c0, const float* inv,
                      float* const* out) {
#define WS_CASE(k) \
    case k: (att_avx512() ? wsum32_512<k, VRow> : wsum32<k, VRow>)(p, L8, L, vrow, c0, inv, out); return;
    switch (n) {
        WS_CASE(1) WS_CASE(2) WS_CASE(3)
    }
#undef WS_CASE
#define WS_CASE(k) \
    case k: wsum32_512<k, VRow>(p, L8, L, vrow, c0, inv, out); return;
    switch (n) {
        WS_CASE(4) WS_CASE(5) WS_CASE(6) WS_CASE(7) WS_CASE(8)
    }
#undef WS_CASE
}

// exp_nonpos on 16 lanes (AVX512: the same operations lane by lane, so the same bits)
X512 static inline __m512 exp_nonpos16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(EXP_LO);
    const __m512 xc = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 y = _mm512_set1_ps(EXP_P[0]);
    for (int k = 1; k < 6; k++) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P[k]));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __m512 v = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), v, _mm512_setzero_ps());
}

// si[j] = exp_nonpos(si[j] - m) 16 lanes at a time for j in 0 .. 16 * (L8 / 16) - 1; returns where
// it stopped (the caller takes the rest 8 lanes at a time)
X512 static int64_t exps_512(float* si, int64_t L8, float m) {
    const __m512 m16 = _mm512_set1_ps(m);
    int64_t j = 0;
    for (; j + 16 <= L8; j += 16) _mm512_storeu_ps(si + j, exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(si + j), m16)));
    return j;
}

// Each of n rows' softmax in place over its L keys (rows L8 apart; keys L .. L8-1 hold -inf), 1 / its
// sum into inv: the max (exact: row_max), the exps (exp_nonpos), then the sum in key order, each row
// its own scalar chain (up to SUM_ROWS rows' chains interleaved: one chain waits an add's latency per
// key): a row's bits never depend on which rows share the call, and a tree node's sum equals the same
// token's decoded one by one.
#define SUM_ROWS 8
template <int NR>
static void row_sums(const float* S, int64_t L8, int64_t L, float* l) {
    float a[NR];
    for (int i = 0; i < NR; i++) a[i] = 0.f;
    for (int64_t j = 0; j < L; j++)
        for (int i = 0; i < NR; i++) a[i] += S[i * L8 + j];
    for (int i = 0; i < NR; i++) l[i] = a[i];
}

// The largest of si[0 .. L8-1] (L8 a multiple of 8): four independent max chains (a max waits on
// the last one's latency), any order giving the same value (max is exact; -0 or +0 for a zero max
// makes no difference to the exps)
static inline float row_max(const float* si, int64_t L8) {
    __m256 m[4];
    for (int k = 0; k < 4; k++) m[k] = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 32 <= L8; j += 32)
        for (int k = 0; k < 4; k++) m[k] = _mm256_max_ps(m[k], _mm256_loadu_ps(si + j + 8 * k));
    for (; j < L8; j += 8) m[0] = _mm256_max_ps(m[0], _mm256_loadu_ps(si + j));
    alignas(32) float t[8];
    _mm256_store_ps(t, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    float mx = -INFINITY;
    for (int k = 0; k < 8; k++) mx = t[k] > mx ? t[k] : mx;
    return mx;
}

static void softmax_rows(float* S, int64_t n, int64_t L, float* inv) {
    const int64_t L8 = (L + 7) / 8 * 8;
    for (int64_t i = 0; i < n; i++) {
        float* si = S + i * L8;
        const float mx = row_max(si, L8);
        const float m0 = mx == -INFINITY ? 0.f : mx;
        int64_t j = att_avx512() ? exps_512(si, L8, m0) : 0;
        const __m256 m8 = _mm256_set1_ps(m0);
        for (; j < L8; j += 8) _mm256_storeu_ps(si + j, exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(si + j), m8)));
    }
    for (int64_t i = 0; i < n; i += SUM_ROWS) {
        float l[SUM_ROWS];
#define SUM_CASE(k) \
    case k: row_sums<k>(S + i * L8, L8, L, l); break;
        switch (n - i < SUM_ROWS ? n - i : SUM_ROWS) {
            SUM_CASE(8) SUM_CASE(7) SUM_CASE(6) SUM_CASE(5) SUM_CASE(4) SUM_CASE(3) SUM_CASE(2)
            default: row_sums<1>(S + i * L8, L8, L, l);
        }
#undef SUM_CASE
        for (int64_t k = 0; k < SUM_ROWS && i + k < n; k++) inv[i + k] = l[k] > 0.f ? 1.f / l[k] : 0.f;
    }
}

// Rows 0 .. n-1's weighted sums (their weights in S, L8 apart, 1 / sums in inv) into out[0 .. n-1]:
// per 32-column slice, rows in passes of at most ws_max_rows(); a head size that is not a multiple of
// 32 one row and column at a time (the same fmaf chains).
template <class VRow>
static void weighted_sums(int64_t n, const float* S, int64_t L, VRow vrow, int64_t D, const float* inv,
                          float* const* out) {
    const int64_t L8 = (L + 7) / 8 * 8, mr = ws_max_rows();
    if (D % WS_COLS == 0) {
        for (int64_t c0 = 0; c0 < D; c0 += WS_COLS)
            for (int64_t i = 0; i < n; i += mr)
                wsum_rows(n - i < mr ? n - i : mr, S + i * L8, L8, L, vrow, c0, inv + i, out + i);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const float* si = S + i * L8;
        float* o = out[i];
        for (int64_t d = 0; d < D; d++) o[d] = 0.f;
        for (int64_t j = 0; j < L; j++) {
            const float w = si[j];
            if (w == 0.f) continue;  // masked or negligible: never read its value (padding may hold anything)
            const auto* vj = vrow(j);
            for (int64_t d = 0; d < D; d++) o[d] = fmaf(w, ld1(vj + d), o[d]);
        }
        for (int64_t d = 0; d < D; d++) o[d] *= inv[i];
    }
}

// Rows r0 .. r0+nr-1 of one (sequence, KV head), their scores already in S [nr, L8] (L8 = L rounded
// up to 8; score_rows / score_keys): each row's softmax over its keys and its weighted sum of the
// values (V row j at vrow(j)) into out rows r0 .. r0+nr-1, the same computation whichever rows share
// the call.
template <class VRow>
static void attn_finish(int64_t r0, int64_t nr, VRow vrow, int64_t L, int64_t D, float* S, float* out) {
    float inv[ATT_ROWS];
    float* outp[ATT_ROWS];
    softmax_rows(S, nr, L, inv);
    for (int64_t i = 0; i < nr; i++) outp[i] = out + (r0 + i) * D;
    weighted_sums(nr, S, L, vrow, D, inv, outp);
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

// ---------------------------------------------------------------------------------------------------
// One decoder layer of a quantized Llama-family model in one call (``specd.model.fused``): the ~60
// small torch ops of a layer cost more than its matmuls at decode widths. Every step is row-wise
// (RMSNorm, RoPE, SiLU), row-independent (the quantized matmuls above) or the row-at-a-time
// attention above, so a row's result depends on that row alone, as on the op-by-op path.
// kind 0 int8 / 1 int4 (fp32 activations); 2 int8 / 3 int4 (x8 layout, int8 activations), fp32 scales
// and mins; 4 / 5: the same with half scales and mins (X8_HALF)
struct Lin {
    int64_t kind, N, K, G, Kin;  // K: the padded row length (a multiple of 32), Kin <= K: x's row length
    const void* w;
    const void* scale;
    const void* mins;
    const float* bias;
};
#define X8_INT4 1  // kinds 2-5 less 2: bit 0 int4, bit 1 half scales (specd_qgemm_x8's fmt)
#define X8_HALF 2

template <class S>
static void lin_x8(const Lin& L, const int8_t* qs, const float* dx, const float* xs, int64_t M, const float* add,
                   float* y) {
    const S *sc = (const S*)L.scale, *mn = (const S*)L.mins;
    if ((L.kind - 2) & X8_INT4)
        gemm_x8<true, S>(qs, dx, xs, M, L.K, (const uint8_t*)L.w, sc, mn, L.N, add, L.bias, y);
    else
        gemm_x8<false, S>(qs, dx, xs, M, L.K, (const uint8_t*)L.w, sc, nullptr, L.N, add, L.bias, y);
}

// y = x @ W^T (+ bias) (+ add); add may alias y
static void lin(const Lin& L, const float* x, int64_t M, const float* add, float* y, std::vector<float>& fs,
                std::vector<int8_t>& qs, std::vector<float>& xp) {
    const int64_t K = L.K, nbk = K / 32;
    if (L.Kin != K) {  // zero-pad the rows to K
        xp.assign(M * K, 0.f);
        for (int64_t m = 0; m < M; m++) memcpy(xp.data() + m * K, x + m * L.Kin, L.Kin * sizeof(float));
        x = xp.data();
    }
    if (L.kind >= 2) {
        fs.resize(2 * M * nbk);
        qs.resize(M * K);
        float *xs = fs.data(), *dx = xs + M * nbk;
        if (((L.kind - 2) & X8_INT4) && L.mins) group_sums(x, M, K, 32, xs);
        quantize_q8(x, M, K, qs.data(), dx);
        if ((L.kind - 2) & X8_HALF)
            lin_x8<half_t>(L, qs.data(), dx, xs, M, add, y);
        else
            lin_x8<float>(L, qs.data(), dx, xs, M, add, y);
    } else if (L.kind == 1) {
        fs.resize(M * (K / L.G));
        if (L.mins) group_sums(x, M, K, L.G, fs.data());
        gemm<true>(x, M, K, L.w, (const float*)L.scale, (const float*)L.mins, L.N, L.G, add, L.bias, y, fs.data());
    } else {
        gemm<false>(x, M, K, L.w, (const float*)L.scale, nullptr, L.N, L.G, add, L.bias, y, nullptr);
    }
}

// h = x * rsqrt(mean(x^2) + eps) * w, row by row (the sum of squares per 8 lanes, then the lanes)
static void rms_rows(const float* x, int64_t T, int64_t d, const float* w, float eps, float* h) {
    for_rows(T, [&](int64_t t) {
        const float* xr = x + t * d;
        __m256 s = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= d; k += 8) {
            const __m256 v = _mm256_loadu_ps(xr + k);
            s = _mm256_fmadd_ps(v, v, s);
        }
        float ss = hsum8(s);
        for (; k < d; k++) ss += xr[k] * xr[k];
        const float r = 1.0f / sqrtf(ss / (float)d + eps);
        for (k = 0; k < d; k++) h[t * d + k] = (xr[k] * r) * w[k];
    });
}

// RoPE (rotate_half convention) on the first nh heads of each row of qkv [T, stride]
static void rope_rows(float* qkv, int64_t T, int64_t stride, int64_t nh, int64_t D, const float* cos,
                      const float* sin, const int64_t* pos) {
    const int64_t h2 = D / 2;
    for_rows(T, [&](int64_t t) {
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (int64_t hh = 0; hh < nh; hh++) {
            float* v = qkv + t * stride + hh * D;
            for (int64_t i = 0; i < h2; i++) {
                const float a = v[i], b = v[i + h2];
                v[i] = a * c[i] - b * s[i];
                v[i + h2] = b * c[i + h2] + a * s[i + h2];
            }
        }
    });
}

// a[t, j] = silu(gu[t, j]) * gu[t, inter + j]; silu(x) = x * (x >= 0 ? 1 : e) / (1 + e), e = exp(-|x|)
static void silu_mul_rows(const float* gu, int64_t T, int64_t inter, float* a) {
    const __m256 one = _mm256_set1_ps(1.0f), signbit = _mm256_set1_ps(-0.0f);
    for_rows(T, [&](int64_t t) {
        const float *g = gu + t * 2 * inter, *u = g + inter;
        float* o = a + t * inter;
        int64_t j = 0;
        for (; j + 8 <= inter; j += 8) {
            const __m256 x = _mm256_loadu_ps(g + j);
            const __m256 e = exp_nonpos(_mm256_or_ps(x, signbit));  // exp(-|x|)
            const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
            const __m256 sv = _mm256_div_ps(_mm256_mul_ps(x, num), _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(sv, _mm256_loadu_ps(u + j)));
        }
        for (; j < inter; j++) {
            const float x = g[j], e = expf(-fabsf(x));
            o[j] = x * (x >= 0.f ? 1.f : e) / (1.f + e) * u[j];
        }
    });
}

// key and value rows of (sequence b, KV head h) for positions 0 .. Lp-1, through the block table (a
// block at a time: a division per key cost ~3% of a one-row step at 900 tokens)
template <class E>
static inline void kv_rows(const E* kv, const E* vbase, int64_t b, int64_t h, int64_t KVH, int64_t D,
                           const int32_t* bt, int64_t maxb, int64_t BS, int64_t Lp, const E** kp, const E** vp) {
    const int64_t step = KVH * D;  // one slot to the next within a block
    for (int64_t j0 = 0, blk = 0; j0 < Lp; j0 += BS, blk++) {
        const int64_t off = ((int64_t)bt[b * maxb + blk] * BS * KVH + h) * D, n = Lp - j0 < BS ? Lp - j0 : BS;
        const E *k0 = kv + off, *v0 = vbase + off;
        for (int64_t i = 0; i < n; i++) kp[j0 + i] = k0 + i * step, vp[j0 + i] = v0 + i * step;
    }
}

static inline void grow(std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
}

// The same attention in two parallel phases, for decode and verification widths (all scores fit in
// ATT2_MAX_BYTES): (1) scores of every row of a (sequence, KV head) for one chunk of ATT2_CHUNK keys
// per task (each score is its own lane's sum, so who computes which keys changes no bit), (2) the
// rows' softmax, SUM_ROWS rows per task, (3) the weighted sums per 32-column slice of the values and
// group of rows (each element its own chain over keys in order), as attn_finish computes them. Balances the
// work over threads where one task per (sequence, KV head) could not (batch 1: 3 KV heads for 2
// threads), and a decode row's 3 query heads read each value slice once. Head sizes that are not a
// multiple of 32 take the one-phase kernel.
#define ATT2_CHUNK 256
#define ATT2_MAX_BYTES (16 << 20)  // SPECD_ATT2_MAX_BYTES overrides (0: always the one-phase kernel)

static double att2_max_bytes() {
    const char* e = getenv("SPECD_ATT2_MAX_BYTES");
    return e ? atof(e) : (double)ATT2_MAX_BYTES;
}

// Whether a call's attention is worth a second thread: its work, keys x (rows + 8) per sequence and
// KV head (the 8: a key's fixed cost, its fetch and pack, in rows' worth), against ATT_PAR_WORK.
// Below it one thread runs the same tasks: on a 2-core Xeon (eval/att_rows.cpp with COLD=1, the
// cache out of L2 as in a step; 30 layers) one thread saved the phases' barriers at 8 cached tokens
// (1 row 0.28-0.32 -> 0.18-0.21 ms per step, 4 rows 0.39-0.43 -> 0.28-0.30) and at 64 tokens and
// one row (0.42-0.45 -> 0.38-0.40), and lost from 128 tokens (two threads fetch the keys faster).
// Who runs a task changes no bit.
#define ATT_PAR_WORK 3000  // SPECD_ATT_PAR_WORK overrides (0: always parallel)

static bool att_parallel(const int32_t* qsl, int64_t B, int64_t G, int64_t KVH, int64_t Lp) {
    const char* e = getenv("SPECD_ATT_PAR_WORK");
    const double limit = e ? atof(e) : (double)ATT_PAR_WORK;
    double work = 0;
    for (int64_t b = 0; b < B; b++) work += (double)KVH * Lp * (G * (qsl[b + 1] - qsl[b]) + 8);
    return work >= limit;
}

template <class E>
static bool paged_attention_2p(const float* qkv, int64_t stride, int64_t H, int64_t KVH, int64_t D, const E* kv,
                               int64_t nslots, const int32_t* qsl, int64_t B, const int32_t* bt, int64_t maxb,
                               int64_t BS, const float* bias, int64_t Qm, int64_t Lp, float scale, float* o) {
    const int64_t G = H / KVH, L8 = (Lp + 7) / 8 * 8, T = qsl[B] - qsl[0];
    if (D % WS_COLS || (double)G * KVH * T * L8 * sizeof(float) > att2_max_bytes()) return false;
    const int64_t mr = ws_max_rows(), ngm = (G * Qm + mr - 1) / mr;  // row groups per (sequence, KV head), at most
    const E* vbase = kv + nslots * KVH * D;
    // scratch of the calling thread, kept between calls (grown, never cleared: every element read is
    // written first; allocating and zeroing it per layer cost 4-7% of a step: page faults on fresh
    // mmap'd memory); the threads use it through the pointers. Per (b, h): its rows (g * q + i) from
    // row base(b, h) of S and QG, its keys' and values' rows in KP and VP.
    static thread_local std::vector<float> s_buf, qg_buf, inv_buf;
    grow(s_buf, G * KVH * T * L8), grow(qg_buf, G * KVH * T * D), grow(inv_buf, G * KVH * T);
    float *const S = s_buf.data(), *const QG = qg_buf.data(), *const INV = inv_buf.data();
    static thread_local std::vector<const E*> kp_buf, vp_buf;
    if ((int64_t)kp_buf.size() < B * KVH * Lp) kp_buf.resize(B * KVH * Lp), vp_buf.resize(B * KVH * Lp);
    const E** const KP = kp_buf.data();
    const E** const VP = vp_buf.data();
    const int64_t nch = (L8 + ATT2_CHUNK - 1) / ATT2_CHUNK;
    auto base = [&](int64_t b, int64_t h) { return (h * T + (qsl[b] - qsl[0])) * G; };
#pragma omp parallel if (att_parallel(qsl, B, G, KVH, Lp))
    {
#pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++) {
                const int64_t t0 = qsl[b], q = qsl[b + 1] - qsl[b];
                float* qg = QG + base(b, h) * D;
                for (int64_t g = 0; g < G; g++)
                    for (int64_t i = 0; i < q; i++)
                        memcpy(qg + (g * q + i) * D, qkv + (t0 + i) * stride + (h * G + g) * D, D * sizeof(float));
                kv_rows(kv, vbase, b, h, KVH, D, bt, maxb, BS, Lp, KP + (b * KVH + h) * Lp,
                        VP + (b * KVH + h) * Lp);
            }
#pragma omp for schedule(dynamic) collapse(3)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++)
                for (int64_t c = 0; c < nch; c++) {
                    const int64_t q = qsl[b + 1] - qsl[b], R = G * q, j0 = c * ATT2_CHUNK;
                    const int64_t j1 = j0 + ATT2_CHUNK < L8 ? j0 + ATT2_CHUNK : L8;
                    if (R > 0)
                        (att_avx512() ? score_keys_512<E> : score_keys<E>)(QG + base(b, h) * D, 0, R, KP + (b * KVH + h) * Lp, j0, j1,
                                   bias + b * Qm * Lp, q, Lp, D, scale, S + base(b, h) * L8);
                }
#pragma omp for schedule(dynamic) collapse(3)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++)
                for (int64_t r0 = 0; r0 < G * Qm; r0 += SUM_ROWS) {
                    const int64_t R = G * (qsl[b + 1] - qsl[b]);
                    if (r0 < R)
                        softmax_rows(S + (base(b, h) + r0) * L8, R - r0 < SUM_ROWS ? R - r0 : SUM_ROWS, Lp,
                                     INV + base(b, h) + r0);
                }
#pragma omp for schedule(dynamic) collapse(4)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++)
                for (int64_t c0 = 0; c0 < D; c0 += WS_COLS)
                    for (int64_t k = 0; k < ngm; k++) {
                        const int64_t t0 = qsl[b], q = qsl[b + 1] - qsl[b], R = G * q;
                        const int64_t ng = (R + mr - 1) / mr, n = ng ? (R + ng - 1) / ng : 0, r0 = k * n;
                        if (r0 >= R) continue;
                        float* outp[WS_MAX_ROWS_512];
                        const int64_t nk = R - r0 < n ? R - r0 : n;
                        for (int64_t i = 0; i < nk; i++) {
                            const int64_t r = r0 + i, g = r / q;
                            outp[i] = o + (t0 + r % q) * H * D + (h * G + g) * D;
                        }
                        const E* const* vp = VP + (b * KVH + h) * Lp;
                        wsum_rows(nk, S + (base(b, h) + r0) * L8, L8, Lp, [vp](int64_t j) { return vp[j]; },
                                  c0, INV + base(b, h) + r0, outp);
                    }
    }
    return true;
}

// Attention of every query of every sequence over the paged cache, each (sequence, KV head) with the
// same scores, softmax and weighted sums as specd_attention (bit for bit), reading keys and values
// in place through the block table: one pointer per key, keys transposed 8 at a time in L1 (a packed
// copy of the whole context per layer cost more than the attention itself at 2k tokens).
//   qkv [T, stride] (q heads first), kv [2, nslots, KVH, D], bias [B, Qm, Lp] additive, o [T, H * D]
template <class E>
static void paged_attention(const float* qkv, int64_t stride, int64_t H, int64_t KVH, int64_t D, const E* kv,
                            int64_t nslots, const int32_t* qsl, int64_t B, const int32_t* bt, int64_t maxb,
                            int64_t BS, const float* bias, int64_t Qm, int64_t Lp, float scale, float* o) {
    const int64_t G = H / KVH, L8 = (Lp + 7) / 8 * 8;
    const int64_t nrg = (G * Qm + ATT_ROWS - 1) / ATT_ROWS;  // row groups per (sequence, KV head), at most
    const E* vbase = kv + nslots * KVH * D;
#pragma omp parallel if (att_parallel(qsl, B, G, KVH, Lp))
    {
        // per-thread scratch kept between calls (grown, never cleared: every element read is written first)
        static thread_local std::vector<float> S, QG, OUT;
        static thread_local std::vector<const E*> KP, VP;
        grow(S, ATT_ROWS * L8), grow(QG, G * Qm * D), grow(OUT, G * Qm * D);
        if ((int64_t)KP.size() < Lp) KP.resize(Lp), VP.resize(Lp);
        int64_t have = -1;  // the (sequence, KV head) whose key and value rows KP / VP hold in this call
        // one task per group of ATT_ROWS rows of a (sequence, KV head): a prefill chunk of one
        // sequence has 3 KV heads for 2 threads, so one task per head left a thread idle a third of
        // the time; row r of (b, h) is query r % q of head h * G + r / q
#pragma omp for schedule(dynamic) collapse(3)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++)
                for (int64_t k = 0; k < nrg; k++) {
                    const int64_t t0 = qsl[b], q = qsl[b + 1] - qsl[b], R = G * q, r0 = k * ATT_ROWS;
                    if (r0 >= R) continue;
                    const int64_t nr = R - r0 < ATT_ROWS ? R - r0 : ATT_ROWS;
                    if (have != b * KVH + h) {
                        kv_rows(kv, vbase, b, h, KVH, D, bt, maxb, BS, Lp, KP.data(), VP.data());
                        have = b * KVH + h;
                    }
                    const E* const* vp = VP.data();
                    for (int64_t r = r0; r < r0 + nr; r++)
                        memcpy(QG.data() + r * D, qkv + (t0 + r % q) * stride + (h * G + r / q) * D, D * sizeof(float));
                    (att_avx512() ? score_keys_512<E> : score_keys<E>)(QG.data(), r0, nr, KP.data(), 0, L8,
                                                                     bias + b * Qm * Lp, q, Lp, D, scale, S.data());
                    attn_finish(r0, nr, [vp](int64_t j) { return vp[j]; }, Lp, D, S.data(), OUT.data());
                    for (int64_t r = r0; r < r0 + nr; r++)
                        memcpy(o + (t0 + r % q) * H * D + (h * G + r / q) * D, OUT.data() + r * D, D * sizeof(float));
                }
    }
}

// A K or V row into the cache: fp32 as is, fp16 rounded to nearest even (as torch's .to(float16))
static inline void store_row(float* dst, const float* src, int64_t n) { memcpy(dst, src, n * sizeof(float)); }
static inline void store_row(half_t* dst, const float* src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

// The step's new keys and values (rows of qkv after the q heads) into their cache slots, then the
// attention of every row over the paged cache (kv [2, nslots, KVH, D] of E: float or half_t)
template <class E>
static void write_and_attend(E* kv, const float* qkv, int64_t T, int64_t stride, int64_t H, int64_t KVH, int64_t D,
                             int64_t nslots, const int64_t* slot_mapping, const int32_t* qsl, int64_t B,
                             const int32_t* bt, int64_t maxb, int64_t BS, const float* bias, int64_t Qm, int64_t Lp,
                             float scale, float* o) {
    const int64_t nq = H * D, nkv = KVH * D;
    for_rows(T, [&](int64_t t) {
        const int64_t s = slot_mapping[t];
        store_row(kv + s * nkv, qkv + t * stride + nq, nkv);
        store_row(kv + (nslots + s) * nkv, qkv + t * stride + nq + nkv, nkv);
    });
    if (!paged_attention_2p(qkv, stride, H, KVH, D, (const E*)kv, nslots, qsl, B, bt, maxb, BS, bias, Qm, Lp, scale, o))
        paged_attention(qkv, stride, H, KVH, D, (const E*)kv, nslots, qsl, B, bt, maxb, BS, bias, Qm, Lp, scale, o);
}

extern "C" {
// The int8-activation GEMM's instruction set: want 2 (AMX, where the CPU has it, else the best below),
// 1 (AVX512-VNNI, where the CPU has it), 0 (AVX2), -1 (the CPU decides), 9 (no change); returns the
// one in use (2, 1 or 0). All give bitwise-equal results.
int specd_x8_isa(int want) {
    if (want < 0) g_x8_isa = -1;
    else if (want == 2) g_x8_isa = cpu_amx() ? 2 : cpu_avx512_vnni() ? 1 : 0;
    else if (want == 1) g_x8_isa = cpu_avx512_vnni() ? 1 : 0;
    else if (want == 0) g_x8_isa = 0;
    return x8_isa();
}

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

// The interleaved layout (see gemm_x8): w, scale [, mins] packed by the caller (quant.pack_x8); fmt:
// X8_INT4 (int4 codes, else int8) | X8_HALF (scale and mins are halves, else fp32).
void specd_qgemm_x8(const float* x, int64_t M, int64_t K, const uint8_t* w, const void* scale, const void* mins,
                    int64_t N, int fmt, const float* add, const float* bias, float* y) {
    const Lin L{2 + fmt, N, K, 32, K, w, scale, mins, bias};
    std::vector<float> fs, xp;
    std::vector<int8_t> qs;
    lin(L, x, M, add, y, fs, qs, xp);
}

// One decoder layer (see Lin above), x [T, d] updated in place: x += o(attn(rope(qkv(norm(x)))));
// x += down(silu(gate) * up(norm(x))). lins: qkv, o, gate_up, down. The new K, V go to slot_mapping.
void specd_head_layer(float* x, const float* e, const float* w_e, int64_t T, int64_t d, const float* w_in,
                      const float* w_post, float eps, const Lin* lins, int64_t H, int64_t KVH, int64_t D, int64_t inter,
                      const float* cos, const float* sin, const int64_t* pos, void* kv, int64_t nslots,
                      const int64_t* slot_mapping, const int32_t* qsl, int64_t B, const int32_t* bt, int64_t maxb,
                      int64_t BS, const float* bias, int64_t Qm, int64_t Lp, float scale, int64_t kv16);

// Every decoder layer of a model in one call (specd_head_layer without e, nl times; the per-layer
// Python and ctypes calls cost ~0.2 ms of a 3-4 ms one-row forward): layer i's projections lins[4i .. 4i+3], norm
// weights w_in[i] and w_post[i], cache kv + i * kv_layer bytes; caps[i], where not null, gets a copy
// of x [T, d] as it enters layer i (a feature head's features).
void specd_layers(float* x, int64_t nl, const Lin* lins, const float* const* w_in, const float* const* w_post,
                  float* const* caps, int64_t T, int64_t d, float eps, int64_t H, int64_t KVH, int64_t D, int64_t inter,
                  const float* cos, const float* sin, const int64_t* pos, char* kv, int64_t kv_layer, int64_t nslots,
                  const int64_t* slot_mapping, const int32_t* qsl, int64_t B, const int32_t* bt, int64_t maxb,
                  int64_t BS, const float* bias, int64_t Qm, int64_t Lp, float scale, int64_t kv16) {
    for (int64_t i = 0; i < nl; i++) {
        if (caps[i]) memcpy(caps[i], x, T * d * sizeof(float));
        specd_head_layer(x, nullptr, nullptr, T, d, w_in[i], w_post[i], eps, lins + 4 * i, H, KVH, D, inter, cos, sin,
                         pos, kv + i * kv_layer, nslots, slot_mapping, qsl, B, bt, maxb, BS, bias, Qm, Lp, scale, kv16);
    }
}

// One decoder layer (as above), or with e != nullptr a feature head's (specd/model/head.py): its
// q/k/v projection reads [rms(e) * w_e, rms(x) * w_in] (2d wide per row) instead of rms(x) * w_in.
void specd_head_layer(float* x, const float* e, const float* w_e, int64_t T, int64_t d, const float* w_in,
                      const float* w_post, float eps, const Lin* lins, int64_t H, int64_t KVH, int64_t D, int64_t inter,
                      const float* cos, const float* sin, const int64_t* pos, void* kv, int64_t nslots,
                      const int64_t* slot_mapping, const int32_t* qsl, int64_t B, const int32_t* bt, int64_t maxb,
                      int64_t BS, const float* bias, int64_t Qm, int64_t Lp, float scale, int64_t kv16) {
    const int64_t din = e ? 2 * d : d;
    // the calling thread's scratch, kept between calls (grown, never cleared: every element read is
    // written first; fresh vectors cost page faults on every layer of every step)
    static thread_local std::vector<float> fs, h, qkv, o, gu, a, xp;
    static thread_local std::vector<int8_t> qs;
    grow(h, T * din), grow(qkv, T * (H + 2 * KVH) * D), grow(o, T * H * D), grow(gu, T * 2 * inter), grow(a, T * inter);
    const int64_t nq = H * D, nkv = KVH * D, stride = nq + 2 * nkv;
    if (e) {
        for (int64_t t = 0; t < T; t++) {
            rms_rows(e + t * d, 1, d, w_e, eps, h.data() + t * din);
            rms_rows(x + t * d, 1, d, w_in, eps, h.data() + t * din + d);
        }
    } else {
        rms_rows(x, T, d, w_in, eps, h.data());
    }
    lin(lins[0], h.data(), T, nullptr, qkv.data(), fs, qs, xp);
    rope_rows(qkv.data(), T, stride, H + KVH, D, cos, sin, pos);
    if (kv16)
        write_and_attend((half_t*)kv, qkv.data(), T, stride, H, KVH, D, nslots, slot_mapping, qsl, B, bt, maxb, BS, bias,
                         Qm, Lp, scale, o.data());
    else
        write_and_attend((float*)kv, qkv.data(), T, stride, H, KVH, D, nslots, slot_mapping, qsl, B, bt, maxb, BS, bias,
                         Qm, Lp, scale, o.data());
    lin(lins[1], o.data(), T, x, x, fs, qs, xp);
    rms_rows(x, T, d, w_post, eps, h.data());
    lin(lins[2], h.data(), T, nullptr, gu.data(), fs, qs, xp);
    silu_mul_rows(gu.data(), T, inter, a.data());
    lin(lins[3], a.data(), T, x, x, fs, qs, xp);
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
                    const float* vb = vbase + (b * L * KVH + h) * D;
                    score_rows(q + (b * KVH + h) * R * D, r0, nr, KT, mask + b * Q * L, Q, L, D, scale, S);
                    attn_finish(r0, nr, [vb, KVH, D](int64_t j) { return vb + j * KVH * D; }, L, D, S,
                                out + (b * KVH + h) * R * D);
                }
            }
        delete[] S;
        delete[] KT;
    }
}
}
