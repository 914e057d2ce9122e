// The C++ client's quickstart graphs are the Python client's: each composite
// section built at --config=quickstart equals, field for field, the GraphSpec
// the Python tracer builds from the notebook's class
// (tests/data/quickstart_graphs, written by
// client/python/examples/quickstart_graphs.py). Both clients then send the
// server the same layer, with the same names and so the same parameters.
#include <string>

#include "client/quickstart_layers.h"
#include "client/golden_graphs.h"
#include "gtest/gtest.h"

namespace te::client {
namespace {

void ExpectGolden(const Graph& graph, const std::string& name) {
  testing::ExpectGolden(graph, "quickstart_graphs", name);
}

const LayerSize kQuickstart = SizeForConfig("quickstart").value();

TEST(QuickstartGraphsTest, Section1PlainFlax) { ExpectGolden(QuickstartFlaxLayer(kQuickstart), "flax"); }

TEST(QuickstartGraphsTest, Section2TeModulesWithFlaxAttention) {
  ExpectGolden(UnfusedLayer(kQuickstart, /*use_te_attention=*/false), "te_flax_attention");
}

// Section 4 is section 3's graph under autocast.
TEST(QuickstartGraphsTest, Sections3And4TeAttention) { ExpectGolden(UnfusedLayer(kQuickstart), "te_attention"); }

TEST(QuickstartGraphsTest, Section5Fused) { ExpectGolden(FusedLayer(kQuickstart), "fused"); }

// Sections 2 and 3 differ in the attention, so their graphs do too.
TEST(QuickstartGraphsTest, Section3IsNotSection2) {
  absl::StatusOr<te::v1::LayerSpec> spec = UnfusedLayer(kQuickstart).Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_FALSE(google::protobuf::util::MessageDifferencer::Equals(
      testing::Golden("quickstart_graphs", "te_flax_attention"), spec->graph()));
}

}  // namespace
}  // namespace te::client
