// The int8-activation GEMM, y = x @ W^T (+ add) (+ bias) from int8 codes of x (quantize.h) and a
// weight in the x8 layout (gemm_x8_avx2.h): gemm_x8 runs a call on the instruction set x8_isa chose
// (common.h): AMX from AMX_MIN_ROWS rows, else AVX512-VNNI, else AVX2, all bitwise equal. Relies on
// gemm_x8_avx2.h, gemm_x8_avx512.h, gemm_x8_amx.h.
#pragma once

#include "common.h"
#include "gemm_x8_amx.h"
#include "gemm_x8_avx2.h"
#include "gemm_x8_avx512.h"

template <bool INT4, class S>
static void gemm_x8(const int8_t* qx, const float* dx, const float* xs, int64_t M, int64_t K, const uint8_t* w,
                    const S* scale, const S* mins, bool off8, int64_t N, const float* add, const float* bias,
                    float* y) {
    const int isa = x8_isa();
    if (isa == 2 && M >= AMX_MIN_ROWS(INT4))
        return gemm_x8_amx<INT4, S>(qx, dx, xs, M, K, w, scale, mins, off8, N, add, bias, y);
    if (isa >= 1) return gemm_x8_512<INT4, S>(qx, dx, xs, M, K, w, scale, mins, off8, N, add, bias, y);
    gemm_x8_256<INT4, S>(qx, dx, xs, M, K, w, scale, mins, off8, N, add, bias, y);
}
