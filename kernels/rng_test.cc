// DeriveSeed, the one rule every seed is derived by, on fixed inputs. The
// Python client's te_client.graph.derive_seed asserts the same table
// (client/python/tests/test_graph.py, test_derive_seed_matches_kernels_rng_h),
// so the two stay one function.
#include "kernels/rng.h"

#include <cstdint>
#include <string>

#include "gtest/gtest.h"

namespace te {
namespace {

TEST(RngTest, NameHashIsFnv1a) {
  // Published FNV-1a 64 vectors.
  EXPECT_EQ(NameHash(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(NameHash("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(NameHash("foobar"), 0x85944171f73967e8ULL);
  // splitmix64's first output from state 0.
  EXPECT_EQ(MixBits(0x9e3779b97f4a7c15ULL), 0xe220a8397b1dcdafULL);
}

TEST(RngTest, DeriveSeedGivesTheClientsGoldenValues) {
  struct Case {
    uint64_t seed;
    std::string name;
    uint64_t want;
  };
  const Case cases[] = {
      {0, "", 0x8932c885a3fe960eULL},
      {0, "Dropout_0", 0x4c3291c547f85d1dULL},
      {42, "a", 0x9d55d2a4d2693451ULL},
      {42, "Dropout_0", 0x44346a0803b9d8dcULL},
      {42, "DotProductAttention_0", 0x188db220d65b62e9ULL},
      {42, "TEUnfusedMLP_0/DenseGeneral_0", 0x9c21957203262f62ULL},
      {~uint64_t{0}, "foobar", 0x2fb3c296aca49c6dULL},
      {7, "step/3", 0x213ae32250bc5b2bULL},
      {1, "mlp/intermediate_dropout", 0xe04ff5fd1b976eacULL},
  };
  for (const Case& c : cases) EXPECT_EQ(DeriveSeed(c.seed, c.name), c.want) << c.seed << " " << c.name;
}

TEST(RngTest, NamesAndSeedsGiveIndependentSeeds) {
  EXPECT_NE(DeriveSeed(1, "mlp/intermediate_dropout"), DeriveSeed(1, "attention/dropout"));
  EXPECT_NE(DeriveSeed(1, "mlp/intermediate_dropout"), DeriveSeed(2, "mlp/intermediate_dropout"));
  EXPECT_NE(DeriveSeed(1, "step/1"), DeriveSeed(1, "step/2"));
}

}  // namespace
}  // namespace te
