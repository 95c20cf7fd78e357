// Fused multiply-adds per second on one core, 512-bit and 256-bit (12 independent chains, so the
// rate is the units' throughput, not one chain's latency): the ceiling the CPU kernel's fp32 work
// (attention scores and weighted sums, the GEMMs' per-block scaling) runs against on this machine
// (docs/benchmarks.md, session 20).
//
//   g++ -O2 -o /tmp/fma_rate eval/fma_rate.cpp && /tmp/fma_rate
#include <immintrin.h>

#include <chrono>
#include <cstdio>

static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// 12 named accumulators (an array in a loop stayed in memory at -O2: a store and a load per FMA)
#define FMA12(f)                                                                     \
    a0 = f(a0, b, c), a1 = f(a1, b, c), a2 = f(a2, b, c), a3 = f(a3, b, c);       \
    a4 = f(a4, b, c), a5 = f(a5, b, c), a6 = f(a6, b, c), a7 = f(a7, b, c);       \
    a8 = f(a8, b, c), a9 = f(a9, b, c), a10 = f(a10, b, c), a11 = f(a11, b, c)

__attribute__((target("avx512f"))) static double rate512(long n) {
    const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
    // distinct starting values, or the compiler merges the twelve identical chains into one
    __m512 a0 = _mm512_set1_ps(0.50f), a1 = _mm512_set1_ps(0.51f), a2 = _mm512_set1_ps(0.52f), a3 = _mm512_set1_ps(0.53f), a4 = _mm512_set1_ps(0.54f),
           a5 = _mm512_set1_ps(0.55f), a6 = _mm512_set1_ps(0.56f), a7 = _mm512_set1_ps(0.57f), a8 = _mm512_set1_ps(0.58f), a9 = _mm512_set1_ps(0.59f),
           a10 = _mm512_set1_ps(0.60f), a11 = _mm512_set1_ps(0.61f);
    const auto t0 = std::chrono::steady_clock::now();
    for (long k = 0; k < n; k++) {
        FMA12(_mm512_fmadd_ps);
    }
    const double s = seconds_since(t0);
    const __m512 s0 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                    _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    volatile float sink = _mm512_reduce_add_ps(_mm512_add_ps(s0, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11))));
    (void)sink;
    return 12.0 * n / s / 1e9;
}

__attribute__((target("avx2,fma"))) static double rate256(long n) {
    const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
    // distinct starting values, or the compiler merges the twelve identical chains into one
    __m256 a0 = _mm256_set1_ps(0.50f), a1 = _mm256_set1_ps(0.51f), a2 = _mm256_set1_ps(0.52f), a3 = _mm256_set1_ps(0.53f), a4 = _mm256_set1_ps(0.54f),
           a5 = _mm256_set1_ps(0.55f), a6 = _mm256_set1_ps(0.56f), a7 = _mm256_set1_ps(0.57f), a8 = _mm256_set1_ps(0.58f), a9 = _mm256_set1_ps(0.59f),
           a10 = _mm256_set1_ps(0.60f), a11 = _mm256_set1_ps(0.61f);
    const auto t0 = std::chrono::steady_clock::now();
    for (long k = 0; k < n; k++) {
        FMA12(_mm256_fmadd_ps);
    }
    const double s = seconds_since(t0);
    alignas(32) float t[8];
    const __m256 s0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                    _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    _mm256_store_ps(t, _mm256_add_ps(s0, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11))));
    volatile float sink = t[0];
    (void)sink;
    return 12.0 * n / s / 1e9;
}

int main() {
    const long n = 200000000 / 12;
    for (int r = 0; r < 2; r++) {
        const double r512 = rate512(n), r256 = rate256(n);
        printf("512-bit: %.2f G FMA instructions/s (%.1f G fp32 FMAs/s); 256-bit: %.2f G/s (%.1f G/s)\n", r512,
               16 * r512, r256, 8 * r256);
    }
}
