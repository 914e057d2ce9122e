// CpuOps::AttentionForward / AttentionBackward against a plain float64
// reference (the full logits matrix, masked, softmax, dropout, @ v; analytic
// gradients), and that reference against central finite differences.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/rng.h"

namespace te {
namespace {

// Tolerances, as relative error = max |got - want| / max |want| over a tensor.
constexpr double kF32Tol = 1e-5;   // float32 outputs (and every f32 side output)
constexpr double kBf16Tol = 1e-2;  // bfloat16 outputs: one rounding of 2^-9
constexpr double kF16Tol = 1e-3;   // float16 outputs: one rounding of 2^-11
// The float64 analytic gradient against central differences (step kFdStep).
constexpr double kFdTol = 1e-7;
constexpr double kFdStep = 1e-5;

double Tolerance(DType dtype) {
  return dtype == DType::kF32 ? kF32Tol : dtype == DType::kF16 ? kF16Tol : kBf16Tol;
}

constexpr double kInf = std::numeric_limits<double>::infinity();

template <typename T>
double RelativeError(const std::vector<T>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double max_err = 0.0, max_want = 0.0;
  for (size_t n = 0; n < got.size() && n < want.size(); ++n) {
    max_err = std::max(max_err, std::abs(static_cast<double>(got[n]) - want[n]));
    max_want = std::max(max_want, std::abs(want[n]));
  }
  return max_want == 0.0 ? max_err : max_err / max_want;
}

std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

const char* MaskName(MaskType mask) {
  switch (mask) {
    case MaskType::kNoMask: return "nomask";
    case MaskType::kPadding: return "padding";
    case MaskType::kCausal: return "causal";
    case MaskType::kPaddingCausal: return "paddingcausal";
    case MaskType::kCausalBottomRight: return "causalbottomright";
    case MaskType::kPaddingCausalBottomRight: return "paddingcausalbottomright";
  }
  return "?";
}

constexpr MaskType kAllMaskTypes[] = {MaskType::kNoMask,
                                      MaskType::kPadding,
                                      MaskType::kCausal,
                                      MaskType::kPaddingCausal,
                                      MaskType::kCausalBottomRight,
                                      MaskType::kPaddingCausalBottomRight};

// ---- the float64 reference ----------------------------------------------------

// One attention problem, in double. Tensors are laid out as the op's.
struct Problem {
  int B = 1, Sq = 1, Skv = 1, Hq = 1, Hkv = 1, D = 1;
  MaskType mask = MaskType::kNoMask;
  double scale = 1.0;
  double rate = 0.0;
  uint64_t seed = 0;
  std::vector<int> q_len, kv_len;  // used by the padding masks
  std::vector<double> q, k, v, bias;  // bias empty when absent
  // [B, Sq, Skv] (or [B, Hq, Sq, Skv] with per_head), true = masked; empty when absent.
  std::vector<char> element_masked;
  bool per_head = false;

  int64_t QIndex(int b, int i, int h, int d) const { return ((int64_t{b} * Sq + i) * Hq + h) * D + d; }
  int64_t KvIndex(int b, int j, int h, int d) const { return ((int64_t{b} * Skv + j) * Hkv + h) * D + d; }
  // TE's meaning of each mask type, written out: the lengths cut queries and
  // keys; the causal diagonal is j <= i top-left, and j <= i + (keys -
  // queries) bottom-right, with the per-batch lengths under padding.
  bool Visible(int b, int h, int i, int j) const {
    const bool padding = IsPaddingMask(mask);
    if (padding && (i >= q_len[b] || j >= kv_len[b])) return false;
    const int64_t plane = per_head ? int64_t{b} * Hq + h : b;
    if (!element_masked.empty() && element_masked[(plane * Sq + i) * Skv + j]) return false;
    if (!IsCausalMask(mask)) return true;
    int offset = 0;
    if (IsBottomRightMask(mask)) offset = padding ? kv_len[b] - q_len[b] : Skv - Sq;
    return j <= i + offset;
  }
};

// What the forward computes for each (b, h), kept for the backward.
struct Forward {
  std::vector<double> out, lse;
  // [B, Hq, Sq, Skv]: softmax probabilities and dropout multipliers.
  std::vector<double> probs, multiplier;
};

Forward ReferenceForward(const Problem& p) {
  Forward f;
  f.out.assign(p.q.size(), 0.0);
  f.lse.assign(static_cast<size_t>(p.B) * p.Hq * p.Sq, 0.0);
  f.probs.assign(static_cast<size_t>(p.B) * p.Hq * p.Sq * p.Skv, 0.0);
  f.multiplier = f.probs;
  const int group = p.Hq / p.Hkv;
  for (int b = 0; b < p.B; ++b) {
    for (int h = 0; h < p.Hq; ++h) {
      const int kvh = h / group;
      for (int i = 0; i < p.Sq; ++i) {
        const int64_t row = (int64_t{b} * p.Hq + h) * p.Sq + i;
        std::vector<double> logits(p.Skv, -kInf);
        double max_logit = -kInf;
        for (int j = 0; j < p.Skv; ++j) {
          if (!p.Visible(b, h, i, j)) continue;
          double dot = 0.0;
          for (int d = 0; d < p.D; ++d) dot += p.q[p.QIndex(b, i, h, d)] * p.k[p.KvIndex(b, j, kvh, d)];
          logits[j] = p.scale * dot;
          if (!p.bias.empty()) logits[j] += p.bias[(int64_t{h} * p.Sq + i) * p.Skv + j];
          max_logit = std::max(max_logit, logits[j]);
        }
        if (max_logit == -kInf) {  // no visible key: zeros, lse = +inf
          f.lse[row] = kInf;
          continue;
        }
        double sum = 0.0;
        for (int j = 0; j < p.Skv; ++j) sum += std::exp(logits[j] - max_logit);
        f.lse[row] = max_logit + std::log(sum);
        for (int j = 0; j < p.Skv; ++j) {
          const int64_t at = row * p.Skv + j;
          f.probs[at] = std::exp(logits[j] - f.lse[row]);
          const bool kept = DropoutUniform(p.seed, static_cast<uint64_t>(at)) >= p.rate;
          f.multiplier[at] = kept ? 1.0 / (1.0 - p.rate) : 0.0;
          for (int d = 0; d < p.D; ++d) {
            f.out[p.QIndex(b, i, h, d)] +=
                f.probs[at] * f.multiplier[at] * p.v[p.KvIndex(b, j, kvh, d)];
          }
        }
      }
    }
  }
  return f;
}

struct Grads {
  std::vector<double> dq, dk, dv, dbias;
};

Grads ReferenceBackward(const Problem& p, const std::vector<double>& dout) {
  const Forward f = ReferenceForward(p);
  Grads g;
  g.dq.assign(p.q.size(), 0.0);
  g.dk.assign(p.k.size(), 0.0);
  g.dv.assign(p.v.size(), 0.0);
  g.dbias.assign(p.bias.size(), 0.0);
  const int group = p.Hq / p.Hkv;
  for (int b = 0; b < p.B; ++b) {
    for (int h = 0; h < p.Hq; ++h) {
      const int kvh = h / group;
      for (int i = 0; i < p.Sq; ++i) {
        const int64_t row = (int64_t{b} * p.Hq + h) * p.Sq + i;
        std::vector<double> dprobs(p.Skv);  // d loss / d P (before dropout)
        double row_dot = 0.0;
        for (int j = 0; j < p.Skv; ++j) {
          const int64_t at = row * p.Skv + j;
          double dot = 0.0;
          for (int d = 0; d < p.D; ++d) {
            dot += dout[p.QIndex(b, i, h, d)] * p.v[p.KvIndex(b, j, kvh, d)];
            g.dv[p.KvIndex(b, j, kvh, d)] +=
                f.probs[at] * f.multiplier[at] * dout[p.QIndex(b, i, h, d)];
          }
          dprobs[j] = dot * f.multiplier[at];
          row_dot += f.probs[at] * dprobs[j];
        }
        for (int j = 0; j < p.Skv; ++j) {
          const double dlogit = f.probs[row * p.Skv + j] * (dprobs[j] - row_dot);
          if (!p.bias.empty()) g.dbias[(int64_t{h} * p.Sq + i) * p.Skv + j] += dlogit;
          for (int d = 0; d < p.D; ++d) {
            g.dq[p.QIndex(b, i, h, d)] += p.scale * dlogit * p.k[p.KvIndex(b, j, kvh, d)];
            g.dk[p.KvIndex(b, j, kvh, d)] += p.scale * dlogit * p.q[p.QIndex(b, i, h, d)];
          }
        }
      }
    }
  }
  return g;
}

double Loss(const Problem& p, const std::vector<double>& dout) {
  const Forward f = ReferenceForward(p);
  double loss = 0.0;
  for (size_t n = 0; n < f.out.size(); ++n) loss += f.out[n] * dout[n];
  return loss;
}

// d Loss / d x by central differences, for each element of *x (a member of p).
std::vector<double> FiniteDifferences(Problem p, std::vector<double> Problem::*x,
                                      const std::vector<double>& dout) {
  std::vector<double> grad((p.*x).size());
  for (size_t n = 0; n < grad.size(); ++n) {
    const double saved = (p.*x)[n];
    (p.*x)[n] = saved + kFdStep;
    const double up = Loss(p, dout);
    (p.*x)[n] = saved - kFdStep;
    const double down = Loss(p, dout);
    (p.*x)[n] = saved;
    grad[n] = (up - down) / (2 * kFdStep);
  }
  return grad;
}

// ---- running the op -------------------------------------------------------------

struct Case {
  int B, Sq, Skv, Hq, Hkv, D;
  MaskType mask;
  bool bias;
  float rate;
  DType dtype;
  bool elementwise = false;  // an arbitrary elementwise mask on top of the mask type
  bool per_head = false;     // that mask one plane per query head
};

std::string CaseName(const Case& c) {
  return "B" + std::to_string(c.B) + "_Sq" + std::to_string(c.Sq) + "_Skv" +
         std::to_string(c.Skv) + "_Hq" + std::to_string(c.Hq) + "_Hkv" + std::to_string(c.Hkv) +
         "_D" + std::to_string(c.D) + "_" + MaskName(c.mask) + (c.bias ? "_bias" : "") +
         (c.rate > 0 ? "_dropout" : "") + (c.elementwise ? "_elementwise" : "") +
         (c.per_head ? "_perhead" : "") + "_" +
         DTypeName(c.dtype);
}

std::vector<float> RandomValues(size_t n, float limit, std::mt19937* rng) {
  std::uniform_real_distribution<float> uniform(-limit, limit);
  std::vector<float> v(n);
  for (float& x : v) x = uniform(*rng);
  return v;
}

Tensor MakeTensor(CpuOps* ops, DType dtype, const Shape& shape, const std::vector<float>& values) {
  Tensor t = ops->Allocate(dtype, shape).value();
  FromFloatVector(values, &t);
  return t;
}

Tensor MakeLengths(CpuOps* ops, const std::vector<int>& lengths) {
  Tensor t = ops->Allocate(DType::kI32, {static_cast<int64_t>(lengths.size())}).value();
  for (size_t b = 0; b < lengths.size(); ++b) t.data_as<int32_t>()[b] = lengths[b];
  return t;
}

// The op's inputs (as tensors) and the same values, already rounded to their
// dtype, in a float64 Problem.
struct Inputs {
  Problem problem;
  AttentionArgs args;
  Tensor q, k, v, dout;
  std::vector<double> dout_values;
};

Inputs MakeInputs(CpuOps* ops, const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  Inputs s;
  Problem& p = s.problem;
  p.B = c.B, p.Sq = c.Sq, p.Skv = c.Skv, p.Hq = c.Hq, p.Hkv = c.Hkv, p.D = c.D;
  p.mask = c.mask;
  p.scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  p.rate = c.rate;
  p.seed = 0x5eed0000u + seed;
  // Batch 0 keeps every query but loses keys; the others lose queries.
  for (int b = 0; b < c.B; ++b) {
    p.q_len.push_back(b == 0 ? c.Sq : std::max(1, c.Sq - 2 - b));
    p.kv_len.push_back(b == 0 ? std::max(1, c.Skv - 3) : c.Skv - b % 2);
  }
  const Shape q_shape = {c.B, c.Sq, c.Hq, c.D}, kv_shape = {c.B, c.Skv, c.Hkv, c.D};
  s.q = MakeTensor(ops, c.dtype, q_shape, RandomValues(NumElements(q_shape), 2.0f, &rng));
  s.k = MakeTensor(ops, c.dtype, kv_shape, RandomValues(NumElements(kv_shape), 2.0f, &rng));
  s.v = MakeTensor(ops, c.dtype, kv_shape, RandomValues(NumElements(kv_shape), 1.0f, &rng));
  s.dout = MakeTensor(ops, c.dtype, q_shape, RandomValues(NumElements(q_shape), 1.0f, &rng));
  p.q = ToDouble(ToFloatVector(s.q));
  p.k = ToDouble(ToFloatVector(s.k));
  p.v = ToDouble(ToFloatVector(s.v));
  s.dout_values = ToDouble(ToFloatVector(s.dout));

  s.args.mask = c.mask;
  s.args.scale = static_cast<float>(p.scale);
  p.scale = s.args.scale;  // the reference uses the float the op gets
  s.args.dropout_rate = c.rate;
  s.args.dropout_seed = p.seed;
  if (IsPaddingMask(c.mask)) {
    s.args.q_seqlens = MakeLengths(ops, p.q_len);
    s.args.kv_seqlens = MakeLengths(ops, p.kv_len);
  }
  if (c.elementwise) {
    // About a third of the scores masked at random, and query row 1 of batch
    // 0 fully masked (it must output zeros with lse = +inf).
    std::bernoulli_distribution masked(0.35);
    const int planes = c.per_head ? c.B * c.Hq : c.B;
    p.per_head = c.per_head;
    p.element_masked.resize(static_cast<size_t>(planes) * c.Sq * c.Skv);
    for (size_t n = 0; n < p.element_masked.size(); ++n) {
      const bool full_row = c.Sq > 1 && static_cast<int64_t>(n) / c.Skv == 1;
      p.element_masked[n] = full_row || masked(rng);
    }
    const Shape mask_shape = c.per_head ? Shape{c.B, c.Hq, c.Sq, c.Skv} : Shape{c.B, c.Sq, c.Skv};
    s.args.elementwise_mask = ops->Allocate(DType::kBool, mask_shape).value();
    for (size_t n = 0; n < p.element_masked.size(); ++n) {
      s.args.elementwise_mask.data_as<bool>()[n] = p.element_masked[n] != 0;
    }
  }
  if (c.bias) {
    // A bf16 or f16 case takes the bias in its own dtype (a layer's bias, as
    // cuDNN reads it); float32 cases take it in float32.
    const Shape bias_shape = {c.Hq, c.Sq, c.Skv};
    s.args.bias = MakeTensor(ops, c.dtype, bias_shape,
                             RandomValues(NumElements(bias_shape), 1.0f, &rng));
    p.bias = ToDouble(ToFloatVector(s.args.bias));
  }
  return s;
}

struct OpResult {
  Tensor out, lse, dq, dk, dv, dbias;
};

OpResult RunOp(CpuOps* ops, const Inputs& s) {
  const Problem& p = s.problem;
  const DType dtype = s.q.dtype();
  OpResult r;
  r.out = ops->Allocate(dtype, s.q.shape()).value();
  r.lse = ops->Allocate(DType::kF32, {p.B, p.Hq, p.Sq}).value();
  EXPECT_TRUE(ops->AttentionForward(s.args, s.q, s.k, s.v, &r.out, &r.lse).ok());
  r.dq = ops->Allocate(dtype, s.q.shape()).value();
  r.dk = ops->Allocate(dtype, s.k.shape()).value();
  r.dv = ops->Allocate(dtype, s.v.shape()).value();
  if (s.args.bias.defined()) r.dbias = ops->Allocate(DType::kF32, s.args.bias.shape()).value();
  const absl::Status status = ops->AttentionBackward(s.args, s.q, s.k, s.v, r.out, s.dout,
                                                     r.lse, &r.dq, &r.dk, &r.dv, &r.dbias);
  EXPECT_TRUE(status.ok()) << status;
  return r;
}

// ---- the matrix: op x mask x bias x dropout x dtype x shape --------------------

class AttentionMatrixTest : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionMatrixTest, MatchesFloat64Reference) {
  const Case& c = GetParam();
  CpuOps ops;
  const Inputs s = MakeInputs(&ops, c, /*seed=*/c.Sq * 131 + c.D * 7 + static_cast<int>(c.mask));
  const OpResult r = RunOp(&ops, s);
  const Forward want = ReferenceForward(s.problem);
  const Grads want_grads = ReferenceBackward(s.problem, s.dout_values);

  EXPECT_LE(RelativeError(ToFloatVector(r.out), want.out), Tolerance(c.dtype)) << "out";
  // lse: +inf exactly where a row sees no key, else close.
  const std::vector<float> lse = ToFloatVector(r.lse);
  std::vector<float> finite_got;
  std::vector<double> finite_want;
  for (size_t n = 0; n < lse.size(); ++n) {
    if (std::isinf(want.lse[n])) {
      EXPECT_EQ(lse[n], std::numeric_limits<float>::infinity()) << "lse row " << n;
    } else {
      finite_got.push_back(lse[n]);
      finite_want.push_back(want.lse[n]);
    }
  }
  EXPECT_LE(RelativeError(finite_got, finite_want), kF32Tol) << "softmax_lse";
  EXPECT_LE(RelativeError(ToFloatVector(r.dq), want_grads.dq), Tolerance(c.dtype)) << "dq";
  EXPECT_LE(RelativeError(ToFloatVector(r.dk), want_grads.dk), Tolerance(c.dtype)) << "dk";
  EXPECT_LE(RelativeError(ToFloatVector(r.dv), want_grads.dv), Tolerance(c.dtype)) << "dv";
  if (c.bias) {
    EXPECT_LE(RelativeError(ToFloatVector(r.dbias), want_grads.dbias), kF32Tol) << "dbias";
  }
}

std::vector<Case> MatrixCases() {
  struct Dims { int B, Sq, Skv, Hq, Hkv, D; };
  const Dims shapes[] = {
      {2, 7, 7, 4, 2, 8},     // GQA, odd sequence
      {1, 13, 13, 2, 2, 16},  // MHA
      {2, 5, 9, 4, 1, 8},     // cross attention, MQA, Sq < Skv
      {3, 13, 7, 3, 3, 16},   // Sq > Skv, odd head count
  };
  std::vector<Case> cases;
  for (const Dims& d : shapes) {
    for (MaskType mask : kAllMaskTypes) {
      for (bool bias : {false, true}) {
        for (float rate : {0.0f, 0.3f}) {
          for (DType dtype : {DType::kF32, DType::kBF16}) {
            cases.push_back({d.B, d.Sq, d.Skv, d.Hq, d.Hkv, d.D, mask, bias, rate, dtype});
          }
        }
      }
    }
  }
  // An arbitrary elementwise mask under every mask type (TE's unfused softmax
  // applies the mask it is given elementwise).
  for (const Dims& d : shapes) {
    for (MaskType mask : kAllMaskTypes) {
      cases.push_back({d.B, d.Sq, d.Skv, d.Hq, d.Hkv, d.D, mask, true, 0.3f, DType::kF32, true});
      cases.push_back({d.B, d.Sq, d.Skv, d.Hq, d.Hkv, d.D, mask, false, 0.0f, DType::kBF16, true});
      // One mask plane per query head (TE's unfused softmax broadcasts a
      // [B, H, Sq, Skv] mask against the logits).
      cases.push_back(
          {d.B, d.Sq, d.Skv, d.Hq, d.Hkv, d.D, mask, true, 0.3f, DType::kF32, true, true});
    }
  }
  // Larger: many keys per row, longer dot products.
  cases.push_back({2, 48, 64, 8, 2, 64, MaskType::kPaddingCausal, true, 0.1f, DType::kF32});
  cases.push_back({2, 64, 64, 4, 4, 32, MaskType::kCausal, false, 0.0f, DType::kBF16});
  cases.push_back({1, 33, 65, 6, 3, 24, MaskType::kPadding, true, 0.2f, DType::kBF16});
  // float16 is accepted too.
  cases.push_back({2, 7, 7, 4, 2, 8, MaskType::kPaddingCausal, true, 0.3f, DType::kF16});
  cases.push_back({1, 13, 13, 2, 2, 16, MaskType::kNoMask, false, 0.0f, DType::kF16});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cpu, AttentionMatrixTest, ::testing::ValuesIn(MatrixCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return CaseName(info.param);
                         });

// ---- gradients against finite differences -----------------------------------------

class AttentionGradientTest : public ::testing::TestWithParam<MaskType> {};

TEST_P(AttentionGradientTest, MatchesFiniteDifferences) {
  const Case c = {2, 3, 4, 2, 1, 4, GetParam(), /*bias=*/true, /*rate=*/0.25f, DType::kF32};
  CpuOps ops;
  const Inputs s = MakeInputs(&ops, c, /*seed=*/17 + static_cast<int>(c.mask));
  const Grads analytic = ReferenceBackward(s.problem, s.dout_values);
  const OpResult r = RunOp(&ops, s);
  struct Wrt {
    const char* name;
    std::vector<double> Problem::*x;
    const std::vector<double>& analytic;
    const Tensor& op;
  };
  const Wrt wrts[] = {{"q", &Problem::q, analytic.dq, r.dq},
                      {"k", &Problem::k, analytic.dk, r.dk},
                      {"v", &Problem::v, analytic.dv, r.dv},
                      {"bias", &Problem::bias, analytic.dbias, r.dbias}};
  for (const Wrt& w : wrts) {
    const std::vector<double> numeric = FiniteDifferences(s.problem, w.x, s.dout_values);
    EXPECT_LE(RelativeError(w.analytic, numeric), kFdTol) << "reference d" << w.name;
    EXPECT_LE(RelativeError(ToFloatVector(w.op), numeric), kF32Tol) << "op d" << w.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, AttentionGradientTest,
                         ::testing::ValuesIn(kAllMaskTypes),
                         [](const ::testing::TestParamInfo<MaskType>& info) {
                           return std::string(MaskName(info.param));
                         });

// Masked scores get no gradient: the op's gradients under an elementwise mask
// equal finite differences of the float64 reference that drops those scores.
TEST(AttentionTest, ElementwiseMaskGradientsMatchFiniteDifferences) {
  const Case c = {2, 4, 5, 2, 1, 4, MaskType::kPadding, true, 0.25f, DType::kF32, true};
  CpuOps ops;
  const Inputs s = MakeInputs(&ops, c, /*seed=*/23);
  const OpResult r = RunOp(&ops, s);
  const std::pair<std::vector<double> Problem::*, const Tensor*> wrts[] = {
      {&Problem::q, &r.dq}, {&Problem::k, &r.dk}, {&Problem::v, &r.dv}, {&Problem::bias, &r.dbias}};
  for (const auto& w : wrts) {
    const std::vector<double> numeric = FiniteDifferences(s.problem, w.first, s.dout_values);
    EXPECT_LE(RelativeError(ToFloatVector(*w.second), numeric), kF32Tol);
  }
}

// The elementwise mask must be bool [B, Sq, Skv] or [B, Hq, Sq, Skv].
TEST(AttentionTest, RejectsElementwiseMaskOfWrongShapeOrDtype) {
  const Case c = {2, 4, 5, 2, 1, 4, MaskType::kNoMask, false, 0.0f, DType::kF32};
  CpuOps ops;
  Inputs s = MakeInputs(&ops, c, 5);
  Tensor out = ops.Allocate(DType::kF32, s.q.shape()).value();
  Tensor lse = ops.Allocate(DType::kF32, {2, 2, 4}).value();
  s.args.elementwise_mask = ops.Allocate(DType::kBool, {2, 4, 4}).value();
  absl::Status st = ops.AttentionForward(s.args, s.q, s.k, s.v, &out, &lse);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("elementwise_mask"), std::string::npos) << st;
  s.args.elementwise_mask = ops.Allocate(DType::kBool, {2, 1, 4, 5}).value();  // 1 of 2 heads
  st = ops.AttentionForward(s.args, s.q, s.k, s.v, &out, &lse);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("[2, 2, 4, 5]"), std::string::npos) << st;
  s.args.elementwise_mask = ops.Allocate(DType::kI32, {2, 4, 5}).value();
  st = ops.AttentionForward(s.args, s.q, s.k, s.v, &out, &lse);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
}

// Bottom-right is top-left where there are as many keys as queries (TE: "self
// attention with Sq == Skv"), and differs where there are not.
TEST(AttentionTest, BottomRightEqualsCausalOnlyForSquareScores) {
  CpuOps ops;
  for (const auto& [sq, skv, equal] : {std::tuple<int, int, bool>{6, 6, true},
                                       std::tuple<int, int, bool>{4, 9, false},
                                       std::tuple<int, int, bool>{9, 4, false}}) {
    Case c = {2, sq, skv, 2, 2, 8, MaskType::kCausal, false, 0.0f, DType::kF32};
    Inputs s = MakeInputs(&ops, c, 41);
    Tensor top_left = ops.Allocate(DType::kF32, s.q.shape()).value();
    Tensor bottom_right = ops.Allocate(DType::kF32, s.q.shape()).value();
    Tensor lse = ops.Allocate(DType::kF32, {2, 2, sq}).value();
    ASSERT_TRUE(ops.AttentionForward(s.args, s.q, s.k, s.v, &top_left, &lse).ok());
    s.args.mask = MaskType::kCausalBottomRight;
    ASSERT_TRUE(ops.AttentionForward(s.args, s.q, s.k, s.v, &bottom_right, &lse).ok());
    const std::vector<float> a = ToFloatVector(top_left), b = ToFloatVector(bottom_right);
    EXPECT_EQ(a == b, equal) << sq << " queries, " << skv << " keys";
  }
}

// ---- properties the reference cannot vouch for by itself -----------------------------

// GQA is MHA with each kv head repeated for its group of query heads; dk and dv
// are then the sums over the group.
TEST(AttentionTest, GqaEqualsMhaWithRepeatedKvHeads) {
  const Case c = {2, 9, 11, 6, 2, 8, MaskType::kCausal, true, 0.2f, DType::kF32};
  CpuOps ops;
  const Inputs gqa = MakeInputs(&ops, c, 99);
  const int group = c.Hq / c.Hkv;
  const Shape mha_shape = {c.B, c.Skv, c.Hq, c.D};
  std::vector<float> k_mha(NumElements(mha_shape)), v_mha(NumElements(mha_shape));
  for (int b = 0; b < c.B; ++b)
    for (int j = 0; j < c.Skv; ++j)
      for (int h = 0; h < c.Hq; ++h)
        for (int d = 0; d < c.D; ++d) {
          const int64_t to = ((int64_t{b} * c.Skv + j) * c.Hq + h) * c.D + d;
          const int64_t from = gqa.problem.KvIndex(b, j, h / group, d);
          k_mha[to] = static_cast<float>(gqa.problem.k[from]);
          v_mha[to] = static_cast<float>(gqa.problem.v[from]);
        }
  Inputs mha = gqa;
  mha.k = MakeTensor(&ops, DType::kF32, mha_shape, k_mha);
  mha.v = MakeTensor(&ops, DType::kF32, mha_shape, v_mha);
  mha.problem.Hkv = c.Hq;
  const OpResult r_gqa = RunOp(&ops, gqa);
  const OpResult r_mha = RunOp(&ops, mha);
  EXPECT_EQ(ToFloatVector(r_gqa.out), ToFloatVector(r_mha.out));
  EXPECT_EQ(ToFloatVector(r_gqa.lse), ToFloatVector(r_mha.lse));
  EXPECT_LE(RelativeError(ToFloatVector(r_gqa.dq), ToDouble(ToFloatVector(r_mha.dq))), kF32Tol);
  const std::vector<float> dk_mha = ToFloatVector(r_mha.dk), dv_mha = ToFloatVector(r_mha.dv);
  std::vector<double> dk_summed(gqa.problem.k.size()), dv_summed(gqa.problem.v.size());
  for (int b = 0; b < c.B; ++b)
    for (int j = 0; j < c.Skv; ++j)
      for (int h = 0; h < c.Hq; ++h)
        for (int d = 0; d < c.D; ++d) {
          const int64_t from = ((int64_t{b} * c.Skv + j) * c.Hq + h) * c.D + d;
          dk_summed[gqa.problem.KvIndex(b, j, h / group, d)] += dk_mha[from];
          dv_summed[gqa.problem.KvIndex(b, j, h / group, d)] += dv_mha[from];
        }
  EXPECT_LE(RelativeError(ToFloatVector(r_gqa.dk), dk_summed), kF32Tol);
  EXPECT_LE(RelativeError(ToFloatVector(r_gqa.dv), dv_summed), kF32Tol);
}

// Padded queries and rows with no visible key: zeros, lse = +inf, zero grads,
// and nothing leaks into the keys they cannot see.
TEST(AttentionTest, RowsWithoutKeysAreZeroWithInfiniteLse) {
  const Case c = {3, 5, 6, 2, 2, 8, MaskType::kPaddingCausal, true, 0.0f, DType::kBF16};
  CpuOps ops;
  Inputs s = MakeInputs(&ops, c, 5);
  s.problem.q_len = {5, 0, 3};
  s.problem.kv_len = {0, 6, 4};
  s.args.q_seqlens = MakeLengths(&ops, s.problem.q_len);
  s.args.kv_seqlens = MakeLengths(&ops, s.problem.kv_len);
  const OpResult r = RunOp(&ops, s);
  const std::vector<float> out = ToFloatVector(r.out), lse = ToFloatVector(r.lse);
  const std::vector<float> dq = ToFloatVector(r.dq), dk = ToFloatVector(r.dk);
  const std::vector<float> dv = ToFloatVector(r.dv);
  const Problem& p = s.problem;
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.Hq; ++h)
      for (int i = 0; i < c.Sq; ++i) {
        const bool sees_keys = i < p.q_len[b] && p.kv_len[b] > 0;
        const float row_lse = lse[(b * c.Hq + h) * c.Sq + i];
        if (sees_keys) {
          EXPECT_TRUE(std::isfinite(row_lse)) << b << " " << h << " " << i;
          continue;
        }
        EXPECT_EQ(row_lse, std::numeric_limits<float>::infinity()) << b << " " << h << " " << i;
        for (int d = 0; d < c.D; ++d) {
          EXPECT_EQ(out[p.QIndex(b, i, h, d)], 0.0f);
          EXPECT_EQ(dq[p.QIndex(b, i, h, d)], 0.0f);
        }
      }
  for (int b = 0; b < c.B; ++b)
    for (int j = p.kv_len[b]; j < c.Skv; ++j)
      for (int h = 0; h < c.Hkv; ++h)
        for (int d = 0; d < c.D; ++d) {
          EXPECT_EQ(dk[p.KvIndex(b, j, h, d)], 0.0f);
          EXPECT_EQ(dv[p.KvIndex(b, j, h, d)], 0.0f);
        }
  // And the visible part still matches the reference.
  EXPECT_LE(RelativeError(out, ReferenceForward(p).out), kBf16Tol);
}

// ---- packed qkv [B, S, 3, H, D] -----------------------------------------------

// qkv [B, S, 3, H, D] holding q, k, v [B, S, H, D] at index 0, 1, 2 of axis 2
// (their values are already in the dtype, so packing rounds nothing).
Tensor PackQkv(CpuOps* ops, const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t rows = q.dim(0) * q.dim(1), row = q.dim(2) * q.dim(3);
  const std::vector<float> parts[3] = {ToFloatVector(q), ToFloatVector(k), ToFloatVector(v)};
  std::vector<float> packed(static_cast<size_t>(3 * rows * row));
  for (int64_t r = 0; r < rows; ++r)
    for (int p = 0; p < 3; ++p)
      for (int64_t e = 0; e < row; ++e) packed[(r * 3 + p) * row + e] = parts[p][r * row + e];
  return MakeTensor(ops, q.dtype(), {q.dim(0), q.dim(1), 3, q.dim(2), q.dim(3)}, packed);
}

// Part p (0: q, 1: k, 2: v) of a packed [B, S, 3, H, D], as [B, S, H, D].
std::vector<float> Part(const Tensor& packed, int p) {
  const std::vector<float> all = ToFloatVector(packed);
  const int64_t rows = packed.dim(0) * packed.dim(1), row = packed.dim(3) * packed.dim(4);
  std::vector<float> part(static_cast<size_t>(rows * row));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < row; ++e) part[r * row + e] = all[(r * 3 + p) * row + e];
  return part;
}

// The packed ops against the unpacked ones on the same values: the default
// (what CpuOps runs) splits and calls them, so the results must be identical;
// a q/k/v mix-up in either direction, or dq/dk/dv stacked in the wrong slot,
// changes them. And both against the float64 reference.
class AttentionPackedTest : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionPackedTest, MatchesUnpackedOnTheParts) {
  const Case& c = GetParam();
  CpuOps ops;
  const Inputs s = MakeInputs(&ops, c, /*seed=*/c.Sq * 17 + static_cast<int>(c.mask) + 1);
  const OpResult want = RunOp(&ops, s);
  const Tensor qkv = PackQkv(&ops, s.q, s.k, s.v);
  ASSERT_EQ(Part(qkv, 1), ToFloatVector(s.k));

  Tensor out = ops.Allocate(c.dtype, s.q.shape()).value();
  Tensor lse = ops.Allocate(DType::kF32, {c.B, c.Hq, c.Sq}).value();
  const absl::Status forward = ops.AttentionForwardPacked(s.args, qkv, &out, &lse);
  ASSERT_TRUE(forward.ok()) << forward;
  EXPECT_EQ(ToFloatVector(out), ToFloatVector(want.out)) << "out";
  EXPECT_EQ(ToFloatVector(lse), ToFloatVector(want.lse)) << "softmax_lse";

  Tensor dqkv = ops.Allocate(c.dtype, qkv.shape()).value();
  Tensor dbias;
  if (c.bias) dbias = ops.Allocate(DType::kF32, s.args.bias.shape()).value();
  const absl::Status backward = ops.AttentionBackwardPacked(s.args, qkv, out, s.dout, lse, &dqkv,
                                                            c.bias ? &dbias : nullptr);
  ASSERT_TRUE(backward.ok()) << backward;
  EXPECT_EQ(Part(dqkv, 0), ToFloatVector(want.dq)) << "dq";
  EXPECT_EQ(Part(dqkv, 1), ToFloatVector(want.dk)) << "dk";
  EXPECT_EQ(Part(dqkv, 2), ToFloatVector(want.dv)) << "dv";
  if (c.bias) {
    EXPECT_EQ(ToFloatVector(dbias), ToFloatVector(want.dbias)) << "dbias";
  }

  const Forward reference = ReferenceForward(s.problem);
  const Grads reference_grads = ReferenceBackward(s.problem, s.dout_values);
  EXPECT_LE(RelativeError(ToFloatVector(out), reference.out), Tolerance(c.dtype)) << "out";
  EXPECT_LE(RelativeError(Part(dqkv, 0), reference_grads.dq), Tolerance(c.dtype)) << "dq";
  EXPECT_LE(RelativeError(Part(dqkv, 1), reference_grads.dk), Tolerance(c.dtype)) << "dk";
  EXPECT_LE(RelativeError(Part(dqkv, 2), reference_grads.dv), Tolerance(c.dtype)) << "dv";
}

std::vector<Case> PackedCases() {
  std::vector<Case> cases;
  for (MaskType mask : {MaskType::kNoMask, MaskType::kPadding, MaskType::kCausal,
                        MaskType::kPaddingCausal}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      cases.push_back({2, 7, 7, 3, 3, 8, mask, /*bias=*/true, /*rate=*/0.3f, dtype});
    }
  }
  cases.push_back({1, 13, 13, 2, 2, 16, MaskType::kCausal, false, 0.0f, DType::kBF16});
  cases.push_back({3, 5, 5, 1, 1, 4, MaskType::kPaddingCausal, false, 0.2f, DType::kF16});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cpu, AttentionPackedTest, ::testing::ValuesIn(PackedCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return CaseName(info.param);
                         });

TEST(AttentionTest, PackedRejectsBadQkvAndDqkv) {
  const Case c = {2, 4, 4, 2, 2, 8, MaskType::kCausal, false, 0.0f, DType::kF32};
  CpuOps ops;
  const Inputs s = MakeInputs(&ops, c, 7);
  const Tensor qkv = PackQkv(&ops, s.q, s.k, s.v);
  Tensor out = ops.Allocate(DType::kF32, s.q.shape()).value();
  Tensor lse = ops.Allocate(DType::kF32, {2, 2, 4}).value();
  ASSERT_TRUE(ops.AttentionForwardPacked(s.args, qkv, &out, &lse).ok());
  auto expect_invalid = [](const absl::Status& status, const char* name) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find(name), std::string::npos) << status;
  };
  for (const Shape& bad : {Shape{2, 4, 2, 2, 8}, Shape{2, 4, 6, 8}, Shape{2, 4, 2, 3, 2, 8}}) {
    const Tensor wrong = ops.Allocate(DType::kF32, bad).value();
    expect_invalid(ops.AttentionForwardPacked(s.args, wrong, &out, &lse), "qkv");
  }
  expect_invalid(ops.AttentionForwardPacked(s.args, ops.Allocate(DType::kE4M3, qkv.shape()).value(),
                                            &out, &lse),
                 "qkv");

  Tensor dqkv = ops.Allocate(DType::kF32, qkv.shape()).value();
  ASSERT_TRUE(
      ops.AttentionBackwardPacked(s.args, qkv, out, s.dout, lse, &dqkv, nullptr).ok());
  Tensor short_dqkv = ops.Allocate(DType::kF32, {2, 3, 3, 2, 8}).value();
  expect_invalid(ops.AttentionBackwardPacked(s.args, qkv, out, s.dout, lse, &short_dqkv, nullptr),
                 "dqkv");
  Tensor unpacked_dqkv = ops.Allocate(DType::kF32, {2, 4, 2, 3, 8}).value();
  expect_invalid(
      ops.AttentionBackwardPacked(s.args, qkv, out, s.dout, lse, &unpacked_dqkv, nullptr), "dqkv");
  Tensor bf16_dqkv = ops.Allocate(DType::kBF16, qkv.shape()).value();
  expect_invalid(ops.AttentionBackwardPacked(s.args, qkv, out, s.dout, lse, &bf16_dqkv, nullptr),
                 "dqkv");
}

// ---- argument errors ---------------------------------------------------------

// A bias named by its table (AttentionArgs::relative_bias) is the bias
// RelativeBiasForward makes from it: the same output, for rows at a device
// position and for rows past the buckets' (bias 0); and the arguments that
// cannot be one are refused, naming the field.
TEST(AttentionTest, RelativeBiasByItsTableIsTheBiasMade) {
  const Case c = {2, 1, 6, 4, 2, 8, MaskType::kNoMask, false, 0.0f, DType::kF32};
  CpuOps ops;
  const Inputs s = MakeInputs(&ops, c, 7);
  const int64_t num_buckets = 5, rows = 6;
  Tensor table = ops.Allocate(DType::kF32, {c.Hq, num_buckets}).value();
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  for (int64_t i = 0; i < table.numel(); ++i) table.data_as<float>()[i] = uniform(rng);
  Tensor buckets = ops.Allocate(DType::kI32, {rows, c.Skv}).value();
  for (int64_t i = 0; i < buckets.numel(); ++i) {
    buckets.data_as<int32_t>()[i] = static_cast<int32_t>((i * 7 + 3) % num_buckets);
  }
  Tensor position = ops.Allocate(DType::kI32, {1}).value();
  AttentionArgs by_table = s.args;
  by_table.bias = Tensor();
  by_table.relative_bias.table = table;
  by_table.relative_bias.buckets = buckets;
  by_table.relative_bias.first_row = position;
  for (const int32_t row : {0, 4, 6 /* past the buckets' rows */}) {
    SCOPED_TRACE(row);
    position.data_as<int32_t>()[0] = row;
    AttentionArgs made = by_table;
    made.relative_bias = AttentionArgs::RelativeBiasTable();
    made.bias = ops.Allocate(DType::kF32, {c.Hq, 1, c.Skv}).value();
    ASSERT_TRUE(ops.RelativeBiasForward(table, buckets, position, &made.bias).ok());
    Tensor out_table = ops.Allocate(DType::kF32, s.q.shape()).value();
    Tensor out_made = ops.Allocate(DType::kF32, s.q.shape()).value();
    Tensor lse_table = ops.Allocate(DType::kF32, {c.B, c.Hq, 1}).value();
    Tensor lse_made = ops.Allocate(DType::kF32, {c.B, c.Hq, 1}).value();
    ASSERT_TRUE(ops.AttentionForward(by_table, s.q, s.k, s.v, &out_table, &lse_table).ok());
    ASSERT_TRUE(ops.AttentionForward(made, s.q, s.k, s.v, &out_made, &lse_made).ok());
    for (int64_t i = 0; i < out_made.numel(); ++i) {
      ASSERT_EQ(out_table.data_as<float>()[i], out_made.data_as<float>()[i]) << i;
    }
    if (row == 6) {
      // Past the rows: no bias at all.
      AttentionArgs none = made;
      none.bias = Tensor();
      ASSERT_TRUE(ops.AttentionForward(none, s.q, s.k, s.v, &out_made, &lse_made).ok());
      for (int64_t i = 0; i < out_made.numel(); ++i) {
        ASSERT_EQ(out_table.data_as<float>()[i], out_made.data_as<float>()[i]) << i;
      }
    }
  }

  Tensor out = ops.Allocate(DType::kF32, s.q.shape()).value();
  Tensor lse = ops.Allocate(DType::kF32, {c.B, c.Hq, 1}).value();
  auto refused = [&](const AttentionArgs& args, const std::string& field) {
    const absl::Status status = ops.AttentionForward(args, s.q, s.k, s.v, &out, &lse);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(status.message().find(field), std::string::npos) << status;
  };
  const AttentionArgs& good = by_table;
  AttentionArgs both = good;
  both.bias = ops.Allocate(DType::kF32, {c.Hq, 1, c.Skv}).value();
  refused(both, "relative_bias");
  AttentionArgs wrong_heads = good;
  wrong_heads.relative_bias.table = ops.Allocate(DType::kF32, {num_buckets, c.Hq + 1}).value();
  refused(wrong_heads, "relative_bias.table");
  AttentionArgs wrong_keys = good;
  wrong_keys.relative_bias.buckets = ops.Allocate(DType::kI32, {rows, c.Skv + 1}).value();
  refused(wrong_keys, "relative_bias.buckets");
  AttentionArgs no_position = good;
  no_position.relative_bias.first_row = Tensor();  // then one bucket row per query row
  refused(no_position, "relative_bias.buckets");
  // A backward takes the bias made.
  Tensor dq = ops.Allocate(DType::kF32, s.q.shape()).value();
  Tensor dk = ops.Allocate(DType::kF32, s.k.shape()).value();
  Tensor dv = ops.Allocate(DType::kF32, s.v.shape()).value();
  const absl::Status backward =
      ops.AttentionBackward(good, s.q, s.k, s.v, out, s.dout, lse, &dq, &dk, &dv, nullptr);
  EXPECT_EQ(backward.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(backward.message().find("relative_bias"), std::string::npos) << backward;
}

TEST(AttentionTest, RejectsBadArguments) {
  const Case c = {2, 4, 4, 4, 2, 8, MaskType::kPadding, true, 0.0f, DType::kF32};
  CpuOps ops;
  const Inputs s = MakeInputs(&ops, c, 3);
  Tensor out = ops.Allocate(DType::kF32, s.q.shape()).value();
  Tensor lse = ops.Allocate(DType::kF32, {2, 4, 4}).value();
  auto forward = [&](const AttentionArgs& args, const Tensor& q, const Tensor& k, Tensor* o,
                     Tensor* l) { return ops.AttentionForward(args, q, k, s.v, o, l).code(); };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  ASSERT_EQ(forward(s.args, s.q, s.k, &out, &lse), absl::StatusCode::kOk);

  Tensor k3 = ops.Allocate(DType::kF32, {2, 4, 3, 8}).value();  // 4 heads % 3 != 0
  EXPECT_EQ(forward(s.args, s.q, k3, &out, &lse), kInvalid);
  AttentionArgs no_lengths = s.args;
  no_lengths.kv_seqlens = Tensor();
  EXPECT_EQ(forward(no_lengths, s.q, s.k, &out, &lse), kInvalid);
  AttentionArgs long_length = s.args;
  long_length.q_seqlens = MakeLengths(&ops, {4, 5});  // past Sq
  EXPECT_EQ(forward(long_length, s.q, s.k, &out, &lse), kInvalid);
  AttentionArgs bad_bias = s.args;
  bad_bias.bias = ops.Allocate(DType::kF32, {4, 4, 3}).value();
  EXPECT_EQ(forward(bad_bias, s.q, s.k, &out, &lse), kInvalid);
  AttentionArgs narrow_bias = s.args;  // neither float32 nor q's dtype (float32 here)
  narrow_bias.bias = ops.Allocate(DType::kBF16, s.args.bias.shape()).value();
  EXPECT_EQ(forward(narrow_bias, s.q, s.k, &out, &lse), kInvalid);
  AttentionArgs bad_rate = s.args;
  bad_rate.dropout_rate = 1.0f;
  EXPECT_EQ(forward(bad_rate, s.q, s.k, &out, &lse), kInvalid);
  Tensor lse_bf16 = ops.Allocate(DType::kBF16, {2, 4, 4}).value();
  EXPECT_EQ(forward(s.args, s.q, s.k, &out, &lse_bf16), kInvalid);
  Tensor q_fp8 = ops.Allocate(DType::kE4M3, s.q.shape()).value();
  EXPECT_EQ(forward(s.args, q_fp8, s.k, &out, &lse), kInvalid);
  Tensor out_short = ops.Allocate(DType::kF32, {2, 3, 4, 8}).value();
  EXPECT_EQ(forward(s.args, s.q, s.k, &out_short, &lse), kInvalid);

  // Backward: dbias is required with a bias, and shapes must match.
  Tensor dq = ops.Allocate(DType::kF32, s.q.shape()).value();
  Tensor dk = ops.Allocate(DType::kF32, s.k.shape()).value();
  Tensor dv = ops.Allocate(DType::kF32, s.v.shape()).value();
  EXPECT_EQ(ops.AttentionBackward(s.args, s.q, s.k, s.v, out, s.dout, lse, &dq, &dk, &dv,
                                  nullptr).code(),
            kInvalid);
  Tensor dbias = ops.Allocate(DType::kF32, s.args.bias.shape()).value();
  ASSERT_EQ(ops.AttentionBackward(s.args, s.q, s.k, s.v, out, s.dout, lse, &dq, &dk, &dv,
                                  &dbias).code(),
            absl::StatusCode::kOk);
  EXPECT_EQ(ops.AttentionBackward(s.args, s.q, s.k, s.v, out, s.dout, lse, &dk, &dk, &dv,
                                  &dbias).code(),
            kInvalid);
}

}  // namespace
}  // namespace te
