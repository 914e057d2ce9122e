// How a GPU test meets a machine without a GPU. CI has none and skips the
// gpu-tagged tests; `bazel test` there skips each test. On the GPU machine
// the bundle's run.sh sets TE_REQUIRE_GPU=1, and a test that finds no GPU
// fails instead, so a GPU run is never reported passed on skipped tests.
//
//   if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
//
// Like FAIL() and GTEST_SKIP(), it returns from the enclosing void function
// (a TEST body or SetUp).
#ifndef TE_KERNELS_GPU_TEST_GATE_H_
#define TE_KERNELS_GPU_TEST_GATE_H_

#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"

namespace te {

inline bool GpuRequired() {
  const char* require = std::getenv("TE_REQUIRE_GPU");
  return require != nullptr && std::strcmp(require, "1") == 0;
}

}  // namespace te

#define TE_SKIP_OR_FAIL_WITHOUT_GPU(why)                  \
  do {                                                    \
    if (::te::GpuRequired()) {                            \
      FAIL() << "TE_REQUIRE_GPU=1, but " << why;          \
    }                                                     \
    GTEST_SKIP() << why;                                  \
  } while (0)

#endif  // TE_KERNELS_GPU_TEST_GATE_H_
