// libFuzzer entry point over te_server's request handling (request_harness.h).
// Built and run by tests/fuzz/run_fuzz.sh with clang-14. With
// TE_FUZZ_PRINT_STATUS=1 in the environment each input's status goes to
// stderr (for reproducing: `run_fuzz.sh FILE...`).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "tests/fuzz/request_harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool print = [] {
    const char* env = std::getenv("TE_FUZZ_PRINT_STATUS");
    return env != nullptr && std::strcmp(env, "1") == 0;
  }();
  const absl::Status status = te::fuzz::RunOne(data, size);
  if (print) std::fprintf(stderr, "request_fuzzer: status %s\n", status.ToString().c_str());
  return 0;
}
