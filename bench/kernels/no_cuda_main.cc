// The main of the GPU benchmarks in a build without the CUDA toolkit: nothing
// to measure.
#include <cstdio>

int main() {
  std::fprintf(stderr, "built without CUDA: this benchmark needs the CUDA backend\n");
  return 1;
}
