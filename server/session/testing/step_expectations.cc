#include "server/session/testing/step_expectations.h"

#include "gtest/gtest.h"

namespace te::session::testing {

void ExpectSameStep(const te::v1::ForwardBackwardResponse& got,
                    const te::v1::ForwardBackwardResponse& want) {
  EXPECT_EQ(got.update().applied(), want.update().applied());
  ASSERT_EQ(got.values_size(), want.values_size());
  for (int i = 0; i < want.values_size(); ++i) EXPECT_EQ(got.values(i), want.values(i)) << i;
  EXPECT_EQ(got.update().grad_norm(), want.update().grad_norm());
}

void ExpectSameVariables(const std::map<std::string, std::string>& got,
                         const std::map<std::string, std::string>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, bytes] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << name;
    EXPECT_TRUE(it->second == bytes) << name << " differs";
  }
}

}  // namespace te::session::testing
