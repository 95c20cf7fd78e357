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

__attribute__((target("avx512f"))) static double rate512(long n) {
    __m512 a[12];
    const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
    for (auto& v : a) v = _mm512_set1_ps(0.5f);
    const auto t0 = std::chrono::steady_clock::now();
    for (long k = 0; k < n; k++)
        for (auto& v : a) v = _mm512_fmadd_ps(v, b, c);
    const double s = seconds_since(t0);
    volatile float sink = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[11]));
    (void)sink;
    return 12.0 * n / s / 1e9;
}

__attribute__((target("avx2,fma"))) static double rate256(long n) {
    __m256 a[12];
    const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
    for (auto& v : a) v = _mm256_set1_ps(0.5f);
    const auto t0 = std::chrono::steady_clock::now();
    for (long k = 0; k < n; k++)
        for (auto& v : a) v = _mm256_fmadd_ps(v, b, c);
    const double s = seconds_since(t0);
    alignas(32) float t[8];
    _mm256_store_ps(t, _mm256_add_ps(a[0], a[11]));
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
