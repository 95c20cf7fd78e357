// The int8-activation GEMM on AMX int8 tiles (x8_isa 2, Sapphire Rapids and later; calls of
// AMX_MIN_ROWS rows or more): gemm_x8_amx. ISA: AVX512 + AMX-TILE + AMX-INT8 through the XAMX
// attribute (the unit stays AVX2; the CPU's AMX and the kernel's leave to use it are checked at run
// time: cpu_amx in common.h). Relies on gemm_x8_avx2.h (the layout, prefetch_w) and gemm_x8_avx512.h
// (cat256, cat256ps, x8_pass2 for the tail rows, x8_store16, TilePair).
#pragma once

#include "common.h"
#include "gemm_x8_avx2.h"
#include "gemm_x8_avx512.h"

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

// block b's weights of tiles a and b (rows of K) as a B tile [8, 64] in bb
template <bool INT4>
XAMX static inline void amx_unpack(const uint8_t* wa, const uint8_t* wb, int64_t b, int64_t K, uint8_t* bb) {
    const int64_t bytes = INT4 ? 128 : 256, tile_bytes = K / 32 * bytes;  // one block of one tile; one tile
    prefetch_w2(wa + bytes * b, bytes * b, tile_bytes, bytes), prefetch_w2(wb + bytes * b, bytes * b, tile_bytes, bytes);
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
    for (int i = 0; i < nb; i++) amx_unpack<INT4>(wa, wb, b + i, K, bb + 512 * i);
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
                           const uint8_t* wb, const S* sa, const S* sb, const S* ma, const S* mb, bool off8,
                           float* out) {
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
            const __m512 mv = x8_mins512<INT4>(ma, mb, b, dw, off8);
            const int32_t* c = cs + 16 * R * i;
            for (int r = 0; r < R; r++) {
                const __m512 is = _mm512_cvtepi32_ps(_mm512_load_si512((const __m512i*)(c + 16 * r)));
                acc[r] = _mm512_fmadd_ps(is, _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nbk + b])), acc[r]);
                if (INT4 && (ma || off8)) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nbk + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <bool INT4, class S>
XAMX static void amx_pass(int64_t r, const int8_t* xm, const float* dm, const float* sm, int64_t K, const uint8_t* wa,
                          const uint8_t* wb, const S* sa, const S* sb, const S* ma, const S* mb, bool off8,
                          float* acc) {
#define AMX_CASE(n) \
    case n: amx_tile2<INT4, n, S>(xm, dm, sm, K, wa, wb, sa, sb, ma, mb, off8, acc); break;
    switch (r) {
        AMX_CASE(16) AMX_CASE(15) AMX_CASE(14) AMX_CASE(13) AMX_CASE(12) AMX_CASE(11) AMX_CASE(10) AMX_CASE(9)
        AMX_CASE(8) AMX_CASE(7) AMX_CASE(6) AMX_CASE(5) AMX_CASE(4) AMX_CASE(3) AMX_CASE(2)
        default: amx_tile2<INT4, 1, S>(xm, dm, sm, K, wa, wb, sa, sb, ma, mb, off8, acc);
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
                                  const S* ma, const S* mb, bool off8, float* acc) {
    const int64_t nbk = K / 32, R = r0 + r1;
    const int8_t* q1 = qx + r0 * K;
    alignas(64) uint8_t bb[2 * 512];
    alignas(64) int32_t cs[2 * 2 * AMX_ROWS * 16];  // [block of the pair][row of the pass][16]
    for (int64_t r = 0; r < R; r++) _mm512_storeu_ps(acc + 16 * r, _mm512_setzero_ps());
    for (int64_t b0 = 0; b0 < nbk; b0 += 2) {
        const int nb = nbk - b0 < 2 ? 1 : 2;
        amx_unpack<INT4>(wa, wb, b0, K, bb);
        _tile_loadd(6, bb, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(4, qx + 32 * b0, K);
        _tile_loadd(5, q1 + 32 * b0, K);
        AMX_DP(0, 4, 6);
        AMX_DP(1, 5, 6);
        if (nb > 1) {
            amx_unpack<INT4>(wa, wb, b0 + 1, K, bb + 512);
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
            const __m512 mv = x8_mins512<INT4>(ma, mb, b, dw, off8);
            const int32_t* c = cs + 16 * R * i;
            for (int64_t r = 0; r < R; r++) {
                const __m512 is = _mm512_cvtepi32_ps(_mm512_load_si512((const __m512i*)(c + 16 * r)));
                __m512 a = _mm512_loadu_ps(acc + 16 * r);
                a = _mm512_fmadd_ps(is, _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nbk + b])), a);
                if (INT4 && (ma || off8)) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nbk + b]), a);
                _mm512_storeu_ps(acc + 16 * r, a);
            }
        }
    }
}
#undef AMX_DP

template <bool INT4, class S>
XAMX static void gemm_x8_amx(const int8_t* qx, const float* dx, const float* xs, int64_t M, int64_t K,
                             const uint8_t* w, const S* scale, const S* mins, bool off8, int64_t N, const float* add,
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
                    amx_pass<INT4, S>(r, qx + m0 * K, dx + m0 * nbk, xs + m0 * nbk, K, wa, wb, sa, sb, ma, mb, off8, acc);
                else
                    amx_tile2_halves<INT4, S>(h0, r - h0, qx + m0 * K, dx + m0 * nbk, xs + m0 * nbk, K, wa, wb, sa, sb,
                                           ma, mb, off8, acc);
                x8_store16(acc, r, m0, n0, nc, N, add, bias, y);
            }
            if (tail) {
                x8_pass2<INT4, S>(tail, qx + Ma * K, dx + Ma * nbk, xs + Ma * nbk, K, w + ta * tile_bytes,
                               w + tb * tile_bytes, scale + ta * nbk * 8, scale + tb * nbk * 8, ma, mb, off8, acc);
                x8_store16(acc, tail, Ma, n0, nc, N, add, bias, y);
            }
        }
        if (cfg) _tile_release();
    }
}
