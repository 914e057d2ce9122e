// The main of GPU-only binaries in a build without the CUDA toolkit.
#include <cstdio>

int main() {
  std::fprintf(stderr, "built without CUDA: this program needs the CUDA backend\n");
  return 1;
}
