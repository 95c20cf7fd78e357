// The int8-activation GEMM on GGUF K-quant weights (Q4_K, Q5_K, Q6_K; and Q8_0 parts beside them) kept
// as the file's numbers:
// gemm_kq, y = x @ W^T (+ add) (+ bias), x's rows quantized to int8 blocks of 32 (quantize_q8) plus
// the codes' sums (code_sums). The "kq" layout (quant.pack_kq builds it from the file's
// blocks, every value kept) is the x8 layout of gemm_x8_avx2.h with the K-quants' own scales:
// output rows in tiles of 8, a tile's bytes contiguous, per 256-weight super-block of k
//   32 bytes   d[8], dmin[8] (halves, the file's; Q6_K: dmin zero)
//   8 blocks of 32 k, each
//     128 bytes  the codes' low 4 bits as the int4 x8 layout: vector v (0..3) byte 4c + i, low nibble
//                code[c][32b + 4v + i], high nibble code[c][32b + 16 + 4v + i]
//     Q5_K: 32 bytes, byte 4c + i: bit v the 5th bit of the low nibble of vector v, bit 4 + v the high's
//     Q6_K: 64 bytes, two vectors H0 (low nibbles) and H1 (high): byte 4c + i, bits 2v, 2v + 1 the
//           5th and 6th bits of vector v's nibble
//     16 bytes   Q4_K / Q5_K: sc[8], m[8] (the block's 6-bit scale and min per row, unsigned);
//                Q6_K: sc[8] of k 32b..32b+15, sc[8] of 32b+16..32b+31 (int8)
// Q8_0 (kind 3; no header, the file's 34 bytes per row and 32 weights exactly), per 256 k 8 blocks of
//     256 bytes  the int8 codes as the int8 x8 layout: vector s (0..7) byte 4c + i: q[c][32b + 4s + i]
//     16 bytes   d[8] (the block's scale per row, halves)
// A weight is d * sc * u - dmin * m (Q4_K: u 0..15, Q5_K: 0..31), d * sc * (u - 32) (Q6_K: u 0..63) or
// d * q (Q8_0), as the gguf package dequantizes it. Tiles are listed in a table (int64 per tile: byte
// offset << 2 | kind 0 Q4_K, 1 Q5_K, 2 Q6_K, 3 Q8_0), so one projection may mix kinds (llama.cpp's
// Q4_K_M gives v Q6_K, q and k Q4_K, fused here into one q/k/v projection; in a model of 8 experts k
// and v Q8_0).
// Per row and 32-block b, in integers: s = sum u * xq over the block (Q6_K: each 16 apart), then
//   Q4_K / Q5_K: acc = fma(float(s), (d * sc) * dx, acc); acc = fnmadd(dmin * m, dx * float(xs32), acc)
//   Q6_K:        acc = fma(float(s_lo - 32 xs16_lo), (d * sc_lo) * dx, acc), then the same for the high half
//   Q8_0:        acc = fma(float(s), d * dx, acc) (s = sum q * xq: gemm_x8's int8 steps, the same bits as
//                the x8 layout's Q8_0 weight: the sign trick on AVX2, |q| and a masked negation on AVX512)
// (xs: the integer sums of the row's codes; every integer is exact; d * sc and dmin * m are exact in
// fp32, computed once per block for all rows, where an integer form took two vpmulld per row and block):
// the same steps for every row whatever M is, on AVX2 (kq_tile, one tile per vector) and AVX512-VNNI
// (kq_tile2, two tiles per vector): bitwise equal. Under AMX the AVX512-VNNI path runs (the unpacked
// codes would feed int8 tiles too, not done: measured memory-bound at decode widths).
// ISA: AVX2; AVX512F/BW/DQ/VNNI through X512. Relies on common.h, gemm_x8_avx2.h (prefetch_w, X8_RB,
// x8_store, bcast4) and gemm_x8_avx512.h (cat256, bcast4_512, x8_store16).
#pragma once

#include "common.h"
#include "gemm_x8_avx2.h"
#include "gemm_x8_avx512.h"

#define KQ_HDR 32
#define KQ_Q8 3  // the Q8_0 kind
// inlined (with v a constant once the loops over v are unrolled): out of line, GCC passed the code
// vectors through memory and the shifts by v through branches (Q6_K 4x Q4_K's time per weight)
#define KQ_INLINE inline __attribute__((always_inline))
static inline constexpr int64_t kq_block_bytes(int KT) {
    return KT == KQ_Q8 ? 256 + 16 : 128 + (KT == 1 ? 32 : KT == 2 ? 64 : 0) + 16;
}
static inline constexpr int64_t kq_sb_bytes(int KT) { return (KT == KQ_Q8 ? 0 : KQ_HDR) + 8 * kq_block_bytes(KT); }

// the activations' side of the K-quant terms, per row: xs [M, K/16] 32 x the sum of each 16 codes (Q6_K's
// -32 offset), xsf [M, K/32] dx * the sum of each block's 32 codes (Q4_K / Q5_K's mins), computed once
// per row instead of once per row and tile
static void code_sums(const int8_t* qx, const float* dx, int64_t M, int64_t K, int32_t* xs, float* xsf) {
    for_rows(M, [&](int64_t m) {
        for (int64_t j = 0; j < K / 16; j++) {
            const __m128i v = _mm_loadu_si128((const __m128i*)(qx + m * K + 16 * j));
            const __m256i s = _mm256_madd_epi16(_mm256_cvtepi8_epi16(v), _mm256_set1_epi16(1));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
            xs[m * (K / 16) + j] = 32 * _mm_cvtsi128_si32(t);
        }
        for (int64_t b = 0; b < K / 32; b++)
            xsf[m * (K / 32) + b] = dx[m * (K / 32) + b] * (float)((xs[m * (K / 16) + 2 * b] + xs[m * (K / 16) + 2 * b + 1]) / 32);
    });
}

// ---- AVX2: one 8-row tile -------------------------------------------------------------------------
// bits 2v, 2v + 1 of each byte moved to bits 4, 5 (shifts within 16-bit lanes: no bit crosses a byte)
static KQ_INLINE __m256i kq_up256(__m256i h, int v) {
    return v == 0 ? _mm256_slli_epi16(h, 4) : v == 1 ? _mm256_slli_epi16(h, 2) : v == 2 ? h : _mm256_srli_epi16(h, 2);
}

// the codes of vector v of block p (32 bytes per tile): low (k 4v..) and high (k 16 + 4v..) halves
template <int KT>
static KQ_INLINE void kq_codes(const uint8_t* p, int v, __m256i& lo, __m256i& hi) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i W = _mm256_loadu_si256((const __m256i*)(p + 32 * v));
    lo = _mm256_and_si256(W, mask), hi = _mm256_and_si256(_mm256_srli_epi16(W, 4), mask);
    if (KT == 1) {
        const __m256i H = _mm256_loadu_si256((const __m256i*)(p + 128)), b4 = _mm256_set1_epi8(0x10);
        const __m256i hl = v == 0 ? _mm256_slli_epi16(H, 4) : v == 1 ? _mm256_slli_epi16(H, 3)
                           : v == 2 ? _mm256_slli_epi16(H, 2) : _mm256_slli_epi16(H, 1);
        const __m256i hh = v == 0 ? H : v == 1 ? _mm256_srli_epi16(H, 1) : v == 2 ? _mm256_srli_epi16(H, 2)
                           : _mm256_srli_epi16(H, 3);
        lo = _mm256_or_si256(lo, _mm256_and_si256(hl, b4)), hi = _mm256_or_si256(hi, _mm256_and_si256(hh, b4));
    } else if (KT == 2) {
        const __m256i H0 = _mm256_loadu_si256((const __m256i*)(p + 128));
        const __m256i H1 = _mm256_loadu_si256((const __m256i*)(p + 160)), b45 = _mm256_set1_epi8(0x30);
        lo = _mm256_or_si256(lo, _mm256_and_si256(kq_up256(H0, v), b45));
        hi = _mm256_or_si256(hi, _mm256_and_si256(kq_up256(H1, v), b45));
    }
}

// u8 codes (<= 63) times s8 activations, 4 vectors summed: in int16 where the sums fit (<= 31 * 127 *
// 8 per lane pair for 5 bits), widened per vector for 6 bits
template <int KT>
static KQ_INLINE __m256i kq_dot(const __m256i* u, const int8_t* x) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (KT == 2) {
        __m256i s = _mm256_setzero_si256();
        for (int v = 0; v < 4; v++) s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u[v], bcast4(x + 4 * v)), ones));
        return s;
    }
    __m256i s = _mm256_setzero_si256();
    for (int v = 0; v < 4; v++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[v], bcast4(x + 4 * v)));
    return _mm256_madd_epi16(s, ones);
}

// block p's 8 per-row scales and mins (the block's last 16 bytes) times the super-block's d / dmin: dsc = d * sc,
// dm = dmin * m (Q6_K: the high half's d * sc)
template <int KT>
static KQ_INLINE void kq_block_scales(const uint8_t* p, __m256 d, __m256 dmin, __m256& dsc, __m256& dm) {
    const uint8_t* scp = p + kq_block_bytes(KT) - 16;
    const __m256i sc = KT == 2 ? _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)scp))
                               : _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)scp));
    const __m256i sm = KT == 2 ? _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(scp + 8)))
                               : _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(scp + 8)));
    dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)), dm = _mm256_mul_ps(KT == 2 ? d : dmin, _mm256_cvtepi32_ps(sm));
}

template <int KT, int R>
static inline void kq_tile(const int8_t* qx, const float* dx, const int32_t* xs, const float* xsf, int64_t K,
                           const uint8_t* w, float* out /* [R, 8] */) {
    const int64_t nbk = K / 32, nsb = K / 256;
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t* sb = w + s * kq_sb_bytes(KT);
        const __m256 d = ld8((const half_t*)sb), dmin = ld8((const half_t*)(sb + 16));
        for (int64_t j = 0; j < 8; j++) {
            const int64_t b = 8 * s + j;
            const uint8_t* p = sb + KQ_HDR + j * kq_block_bytes(KT);
            prefetch_w(p, kq_block_bytes(KT));
            __m256i lo[4], hi[4];
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) kq_codes<KT>(p, v, lo[v], hi[v]);
            __m256 dsc, dm;
            kq_block_scales<KT>(p, d, dmin, dsc, dm);
            for (int r = 0; r < R; r++) {
                const int8_t* xb = qx + r * K + 32 * b;
                const int32_t* xr = xs + r * (K / 16) + 2 * b;
                const __m256i slo = kq_dot<KT>(lo, xb), shi = kq_dot<KT>(hi, xb + 16);
                if (KT == 2) {
                    const __m256 dxv = _mm256_broadcast_ss(dx + r * nbk + b);
                    const __m256i a = _mm256_sub_epi32(slo, _mm256_set1_epi32(xr[0]));
                    const __m256i c = _mm256_sub_epi32(shi, _mm256_set1_epi32(xr[1]));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(dsc, dxv), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_mul_ps(dm, dxv), acc[r]);
                } else {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(slo, shi)),
                                             _mm256_mul_ps(dsc, _mm256_broadcast_ss(dx + r * nbk + b)), acc[r]);
                    acc[r] = _mm256_fnmadd_ps(dm, _mm256_broadcast_ss(xsf + r * nbk + b), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// Q8_0 tiles: x8_tile's int8 steps (sign trick: |q| * (x with q's sign), exact int32 sums per block)
template <int R>
static inline void kq8_tile(const int8_t* qx, const float* dx, int64_t K, const uint8_t* w, float* out /* [R, 8] */) {
    const int64_t nbk = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nbk; b++) {
        const uint8_t* p = w + b * kq_block_bytes(KQ_Q8);  // (no header: the blocks end to end)
        prefetch_w(p, kq_block_bytes(KQ_Q8));
        const int8_t* xb = qx + 32 * b;
        __m256i is[R];
        for (int r = 0; r < R; r++) is[r] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            const __m256i W = _mm256_loadu_si256((const __m256i*)(p + 32 * s));
            const __m256i aw = _mm256_sign_epi8(W, W);
            for (int r = 0; r < R; r++) {
                const __m256i q = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(xb + r * K + 4 * s), W));
                is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(q, ones));
            }
        }
        const __m256 d = ld8((const half_t*)(p + 256));
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(d, _mm256_broadcast_ss(dx + r * nbk + b)),
                                     acc[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

template <int KT, int R>
static KQ_INLINE void kq_tile_any(const int8_t* qx, const float* dx, const int32_t* xs, const float* xsf, int64_t K,
                                  const uint8_t* w, float* out) {
    if constexpr (KT == KQ_Q8) kq8_tile<R>(qx, dx, K, w, out);
    else kq_tile<KT, R>(qx, dx, xs, xsf, K, w, out);
}

template <int KT>
static inline void kq_pass(int64_t r, const int8_t* xm, const float* dm, const int32_t* sm, const float* fm,
                           int64_t K, const uint8_t* wt, float* acc) {
#define KQ_CASE(n) \
    case n: kq_tile_any<KT, n>(xm, dm, sm, fm, K, wt, acc); break;
    switch (r) {
        KQ_CASE(8) KQ_CASE(7) KQ_CASE(6) KQ_CASE(5) KQ_CASE(4) KQ_CASE(3) KQ_CASE(2)
        default: kq_tile_any<KT, 1>(xm, dm, sm, fm, K, wt, acc);
    }
#undef KQ_CASE
}

static inline int kq_kind(int64_t entry) { return (int)(entry & 3); }
static inline int64_t kq_off(int64_t entry) { return entry >> 2; }

static void gemm_kq_256(const int8_t* qx, const float* dx, const int32_t* xs, const float* xsf, int64_t M, int64_t K,
                        const uint8_t* w, const int64_t* tiles, int64_t N, const float* add, const float* bias, float* y) {
    const int64_t nbk = K / 32, NT = (N + 7) / 8;
    const int64_t passes = (M + X8_RB - 1) / X8_RB, rp = (M + passes - 1) / passes;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < NT; t++) {
        const uint8_t* wt = w + kq_off(tiles[t]);
        const int kt = kq_kind(tiles[t]);
        const int64_t n0 = 8 * t, nc = N - n0 < 8 ? N - n0 : 8;
        alignas(32) float acc[X8_RB * 8];
        for (int64_t m0 = 0; m0 < M; m0 += rp) {
            const int64_t r = M - m0 < rp ? M - m0 : rp;
            const int8_t* xm = qx + m0 * K;
            const float* dm = dx + m0 * nbk;
            const int32_t* sm = xs + m0 * (K / 16);
            const float* fm = xsf + m0 * nbk;
            if (kt == 0) kq_pass<0>(r, xm, dm, sm, fm, K, wt, acc);
            else if (kt == 1) kq_pass<1>(r, xm, dm, sm, fm, K, wt, acc);
            else if (kt == 2) kq_pass<2>(r, xm, dm, sm, fm, K, wt, acc);
            else kq_pass<KQ_Q8>(r, xm, dm, sm, fm, K, wt, acc);
            x8_store(acc, r, m0, n0, nc, N, add, bias, y);
        }
    }
}

// ---- AVX512-VNNI: two tiles side by side (16 output rows per vector) ---------------------------------
// bits 2v, 2v + 1 of each byte moved to bits 4, 5 (no bit crosses a byte: see kq_codes)
X512 static KQ_INLINE __m512i kq_up512(__m512i h, int v) {
    return v == 0 ? _mm512_slli_epi16(h, 4) : v == 1 ? _mm512_slli_epi16(h, 2) : v == 2 ? h : _mm512_srli_epi16(h, 2);
}

template <int KT>
X512 static KQ_INLINE void kq_codes2(const uint8_t* pa, const uint8_t* pb, int v, __m512i& lo, __m512i& hi) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i W = cat256(pa + 32 * v, pb + 32 * v);
    lo = _mm512_and_si512(W, mask), hi = _mm512_and_si512(_mm512_srli_epi16(W, 4), mask);
    if (KT == 1) {
        const __m512i H = cat256(pa + 128, pb + 128), b4 = _mm512_set1_epi8(0x10);
        const __m512i hl = v == 0 ? _mm512_slli_epi16(H, 4) : v == 1 ? _mm512_slli_epi16(H, 3)
                           : v == 2 ? _mm512_slli_epi16(H, 2) : _mm512_slli_epi16(H, 1);
        const __m512i hh = v == 0 ? H : v == 1 ? _mm512_srli_epi16(H, 1) : v == 2 ? _mm512_srli_epi16(H, 2)
                           : _mm512_srli_epi16(H, 3);
        lo = _mm512_or_si512(lo, _mm512_and_si512(hl, b4)), hi = _mm512_or_si512(hi, _mm512_and_si512(hh, b4));
    } else if (KT == 2) {
        const __m512i H0 = cat256(pa + 128, pb + 128), H1 = cat256(pa + 160, pb + 160);
        const __m512i b45 = _mm512_set1_epi8(0x30);
        lo = _mm512_or_si512(lo, _mm512_and_si512(kq_up512(H0, v), b45));
        hi = _mm512_or_si512(hi, _mm512_and_si512(kq_up512(H1, v), b45));
    }
}

// a block's 8 per-row bytes of tiles a and b at offset o, widened to 16 int32 (signed for Q6_K)
template <int KT>
X512 static inline __m512i kq_bytes16(const uint8_t* pa, const uint8_t* pb) {
    const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)pa), _mm_loadl_epi64((const __m128i*)pb));
    return KT == 2 ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

template <int KT, int R>
X512 static inline void kq_tile2(const int8_t* qx, const float* dx, const int32_t* xs, const float* xsf, int64_t K,
                                 const uint8_t* wa, const uint8_t* wb, float* out /* [R, 16] */) {
    const int64_t nbk = K / 32, nsb = K / 256;
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sa = wa + s * kq_sb_bytes(KT), *sb = wb + s * kq_sb_bytes(KT);
        const __m512 d = cat256ps((const half_t*)sa, (const half_t*)sb);
        const __m512 dmin = cat256ps((const half_t*)(sa + 16), (const half_t*)(sb + 16));
        for (int64_t j = 0; j < 8; j++) {
            const int64_t b = 8 * s + j;
            const uint8_t *pa = sa + KQ_HDR + j * kq_block_bytes(KT), *pb = sb + KQ_HDR + j * kq_block_bytes(KT);
            const int64_t at = s * kq_sb_bytes(KT) + KQ_HDR + j * kq_block_bytes(KT), T = nsb * kq_sb_bytes(KT);
            prefetch_w2(pa, at, T, kq_block_bytes(KT)), prefetch_w2(pb, at, T, kq_block_bytes(KT));
            __m512i lo[4], hi[4];
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) kq_codes2<KT>(pa, pb, v, lo[v], hi[v]);
            const int64_t o = kq_block_bytes(KT) - 16;
            const __m512i sc = kq_bytes16<KT>(pa + o, pb + o), sm = kq_bytes16<KT>(pa + o + 8, pb + o + 8);
            const __m512 dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)), dm = _mm512_mul_ps(KT == 2 ? d : dmin, _mm512_cvtepi32_ps(sm));  // Q6_K: the high half's d * sc
            for (int r = 0; r < R; r++) {
                const int8_t* xb = qx + r * K + 32 * b;
                const int32_t* xr = xs + r * (K / 16) + 2 * b;
                const __m512 dxv = _mm512_set1_ps(dx[r * nbk + b]);
                __m512i slo = _mm512_setzero_si512(), shi = _mm512_setzero_si512();
                for (int v = 0; v < 4; v++) {
                    slo = _mm512_dpbusd_epi32(slo, lo[v], bcast4_512(xb + 4 * v));
                    shi = _mm512_dpbusd_epi32(shi, hi[v], bcast4_512(xb + 16 + 4 * v));
                }
                if (KT == 2) {
                    const __m512i a = _mm512_sub_epi32(slo, _mm512_set1_epi32(xr[0]));
                    const __m512i c = _mm512_sub_epi32(shi, _mm512_set1_epi32(xr[1]));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(dsc, dxv), acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(dm, dxv), acc[r]);
                } else {
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(slo, shi)), _mm512_mul_ps(dsc, dxv), acc[r]);
                    acc[r] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(xsf[r * nbk + b]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// Q8_0 tile pairs: x8_tile2's int8 steps (|q| and x negated where q < 0, vpdpbusd): kq8_tile's bits
template <int R>
X512 static inline void kq8_tile2(const int8_t* qx, const float* dx, int64_t K, const uint8_t* wa, const uint8_t* wb,
                                  float* out /* [R, 16] */) {
    const int64_t nbk = K / 32;
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nbk; b++) {
        const uint8_t *pa = wa + b * kq_block_bytes(KQ_Q8), *pb = wb + b * kq_block_bytes(KQ_Q8);
        const int64_t at = b * kq_block_bytes(KQ_Q8), T = nbk * kq_block_bytes(KQ_Q8);
        prefetch_w2(pa, at, T, kq_block_bytes(KQ_Q8)), prefetch_w2(pb, at, T, kq_block_bytes(KQ_Q8));
        const int8_t* xb = qx + 32 * b;
        __m512i is[R];
        for (int r = 0; r < R; r++) is[r] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            const __m512i W = cat256(pa + 32 * s, pb + 32 * s);
            const __m512i aw = _mm512_abs_epi8(W);
            const __mmask64 neg = _mm512_movepi8_mask(W);  // q < 0: the activation byte is negated
            for (int r = 0; r < R; r++) {
                const __m512i x = bcast4_512(xb + r * K + 4 * s);
                const __m512i sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
                is[r] = _mm512_dpbusd_epi32(is[r], aw, sx);  // (q == 0: |q| = 0, as sign_epi8's zeroed x)
            }
        }
        const __m512 d = cat256ps((const half_t*)(pa + 256), (const half_t*)(pb + 256));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nbk + b])),
                                     acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <int KT, int R>
X512 static KQ_INLINE void kq_tile2_any(const int8_t* qx, const float* dx, const int32_t* xs, const float* xsf,
                                        int64_t K, const uint8_t* wa, const uint8_t* wb, float* out) {
    if constexpr (KT == KQ_Q8) kq8_tile2<R>(qx, dx, K, wa, wb, out);
    else kq_tile2<KT, R>(qx, dx, xs, xsf, K, wa, wb, out);
}

template <int KT>
X512 static inline void kq_pass2(int64_t r, const int8_t* xm, const float* dm, const int32_t* sm, const float* fm,
                                 int64_t K, const uint8_t* wa, const uint8_t* wb, float* acc) {
#define KQ_CASE(n) \
    case n: kq_tile2_any<KT, n>(xm, dm, sm, fm, K, wa, wb, acc); break;
    switch (r) {
        KQ_CASE(8) KQ_CASE(7) KQ_CASE(6) KQ_CASE(5) KQ_CASE(4) KQ_CASE(3) KQ_CASE(2)
        default: kq_tile2_any<KT, 1>(xm, dm, sm, fm, K, wa, wb, acc);
    }
#undef KQ_CASE
}

// ---- AVX512-VNNI, one row: one tile at a time, two of its code vectors per register ------------------
// (as x8_tile1, gemm_x8_avx512.h: a pair's two streams cost a one-row step more than its instructions save;
// from 2 rows the pairs won here: tried to 4 rows, 1.41x slower at 4)
// Vectors 2h and 2h + 1 of a block in one register's halves; the 5th / 6th code bits of vector v sit at
// different places per v, so each half is shifted by its own count (vpsllvw / vpsrlvw: kq_codes's shifts,
// lane by lane). The integer sums are exact and the fp32 steps per output element are kq_tile's: the same bits.

// per-half shift counts (16-bit lanes): a in the low half, b in the high
X512 static inline __m512i kq_counts(int a, int b) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1);
}

// the low / high codes of vectors 2h (low half) and 2h + 1 (high half) of block p of one tile
template <int KT>
X512 static KQ_INLINE void kq_codes1(const uint8_t* p, int h, __m512i& lo, __m512i& hi) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i W = _mm512_loadu_si512((const void*)(p + 64 * h));
    lo = _mm512_and_si512(W, mask), hi = _mm512_and_si512(_mm512_srli_epi16(W, 4), mask);
    if (KT == 1) {  // kq_codes: hl = H << (4 - v), hh = H >> v, bit 4 kept
        const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 128)));
        const __m512i b4 = _mm512_set1_epi8(0x10);
        const __m512i hl = _mm512_sllv_epi16(H, kq_counts(4 - 2 * h, 3 - 2 * h));
        const __m512i hh = _mm512_srlv_epi16(H, kq_counts(2 * h, 2 * h + 1));
        lo = _mm512_or_si512(lo, _mm512_and_si512(hl, b4)), hi = _mm512_or_si512(hi, _mm512_and_si512(hh, b4));
    } else if (KT == 2) {  // kq_up: v 0, 1, 2, 3 -> << 4, << 2, as is, >> 2; bits 4, 5 kept
        const __m512i H0 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 128)));
        const __m512i H1 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 160)));
        const __m512i b45 = _mm512_set1_epi8(0x30);
        const __m512i l = h == 0 ? kq_counts(4, 2) : kq_counts(0, 0), r = h == 0 ? kq_counts(0, 0) : kq_counts(0, 2);
        lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_srlv_epi16(_mm512_sllv_epi16(H0, l), r), b45));
        hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srlv_epi16(_mm512_sllv_epi16(H1, l), r), b45));
    }
}

template <int KT>
X512 static inline void kq_tile1(const int8_t* qx, const float* dx, const int32_t* xs, const float* xsf, int64_t K,
                                 const uint8_t* w, float* out /* [8] */) {
    const int64_t nsb = K / 256;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t* sb = w + s * kq_sb_bytes(KT);
        const __m256 d = ld8((const half_t*)sb), dmin = ld8((const half_t*)(sb + 16));
        for (int64_t j = 0; j < 8; j++) {
            const int64_t b = 8 * s + j;
            const uint8_t* p = sb + KQ_HDR + j * kq_block_bytes(KT);
            prefetch_w(p, kq_block_bytes(KT));
            const __m512i xd = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(qx + 32 * b)));
            __m512i slo = _mm512_setzero_si512(), shi = _mm512_setzero_si512();
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m512i lo, hi;
                kq_codes1<KT>(p, h, lo, hi);
                slo = _mm512_dpbusd_epi32(slo, lo, x_pair(xd, 2 * h));
                shi = _mm512_dpbusd_epi32(shi, hi, x_pair(xd, 4 + 2 * h));
            }
            __m256 dsc, dm;
            kq_block_scales<KT>(p, d, dmin, dsc, dm);
            if (KT == 2) {
                const __m256 dxv = _mm256_broadcast_ss(dx + b);
                const __m256i a = _mm256_sub_epi32(halves_sum(slo), _mm256_set1_epi32(xs[2 * b]));
                const __m256i c = _mm256_sub_epi32(halves_sum(shi), _mm256_set1_epi32(xs[2 * b + 1]));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(dsc, dxv), acc);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_mul_ps(dm, dxv), acc);
            } else {
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(halves_sum(_mm512_add_epi32(slo, shi))),
                                      _mm256_mul_ps(dsc, _mm256_broadcast_ss(dx + b)), acc);
                acc = _mm256_fnmadd_ps(dm, _mm256_broadcast_ss(xsf + b), acc);
            }
        }
    }
    _mm256_storeu_ps(out, acc);
}

// Q8_0 tiles, one row: x8_tile1's int8 steps
X512 static inline void kq8_tile1(const int8_t* qx, const float* dx, int64_t K, const uint8_t* w, float* out /* [8] */) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t* p = w + b * kq_block_bytes(KQ_Q8);
        prefetch_w(p, kq_block_bytes(KQ_Q8));
        const __m512i xd = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(qx + 32 * b)));
        __m512i is = _mm512_setzero_si512();
        for (int h = 0; h < 4; h++) {  // steps 2h, 2h + 1
            const __m512i W = _mm512_loadu_si512((const void*)(p + 64 * h));
            const __m512i x = x_pair(xd, 2 * h);
            is = _mm512_dpbusd_epi32(is, _mm512_abs_epi8(W),
                                     _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(W), _mm512_setzero_si512(), x));
        }
        const __m256 d = ld8((const half_t*)(p + 256));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(halves_sum(is)), _mm256_mul_ps(d, _mm256_broadcast_ss(dx + b)), acc);
    }
    _mm256_storeu_ps(out, acc);
}

X512 static void gemm_kq_512_row(const int8_t* qx, const float* dx, const int32_t* xs, const float* xsf, int64_t K,
                                 const uint8_t* w, const int64_t* tiles, int64_t N, const float* add, const float* bias,
                                 float* y) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < (N + 7) / 8; t++) {
        const uint8_t* wt = w + kq_off(tiles[t]);
        alignas(32) float acc[8];
        switch (kq_kind(tiles[t])) {
            case 0: kq_tile1<0>(qx, dx, xs, xsf, K, wt, acc); break;
            case 1: kq_tile1<1>(qx, dx, xs, xsf, K, wt, acc); break;
            case 2: kq_tile1<2>(qx, dx, xs, xsf, K, wt, acc); break;
            default: kq8_tile1(qx, dx, K, wt, acc);
        }
        x8_store(acc, 1, 0, 8 * t, N - 8 * t < 8 ? N - 8 * t : 8, N, add, bias, y);
    }
}

// tile pairs as gemm_x8_512's; a pair of two kinds (a part boundary inside it) runs as two tiles, each
// paired with itself
X512 static void gemm_kq_512(const int8_t* qx, const float* dx, const int32_t* xs, const float* xsf, int64_t M,
                             int64_t K, const uint8_t* w, const int64_t* tiles, int64_t N, const float* add, const float* bias,
                             float* y) {
    if (M == 1) return gemm_kq_512_row(qx, dx, xs, xsf, K, w, tiles, N, add, bias, y);
    const int64_t nbk = K / 32, NT = (N + 7) / 8, NP = (NT + 1) / 2;
    const int64_t passes = (M + X8_RB - 1) / X8_RB, rp = (M + passes - 1) / passes;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < NP; p++) {
        const int64_t t0 = 2 * p, t1 = t0 + 1 < NT ? t0 + 1 : t0;
        const bool split = kq_kind(tiles[t0]) != kq_kind(tiles[t1]);
        alignas(64) float acc[X8_RB * 16];
        for (int64_t h = 0; h < (split ? 2 : 1); h++) {
            const int64_t ta = split ? t0 + h : t0, tb = split ? ta : t1, n0 = 8 * ta;
            const int64_t nc = tb == ta ? (N - n0 < 8 ? N - n0 : 8) : (N - n0 < 16 ? N - n0 : 16);
            const uint8_t *wa = w + kq_off(tiles[ta]), *wb = w + kq_off(tiles[tb]);
            const int kt = kq_kind(tiles[ta]);
            for (int64_t m0 = 0; m0 < M; m0 += rp) {
                const int64_t r = M - m0 < rp ? M - m0 : rp;
                const int8_t* xm = qx + m0 * K;
                const float* dm = dx + m0 * nbk;
                const int32_t* sm = xs + m0 * (K / 16);
                const float* fm = xsf + m0 * nbk;
                if (kt == 0) kq_pass2<0>(r, xm, dm, sm, fm, K, wa, wb, acc);
                else if (kt == 1) kq_pass2<1>(r, xm, dm, sm, fm, K, wa, wb, acc);
                else if (kt == 2) kq_pass2<2>(r, xm, dm, sm, fm, K, wa, wb, acc);
                else kq_pass2<KQ_Q8>(r, xm, dm, sm, fm, K, wa, wb, acc);
                x8_store16(acc, r, m0, n0, nc, N, add, bias, y);
            }
        }
    }
}

// the call on the instruction set x8_isa chose (AMX: the AVX512-VNNI tiles, see the top)
static void gemm_kq(const int8_t* qx, const float* dx, const int32_t* xs, const float* xsf, int64_t M, int64_t K,
                    const uint8_t* w, const int64_t* tiles, int64_t N, const float* add, const float* bias, float* y) {
    if (x8_isa() >= 1) return gemm_kq_512(qx, dx, xs, xsf, M, K, w, tiles, N, add, bias, y);
    gemm_kq_256(qx, dx, xs, xsf, M, K, w, tiles, N, add, bias, y);
}
