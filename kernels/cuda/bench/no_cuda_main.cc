// The benchmarks in a build without the CUDA toolkit: nothing to measure.
#include <cstdio>

int main() {
  std::fprintf(stderr, "this build has no CUDA backend\n");
  return 1;
}
