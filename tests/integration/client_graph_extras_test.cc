// A classifier trained on int32 labels beside a float32 x, through the C++
// client and the real te_server (CPU backend, loopback): the model graph is
// initialised, and a loss graph over it (its Dense, cross-entropy against
// the labels, and an L2 penalty that reads the Dense's kernel through a param
// node) is added with its extra input declared (AddGraph extra_inputs:
// int32 [batch]). The loss and the kernel's gradient (the sum of the
// cross-entropy's and the penalty's) match float64 here, at the traced batch
// and another; labels of another dtype or shape are INVALID_ARGUMENT naming
// extra_inputs[0].
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/graph.h"
#include "client/modules.h"
#include "gtest/gtest.h"
#include "tests/integration/client_session_fixture.h"

namespace te::client {
namespace {

constexpr int64_t kB = 6, kF = 5, kV = 4;
constexpr double kPenalty = 0.05;
// float32 on the server against float64 here: sums of at most ~30 terms.
constexpr double kTolerance = 1e-5;

FlaxDense Classifier() {
  FlaxDense dense(kV);
  dense.use_bias = false;
  dense.highest_precision = true;
  return dense;
}

// The model: logits = Dense_0(x).
Graph Model(int64_t batch) {
  Graph g("Model", {batch, kF}, DType::kF32);
  g.SetOutput(g.Call(Classifier(), {g.x()}));
  return g;
}

// loss_fn(params, x, labels) = cross_entropy(Dense_0(x), labels).mean() +
// kPenalty * sum(params["Dense_0"]["kernel"] ** 2).
Graph Loss(int64_t batch) {
  Graph g("Loss", {batch, kF}, DType::kF32);
  const Graph::Edge labels = g.ExtraInput(0, {batch}, DType::kI32);
  const Graph::Edge logits = g.Call(Classifier(), {g.x()});
  const Graph::Edge ce = g.SoftmaxCrossEntropyWithIntegerLabels(logits, labels);
  const Graph::Edge kernel = g.Param("Dense_0/kernel", {kF, kV});
  const Graph::Edge l2 =
      g.Reduce(te::v1::GraphSpec::Reduce::SUM, g.Unary(te::v1::GraphSpec::Unary::SQUARE, kernel));
  g.SetOutput(g.Binary(te::v1::GraphSpec::Binary::ADD, ce, g.Scale(l2, kPenalty)));
  return g;
}

HostTensor Labels(int64_t batch) {
  std::vector<float> v;
  for (int64_t n = 0; n < batch; ++n) v.push_back(static_cast<float>((n * 3 + 1) % kV));
  return *HostTensor::FromFloats({batch}, v, DType::kI32);
}

class ClientGraphExtrasTest : public testing::ClientSessionTest {
 protected:

};


// The loss and dloss/dkernel in float64.
void Reference(const std::vector<float>& x, const std::vector<float>& labels,
               const std::vector<float>& w, double* loss, std::vector<double>* dw) {
  const int64_t batch = static_cast<int64_t>(labels.size());
  *loss = 0;
  dw->assign(w.size(), 0.0);
  for (int64_t n = 0; n < batch; ++n) {
    std::vector<double> logits(kV, 0.0);
    for (int64_t v = 0; v < kV; ++v) {
      for (int64_t f = 0; f < kF; ++f) logits[v] += double(x[n * kF + f]) * w[f * kV + v];
    }
    double top = logits[0], sum = 0;
    for (double l : logits) top = std::max(top, l);
    for (double l : logits) sum += std::exp(l - top);
    const int label = static_cast<int>(labels[n]);
    *loss += (top + std::log(sum) - logits[label]) / batch;
    for (int64_t v = 0; v < kV; ++v) {
      const double d = (std::exp(logits[v] - top) / sum - (v == label ? 1.0 : 0.0)) / batch;
      for (int64_t f = 0; f < kF; ++f) (*dw)[f * kV + v] += x[n * kF + f] * d;
    }
  }
  for (size_t i = 0; i < w.size(); ++i) {
    *loss += kPenalty * w[i] * w[i];
    (*dw)[i] += 2 * kPenalty * w[i];
  }
}

double RelativeError(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / norm);
}

TEST_F(ClientGraphExtrasTest, Int32LabelsAndAParamPenaltyTrainAClassifier) {
  const HostTensor x0 = HostTensor::RandomNormal({kB, kF}, DType::kF32, 7);
  absl::StatusOr<Variables> vars = Model(kB).Init(*session_, 42, x0);
  ASSERT_TRUE(vars.ok()) << vars.status();
  absl::StatusOr<std::map<std::string, HostTensor>> params = GetVariables(*vars, {"params"});
  ASSERT_TRUE(params.ok()) << params.status();
  ASSERT_EQ(params->size(), 1u);
  const std::vector<float> w = params->at("params/Dense_0/kernel").ToFloats();

  // The declaration AddGraph sends: the labels' dtype and shape beside x.
  const std::vector<te::v1::TensorHeader> declared = Loss(kB).ExtraInputs({kB, kF});
  ASSERT_EQ(declared.size(), 1u);
  EXPECT_EQ(declared[0].dtype(), te::v1::INT32);
  EXPECT_EQ(std::vector<int64_t>(declared[0].shape().begin(), declared[0].shape().end()),
            (std::vector<int64_t>{kB}));

  for (const int64_t batch : {kB, int64_t{3}}) {
    SCOPED_TRACE(batch);
    absl::StatusOr<AddedGraph> loss = AddGraph(*vars, Loss(batch), {batch, kF}, DType::kF32);
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_GT(loss->graph, 0);
    EXPECT_EQ(loss->output_shape, Shape{});
    const HostTensor x = HostTensor::RandomNormal({batch, kF}, DType::kF32, 8 + batch);
    const HostTensor labels = Labels(batch);
    ApplyOptions options;
    options.graph = loss->graph;
    options.extra_inputs = {labels};
    absl::StatusOr<ValueAndGradResult> step = Model(batch).LossValueAndGrad(*vars, x, options);
    ASSERT_TRUE(step.ok()) << step.status();
    double want = 0;
    std::vector<double> dw;
    Reference(x.ToFloats(), labels.ToFloats(), w, &want, &dw);
    EXPECT_NEAR(step->value, want, kTolerance * std::abs(want));
    ASSERT_EQ(step->grads.count("params/Dense_0/kernel"), 1u);
    EXPECT_LT(RelativeError(step->grads.at("params/Dense_0/kernel").ToFloats(), dw), kTolerance);

    // Labels unlike the declaration: INVALID_ARGUMENT naming them.
    options.extra_inputs = {*HostTensor::FromFloats({batch}, labels.ToFloats(), DType::kF32)};
    absl::StatusOr<ValueAndGradResult> float_labels = Model(batch).LossValueAndGrad(*vars, x, options);
    ASSERT_FALSE(float_labels.ok());
    EXPECT_EQ(float_labels.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(float_labels.status().message().find(
                  "extra_inputs[0].dtype: float32, but the graph's extra_inputs[0] was declared int32"),
              std::string::npos)
        << float_labels.status();
    options.extra_inputs = {Labels(batch + 1)};
    absl::StatusOr<ValueAndGradResult> longer = Model(batch).LossValueAndGrad(*vars, x, options);
    ASSERT_FALSE(longer.ok());
    EXPECT_EQ(longer.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(longer.status().message().find("extra_inputs[0].shape"), std::string::npos)
        << longer.status();
  }
}

// With the labels declared, AddGraph checks them against the graph: labels
// that do not fit the logits are its INVALID_ARGUMENT naming the node.
TEST_F(ClientGraphExtrasTest, AddGraphChecksTheDeclaredLabels) {
  absl::StatusOr<Variables> vars =
      Model(kB).Init(*session_, 1, HostTensor::RandomNormal({kB, kF}, DType::kF32, 1));
  ASSERT_TRUE(vars.ok()) << vars.status();
  absl::StatusOr<te::v1::LayerSpec> spec = Loss(kB).Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  te::v1::AddGraphRequest request;
  request.set_layer_id(vars->layer_id);
  *request.mutable_graph() = spec->graph();
  request.set_input_dtype(te::v1::FLOAT32);
  request.add_input_shape(kB);
  request.add_input_shape(kF);
  te::v1::TensorHeader* labels = request.add_extra_inputs();
  labels->set_dtype(te::v1::INT32);
  labels->add_shape(kB + 1);
  absl::StatusOr<te::v1::AddGraphResponse> added = session_->AddGraph(request);
  ASSERT_FALSE(added.ok());
  EXPECT_EQ(added.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(added.status().message().find("labels [7] do not fit logits [6, 4]"), std::string::npos)
      << added.status();
  labels->set_dtype(te::v1::FLOAT32);
  labels->set_shape(0, kB);
  added = session_->AddGraph(request);
  ASSERT_FALSE(added.ok());
  EXPECT_EQ(added.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(added.status().message().find("labels are float32; want int32"), std::string::npos)
      << added.status();
}

}  // namespace
}  // namespace te::client
