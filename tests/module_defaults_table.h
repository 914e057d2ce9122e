// TE's module defaults, the one table both the server's and the C++ client's
// defaults are checked against (tests/data/te_module_defaults.json; the test
// lists //tests/data:te_module_defaults as data).
#ifndef TE_TESTS_MODULE_DEFAULTS_TABLE_H_
#define TE_TESTS_MODULE_DEFAULTS_TABLE_H_

#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/runfiles.h"

namespace te::testing {

// The parsed table; a discarded json value, and a failed expectation naming
// the path, when the file cannot be read.
inline nlohmann::json ModuleDefaultsTable() {
  const std::string path = RunfilePath("tests/data/te_module_defaults.json");
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

}  // namespace te::testing

#endif  // TE_TESTS_MODULE_DEFAULTS_TABLE_H_
