// The CPU kernel's paged attention alone (write_and_attend: the step's keys and values into the
// fp16 cache, then every row's attention), over SmolLM2-135M's 30 layers (9 query heads, 3 KV heads,
// head dim 64; each layer its own cache, so the context streams from L3 / memory as in a step), one
// sequence of C cached tokens plus W new rows (causal among themselves), 16-slot blocks in a
// shuffled order, median and fastest of REPS passes: what a decode step's and a verification's attention costs
// without Python or the GEMMs (docs/benchmarks.md, session 21).
//
//   g++ -O3 -mavx2 -mfma -mf16c -fopenmp -std=c++17 -o /tmp/att_rows eval/att_rows.cpp
//   OMP_NUM_THREADS=2 [COLD=1] [REPS=N] /tmp/att_rows ISA C:W...        (e.g. 2 900:1 900:4 900:8)
//
// ISA: as specd_x8_isa (1 or 2: the AVX512 attention, 0: AVX2). REPS (default 60) passes per shape.
#include "../specd/model/cpu_kernel/kernel.cpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

int main(int argc, char** argv) {
  const int64_t NL = 30, H = 9, KVH = 3, D = 64, BS = 16, stride = (H + 2 * KVH) * D;
  const int reps = getenv("REPS") ? atoi(getenv("REPS")) : 60;
  // COLD=1: 16 MiB of other data touched (on every thread) before each layer, not timed, so the
  // layer's keys and values come from L3 / memory as in a step (where ~3 MB of weights stream
  // between two layers' attention); else a short context's cache stays in L2 from pass to pass
  const bool cold = getenv("COLD") && atoi(getenv("COLD"));
  std::vector<float> junk(cold ? (16 << 20) / 4 : 0, 1.f);
  specd_x8_isa(atoi(argv[1]));
  std::mt19937 g(1);
  for (int ai = 2; ai < argc; ai++) {
    int64_t C = 0, W = 0;
    if (sscanf(argv[ai], "%ld:%ld", &C, &W) != 2 || C < 0 || W < 1) { fprintf(stderr, "C:W expected\n"); return 2; }
    const int64_t Lp = C + W, maxb = (Lp + BS - 1) / BS, nslots = (maxb + 1) * BS;
    std::vector<int32_t> bt(maxb);
    for (int64_t i = 0; i < maxb; i++) bt[i] = (int32_t)i;
    std::shuffle(bt.begin(), bt.end(), g);
    std::vector<int64_t> slots(W);
    for (int64_t t = 0; t < W; t++) slots[t] = (int64_t)bt[(C + t) / BS] * BS + (C + t) % BS;
    // 64-byte aligned as torch's tensors are (a value row's 32-column slice is one cache line)
    const size_t n = 2 * nslots * KVH * D;
    std::vector<half_t*> kv(NL);
    for (auto& l : kv) {
      l = (half_t*)aligned_alloc(64, (n * sizeof(half_t) + 63) / 64 * 64);
      for (size_t i = 0; i < n; i++) l[i] = _cvtss_sh((g() % 2000) / 1000.0f - 1, 0);
    }
    std::vector<float> qkv(W * stride), out(W * H * D), bias(W * Lp, 0.f);
    for (auto& v : qkv) v = (g() % 2000) / 1000.0f - 1;
    for (int64_t t = 0; t < W; t++) for (int64_t j = C + t + 1; j < Lp; j++) bias[t * Lp + j] = -INFINITY;
    const int32_t qsl[2] = {0, (int32_t)W};
    std::vector<double> ts;
    for (int rep = 0; rep < reps; rep++) {
      double ms = 0;
      for (int64_t l = 0; l < NL; l++) {
        if (cold) {  // what a step's weight stream does between layers: this layer's cache out of L1 / L2
#pragma omp parallel for schedule(static)
          for (int64_t i = 0; i < (int64_t)junk.size(); i += 16) junk[i] += 1;
        }
        auto t0 = std::chrono::steady_clock::now();
        write_and_attend(kv[l], qkv.data(), W, stride, H, KVH, D, nslots, slots.data(), qsl, 1, bt.data(),
                         maxb, BS, bias.data(), W, Lp, 0.125f, out.data());
        ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      }
      ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    double sum = 0;
    for (float v : out) sum += v;
    for (auto* l : kv) free(l);
    printf("context %ld rows %ld: median %.3f ms, fastest %.3f (checksum %.6g)\n", (long)C, (long)W, ts[ts.size() / 2],
           ts[0], sum);
  }
}
