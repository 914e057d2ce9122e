// sampling_bench: the host's cost of one sampled token per row of logits, at
// GPT-2's 50,257 tokens (normal logits, sd 3), for the settings users pick:
// the order alone (MostLikelyFirst, all kept or top_k 50) and SampleTokens
// whole (temperature alone; top_k 50 with top_p 0.95; top_p 0.9 alone).
// Beside the order: the std::stable_sort that defines it (the sampling
// order before MostLikelyFirst), for the ratio. Medians of --reps timed
// calls after one untimed one; jemalloc, as te_server.
//
//   bazel run //bench/generate:sampling_bench
//
// Not a test: it asserts nothing, and its figures depend on the machine.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "server/layers/generate.h"

ABSL_FLAG(int, reps, 50, "timed calls per row of the table");
ABSL_FLAG(int, vocab, 50257, "tokens per row");

namespace {

double MedianMs(const std::function<void()>& fn) {
  fn();
  std::vector<double> ms;
  for (int i = 0; i < absl::GetFlag(FLAGS_reps); ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t vocab = absl::GetFlag(FLAGS_vocab);
  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> row(static_cast<size_t>(vocab));
  for (float& v : row) v = normal(gen);
  int64_t sink = 0;

  std::printf("one row of %lld logits, median of %d calls\n", static_cast<long long>(vocab),
              absl::GetFlag(FLAGS_reps));
  const double stable = MedianMs([&] {
    std::vector<int32_t> order(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    sink += order[0];
  });
  std::printf("| what | ms a row | vs std::stable_sort |\n| --- | ---: | ---: |\n");
  std::printf("| std::stable_sort of every token | %.3f | 1.00x |\n", stable);
  for (const size_t keep : {static_cast<size_t>(vocab), size_t{50}}) {
    const double ms = MedianMs([&] { sink += te::layers::MostLikelyFirst(row.data(), vocab, keep)[0]; });
    std::printf("| MostLikelyFirst, keep %zu | %.3f | %.1fx |\n", keep, ms, stable / ms);
  }
  struct Setting {
    const char* name;
    int64_t top_k;
    float top_p;
  };
  for (const Setting& s : {Setting{"temperature 0.8 alone", 0, 1.0f},
                           Setting{"top_k 50, top_p 0.95", 50, 0.95f},
                           Setting{"top_p 0.9 alone", 0, 0.9f}}) {
    te::layers::SamplingOptions options;
    options.greedy = false;
    options.temperature = 0.8f;
    options.top_k = s.top_k;
    options.top_p = s.top_p;
    int64_t step = 0;
    const double ms = MedianMs([&] {
      auto tokens = te::layers::SampleTokens(row, 1, vocab, options, step++);
      sink += tokens.ok() ? (*tokens)[0] : -1;
    });
    std::printf("| SampleTokens, %s | %.3f | %.1fx |\n", s.name, ms, stable / ms);
  }
  std::printf("(checksum %lld: keeps the work from being optimised away)\n",
              static_cast<long long>(sink));
  return 0;
}
