// Where a test finds the files its BUILD target lists as data: under
// $TEST_SRCDIR/$TEST_WORKSPACE as bazel test runs it, else relative to the
// current folder (a test binary run by hand from the runfiles tree).
#ifndef TE_TESTS_RUNFILES_H_
#define TE_TESTS_RUNFILES_H_

#include <cstdlib>
#include <string>

namespace te::testing {

// `relative` is the path from the repository root, e.g. "server/te_server".
inline std::string RunfilePath(const std::string& relative) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return std::string(srcdir != nullptr ? srcdir : ".") + "/" +
         (workspace != nullptr ? workspace : "te_server") + "/" + relative;
}

}  // namespace te::testing

#endif  // TE_TESTS_RUNFILES_H_
