// libFuzzer entry point over te_server's request handling (request_harness.h).
// Built and run by tests/fuzz/run_fuzz.sh with clang-14.
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/request_harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  te::fuzz::RunOne(data, size).IgnoreError();
  return 0;
}
