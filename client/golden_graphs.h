// What the C++ client's graph tests compare against: a GraphSpec the Python
// tracer wrote (tests/data/<folder>/<name>.textproto), field for field, so
// both clients send the server the same graph with the same variable names.
#ifndef TE_CLIENT_GOLDEN_GRAPHS_H_
#define TE_CLIENT_GOLDEN_GRAPHS_H_

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "client/graph.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "tests/runfiles.h"

namespace te::client::testing {

// The golden GraphSpec, read from the test's runfiles.
inline te::v1::GraphSpec Golden(const std::string& folder, const std::string& name) {
  const std::string path =
      te::testing::RunfilePath("tests/data/" + folder + "/" + name + ".textproto");
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::stringstream text;
  text << in.rdbuf();
  te::v1::GraphSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text.str(), &spec)) << path;
  EXPECT_GT(spec.nodes_size(), 0) << path;
  return spec;
}

// `graph`'s spec equals the golden one, with the differences in the message.
inline void ExpectGolden(const Graph& graph, const std::string& folder, const std::string& name) {
  absl::StatusOr<te::v1::LayerSpec> spec = graph.Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(spec->has_graph());
  const te::v1::GraphSpec want = Golden(folder, name);
  std::string diff;
  google::protobuf::util::MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differencer.Compare(want, spec->graph())) << name << ":\n" << diff;
}

}  // namespace te::client::testing

#endif  // TE_CLIENT_GOLDEN_GRAPHS_H_
