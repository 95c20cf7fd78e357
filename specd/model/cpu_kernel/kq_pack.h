// A load's repacking of GGUF K-quant rows into the kq layout (gemm_kq.h): pack_kq_gguf takes one tensor's
// raw blocks as in the file (llama.cpp's block_q4_K 144, block_q5_K 176, block_q6_K 210 bytes per 256
// weights; block_q8_0 34 bytes per 32) and writes the tiles of the rows rows[0 .. n) (rows[i]: the file
// row of output row i), byte for byte what quant.pack_kq(quant_load.kq_fields(t, rows)) gives: the
// codes (unpacked as the gguf package reads them), the 6-bit scales / mins (get_scale_min_k4, the gguf
// package's Q4_K.get_scale_min), Q6_K's int8 sub-scales and the halves d / dmin are moved, never
// rounded; the last tile's padding rows are zero bytes (pack_kq pads with zero fields). Data movement
// at about memory speed, where numpy's unpacking and torch's permutes cost ~16 s for a 1.7B Q4_K_M file.
// Per tile and super-block: each row's 256 codes are unpacked into a scratch u[8][256] (0..63), then
// the tile's blocks are written from 4-byte words of it (byte i of a word: weight 4v + i).
// ISA: plain C++ (what -O3 vectorizes). Relies on gemm_kq.h (kq_block_bytes, kq_sb_bytes, KQ_HDR, KQ_Q8).
#pragma once

#include "common.h"
#include "gemm_kq.h"

// bytes of one file row of K weights of kind KT (0 Q4_K, 1 Q5_K, 2 Q6_K, 3 Q8_0)
static inline int64_t kq_file_row_bytes(int KT, int64_t K) {
    return KT == KQ_Q8 ? K / 32 * 34 : K / 256 * (KT == 0 ? 144 : KT == 1 ? 176 : 210);
}

static inline uint32_t kq_load32(const uint8_t* p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

// one super-block of one file row: codes u[256], per 32-block s1[8] / s2[8], the halves d / dmin (bytes)
template <int KT>
static inline void kq_unpack_sb(const uint8_t* blk, uint8_t* u, uint8_t* s1, uint8_t* s2, uint8_t* d, uint8_t* dmin) {
    if (KT == 2) {  // ql[128], qh[64], sc[16] (int8), d
        const uint8_t *ql = blk, *qh = blk + 128, *sc = blk + 192;
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 128; j++)
                u[128 * h + j] = ((ql[64 * h + j % 64] >> (4 * (j / 64))) & 15) |
                                 (((qh[32 * h + j % 32] >> (2 * (j / 32))) & 3) << 4);
        for (int b = 0; b < 8; b++) s1[b] = sc[2 * b], s2[b] = sc[2 * b + 1];
        memcpy(d, blk + 208, 2);
        dmin[0] = dmin[1] = 0;
        return;
    }
    // Q4_K: d, dmin, scales[12], qs[128]; Q5_K: d, dmin, scales[12], qh[32], qs[128]
    const uint8_t *q = blk + 4, *qs = blk + (KT == 1 ? 48 : 16), *qh = blk + 16;
    for (int j = 0; j < 8; j++) {  // get_scale_min_k4
        if (j < 4) {
            s1[j] = q[j] & 63;
            s2[j] = q[j + 4] & 63;
        } else {
            s1[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
            s2[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
    }
    for (int j = 0; j < 8; j++)  // block j: nibble j % 2 of qs[32 (j / 2) + l] (Q5_K: bit j of qh[l] the 5th bit)
        for (int l = 0; l < 32; l++) {
            uint8_t c = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
            if (KT == 1) c |= ((qh[l] >> j) & 1) << 4;
            u[32 * j + l] = c;
        }
    memcpy(d, blk, 2);
    memcpy(dmin, blk + 2, 2);
}

template <int KT>
static void pack_kq_tiles(const uint8_t* raw, int64_t K, const int64_t* rows, int64_t n, uint8_t* out) {
    const int64_t row_bytes = kq_file_row_bytes(KT, K), T = (n + 7) / 8;
    if (KT == KQ_Q8) {  // per 32-block: vector s byte 4c + i = q[c][32b + 4s + i], then d[8]
        const int64_t nbk = K / 32, bb = kq_block_bytes(KQ_Q8);
        for (int64_t t = 0; t < T; t++) {
            uint8_t* tile = out + t * nbk * bb;
            for (int c = 0; c < 8; c++) {
                if (8 * t + c >= n) {
                    for (int64_t b = 0; b < nbk; b++) {
                        for (int s = 0; s < 8; s++) memset(tile + b * bb + 32 * s + 4 * c, 0, 4);
                        memset(tile + b * bb + 256 + 2 * c, 0, 2);
                    }
                    continue;
                }
                const uint8_t* src = raw + rows[8 * t + c] * row_bytes;
                for (int64_t b = 0; b < nbk; b++) {
                    const uint8_t* blk = src + 34 * b;
                    uint8_t* dst = tile + b * bb;
                    for (int s = 0; s < 8; s++) memcpy(dst + 32 * s + 4 * c, blk + 2 + 4 * s, 4);
                    memcpy(dst + 256 + 2 * c, blk, 2);
                }
            }
        }
        return;
    }
    const int64_t nsb = K / 256, fsb = row_bytes / nsb, bb = kq_block_bytes(KT), sbb = kq_sb_bytes(KT);
    alignas(64) uint8_t u[8][256], s1[8][8], s2[8][8];
    for (int64_t t = 0; t < T; t++) {
        uint8_t* tile = out + t * nsb * sbb;
        for (int64_t s = 0; s < nsb; s++) {
            uint8_t* sb = tile + s * sbb;
            for (int c = 0; c < 8; c++) {
                if (8 * t + c < n)
                    kq_unpack_sb<KT>(raw + rows[8 * t + c] * row_bytes + s * fsb, u[c], s1[c], s2[c], sb + 2 * c,
                                     sb + 16 + 2 * c);
                else {  // (padding: zero fields)
                    memset(u[c], 0, 256);
                    memset(s1[c], 0, 8);
                    memset(s2[c], 0, 8);
                    memset(sb + 2 * c, 0, 2);
                    memset(sb + 16 + 2 * c, 0, 2);
                }
            }
            for (int b = 0; b < 8; b++) {
                uint8_t* blk = sb + KQ_HDR + b * bb;
                for (int c = 0; c < 8; c++) {
                    uint32_t h0 = 0, h1 = 0;  // Q5_K: h0 the 5th bits; Q6_K: h0 / h1 the low / high nibbles' 5th, 6th
                    for (int v = 0; v < 4; v++) {
                        const uint32_t lo = kq_load32(u[c] + 32 * b + 4 * v), hi = kq_load32(u[c] + 32 * b + 16 + 4 * v);
                        const uint32_t w = (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4);
                        memcpy(blk + 32 * v + 4 * c, &w, 4);
                        if (KT == 1) {
                            h0 |= ((lo >> 4) & 0x01010101u) << v;
                            h0 |= ((hi >> 4) & 0x01010101u) << (4 + v);
                        } else if (KT == 2) {
                            h0 |= ((lo >> 4) & 0x03030303u) << (2 * v);
                            h1 |= ((hi >> 4) & 0x03030303u) << (2 * v);
                        }
                    }
                    if (KT == 1) memcpy(blk + 128 + 4 * c, &h0, 4);
                    if (KT == 2) {
                        memcpy(blk + 128 + 4 * c, &h0, 4);
                        memcpy(blk + 160 + 4 * c, &h1, 4);
                    }
                    blk[bb - 16 + c] = s1[c][b];
                    blk[bb - 8 + c] = s2[c][b];
                }
            }
        }
    }
}

// kind: 0 Q4_K, 1 Q5_K, 2 Q6_K, 3 Q8_0; out: (n + 7) / 8 tiles of kq_tile bytes
static void pack_kq_gguf(const uint8_t* raw, int64_t kind, int64_t K, const int64_t* rows, int64_t n, uint8_t* out) {
    switch (kind) {
        case 0: pack_kq_tiles<0>(raw, K, rows, n, out); break;
        case 1: pack_kq_tiles<1>(raw, K, rows, n, out); break;
        case 2: pack_kq_tiles<2>(raw, K, rows, n, out); break;
        default: pack_kq_tiles<KQ_Q8>(raw, K, rows, n, out); break;
    }
}

// ---- the way back: fp32 rows of kq tiles (an embedding's lookup) -----------------------------------------
// Row id of a kq-layout weight (tile table `tiles`, K columns) as fp32: quant.KQFields.dequantize's numbers,
// the same fp32 steps per weight, (d * sc) * u - dmin * m (Q4_K / Q5_K), (d * sc) * (u - 32) (Q6_K), d * q (Q8_0),
// with no contraction into an FMA (the attribute: -O3 -mfma would fuse a product and its difference, and the
// rows must be the torch path's bits). One call per step looks up a token's row or a few: the torch path
// unpacked each whole 8-row tile through ~40 tensor ops (~0.6-0.8 ms a step at 1.7B).
template <int KT>
__attribute__((optimize("fp-contract=off"))) static void kq_row(const uint8_t* t, int c, int64_t K, float* out) {
    if (KT == KQ_Q8) {
        for (int64_t b = 0; b < K / 32; b++) {
            const uint8_t* p = t + b * kq_block_bytes(KQ_Q8);
            const float d = ld1((const half_t*)(p + 256) + c);
            for (int v = 0; v < 8; v++)
                for (int i = 0; i < 4; i++) out[32 * b + 4 * v + i] = (float)(int8_t)p[32 * v + 4 * c + i] * d;
        }
        return;
    }
    const int64_t bb = kq_block_bytes(KT);
    for (int64_t s = 0; s < K / 256; s++) {
        const uint8_t* sb = t + s * kq_sb_bytes(KT);
        const float d = ld1((const half_t*)sb + c), dmin = ld1((const half_t*)(sb + 16) + c);
        for (int j = 0; j < 8; j++) {
            const uint8_t* p = sb + KQ_HDR + j * bb;
            float* o = out + 256 * s + 32 * j;
            const uint8_t s1 = p[bb - 16 + c], s2 = p[bb - 8 + c];
            for (int v = 0; v < 4; v++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t byte = p[32 * v + 4 * c + i];
                    int lo = byte & 15, hi = byte >> 4;
                    if (KT == 1) {
                        const uint8_t h = p[128 + 4 * c + i];
                        lo |= ((h >> v) & 1) << 4, hi |= ((h >> (v + 4)) & 1) << 4;
                    } else if (KT == 2) {
                        lo |= ((p[128 + 4 * c + i] >> (2 * v)) & 3) << 4, hi |= ((p[160 + 4 * c + i] >> (2 * v)) & 3) << 4;
                    }
                    if (KT == 2) {
                        const float a = d * (float)(int8_t)s1, b = d * (float)(int8_t)s2;
                        o[4 * v + i] = a * ((float)lo - 32.0f), o[16 + 4 * v + i] = b * ((float)hi - 32.0f);
                    } else {
                        const float a = d * (float)s1, m = dmin * (float)s2;
                        o[4 * v + i] = a * (float)lo - m, o[16 + 4 * v + i] = a * (float)hi - m;
                    }
                }
        }
    }
}

// rows ids[0 .. n) of a kq-layout weight w (tile table tiles, K columns) into out [n, K]
static void kq_rows(const uint8_t* w, const int64_t* tiles, int64_t K, const int64_t* ids, int64_t n, float* out) {
#pragma omp parallel for schedule(static) if (n >= 16)
    for (int64_t r = 0; r < n; r++) {
        const int64_t e = tiles[ids[r] / 8];
        const uint8_t* t = w + kq_off(e);
        const int c = (int)(ids[r] % 8);
        switch (kq_kind(e)) {
            case 0: kq_row<0>(t, c, K, out + r * K); break;
            case 1: kq_row<1>(t, c, K, out + r * K); break;
            case 2: kq_row<2>(t, c, K, out + r * K); break;
            default: kq_row<KQ_Q8>(t, c, K, out + r * K);
        }
    }
}
