// The C++ client's quickstart graphs are the Python client's: each composite
// section built at --config=quickstart equals, field for field, the GraphSpec
// the Python tracer builds from the notebook's class
// (tests/data/quickstart_graphs, written by
// client/python/examples/quickstart_graphs.py). Both clients then send the
// server the same layer, with the same names and so the same parameters.
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "client/quickstart_layers.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace te::client {
namespace {

te::v1::GraphSpec Golden(const std::string& section) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  const std::string path = std::string(srcdir != nullptr ? srcdir : ".") + "/" +
                           (workspace != nullptr ? workspace : "te_server") + "/tests/data/quickstart_graphs/" +
                           section + ".textproto";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::stringstream text;
  text << in.rdbuf();
  te::v1::GraphSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text.str(), &spec)) << path;
  EXPECT_GT(spec.nodes_size(), 0) << path;
  return spec;
}

void ExpectGolden(const Graph& graph, const std::string& section) {
  absl::StatusOr<te::v1::LayerSpec> spec = graph.Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(spec->has_graph());
  const te::v1::GraphSpec want = Golden(section);
  std::string diff;
  google::protobuf::util::MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differencer.Compare(want, spec->graph())) << section << ":\n" << diff;
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
  EXPECT_FALSE(google::protobuf::util::MessageDifferencer::Equals(Golden("te_flax_attention"), spec->graph()));
}

}  // namespace
}  // namespace te::client
