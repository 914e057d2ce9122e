// Attention masks through the C++ client library against the real te_server
// (CPU backend, float32), checked against a float64 softmax written here:
// TE's broadcasting of the mask against the logits [B, H, Sq, Skv] (a mask
// per head; dims of 1), the mask no_mask and causal ignore whatever its shape,
// and the bottom-right causal types (key j visible to query i iff
// j <= i + (Skv - Sq); per batch row with the actual lengths for
// padding_causal_bottom_right) in cross attention.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/modules.h"
#include "gtest/gtest.h"
#include "tests/integration/client_session_fixture.h"

namespace te::client {
namespace {

constexpr int64_t kB = 2, kHeads = 4, kD = 8;
constexpr double kF32Tolerance = 1e-5;

using Visible = std::function<bool(int64_t b, int64_t h, int64_t i, int64_t j)>;

// out [B, Sq, H, D] = softmax(q.k / sqrt(D) over the visible keys) v; rows
// that see nothing are zero.
std::vector<double> Reference(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                              const Visible& visible) {
  const int64_t sq = q.shape()[1], skv = k.shape()[1];
  const std::vector<float> qf = q.ToFloats(), kf = k.ToFloats(), vf = v.ToFloats();
  std::vector<double> out(qf.size(), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t i = 0; i < sq; ++i) {
        std::vector<double> logits(static_cast<size_t>(skv),
                                   -std::numeric_limits<double>::infinity());
        double top = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < skv; ++j) {
          if (!visible(b, h, i, j)) continue;
          double dot = 0.0;
          for (int64_t d = 0; d < kD; ++d) {
            dot += double{qf[((b * sq + i) * kHeads + h) * kD + d]} *
                   kf[((b * skv + j) * kHeads + h) * kD + d];
          }
          logits[j] = scale * dot;
          top = std::max(top, logits[j]);
        }
        if (top == -std::numeric_limits<double>::infinity()) continue;
        double sum = 0.0;
        for (double& l : logits) sum += (l = std::exp(l - top));
        for (int64_t j = 0; j < skv; ++j) {
          for (int64_t d = 0; d < kD; ++d) {
            out[((b * sq + i) * kHeads + h) * kD + d] +=
                logits[j] / sum * vf[((b * skv + j) * kHeads + h) * kD + d];
          }
        }
      }
    }
  }
  return out;
}

double RelativeError(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0.0, scale = 0.0;
  for (size_t n = 0; n < want.size() && n < got.size(); ++n) {
    err = std::max(err, std::abs(got[n] - want[n]));
    scale = std::max(scale, std::abs(want[n]));
  }
  return got.size() == want.size() ? err / std::max(scale, 1e-30)
                                   : std::numeric_limits<double>::infinity();
}

// A bool mask of `shape` (1 = masked out) from `masked(index)`.
HostTensor BoolMask(const Shape& shape, const std::function<bool(int64_t)>& masked) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  std::string bytes(static_cast<size_t>(count), 0);
  for (int64_t n = 0; n < count; ++n) bytes[n] = masked(n) ? 1 : 0;
  return HostTensor::FromBytes(DType::kBool, shape, bytes).value();
}

class ClientAttentionMaskTest : public testing::ClientSessionTest {
 protected:
  void Make(int64_t sq, int64_t skv) {
    q_ = HostTensor::RandomNormal({kB, sq, kHeads, kD}, DType::kF32, 1);
    k_ = HostTensor::RandomNormal({kB, skv, kHeads, kD}, DType::kF32, 2);
    v_ = HostTensor::RandomNormal({kB, skv, kHeads, kD}, DType::kF32, 3);
  }
  absl::StatusOr<HostTensor> Apply(const std::string& mask_type,
                                   const std::optional<HostTensor>& mask = std::nullopt) {
    DotProductAttention attention(kD, kHeads);
    attention.attn_mask_type = mask_type;
    absl::StatusOr<Variables> vars = attention.Init(*session_, 0, q_);
    if (!vars.ok()) return vars.status();
    ApplyOptions options;
    options.extra_inputs = {k_, v_};
    options.attention_mask = mask;
    return attention.Apply(*vars, q_, options);
  }
  std::vector<float> MustApply(const std::string& mask_type,
                               const std::optional<HostTensor>& mask = std::nullopt) {
    absl::StatusOr<HostTensor> y = Apply(mask_type, mask);
    EXPECT_TRUE(y.ok()) << mask_type << ": " << y.status();
    return y.ok() ? y->ToFloats() : std::vector<float>();
  }

  HostTensor q_, k_, v_;
};


// A [B, H, Sq, Skv] mask masks each head by its own plane; [B, 1, 1, Skv]
// broadcasts over heads and queries.
TEST_F(ClientAttentionMaskTest, PerHeadAndBroadcastMasks) {
  const int64_t s = 6;
  Make(s, s);
  const auto holes = [](int64_t n) { return n % (s * s) % s != 0 && (n * 7) % 5 < 2; };
  const HostTensor per_head = BoolMask({kB, kHeads, s, s}, holes);
  EXPECT_LT(RelativeError(MustApply("padding", per_head),
                          Reference(q_, k_, v_,
                                    [&](int64_t b, int64_t h, int64_t i, int64_t j) {
                                      return !holes(((b * kHeads + h) * s + i) * s + j);
                                    })),
            kF32Tolerance);
  const auto keys = [](int64_t n) { return n % s >= 4 - n / s; };  // batch 0: keys 4, 5; 1: 3..5
  EXPECT_LT(RelativeError(MustApply("padding", BoolMask({kB, 1, 1, s}, keys)),
                          Reference(q_, k_, v_,
                                    [&](int64_t b, int64_t, int64_t, int64_t j) {
                                      return !keys(b * s + j);
                                    })),
            kF32Tolerance);
}

// no_mask and causal ignore a mask TE could not broadcast; the types that read
// a mask refuse it with INVALID_ARGUMENT naming attention_mask.
TEST_F(ClientAttentionMaskTest, IgnoredMasksAreNotChecked) {
  Make(6, 6);
  const HostTensor odd = HostTensor::Full({3, 5}, DType::kF32, 1.0f);
  for (const char* type : {"no_mask", "causal"}) {
    EXPECT_EQ(MustApply(type, odd), MustApply(type)) << type;
  }
  for (const char* type : {"padding", "padding_causal", "padding_causal_bottom_right"}) {
    const absl::StatusOr<HostTensor> y = Apply(type, odd);
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument) << type << y.status();
    EXPECT_NE(y.status().message().find("attention_mask"), std::string::npos) << y.status();
  }
}

// Cross attention: the diagonal through the last key, not the first.
TEST_F(ClientAttentionMaskTest, BottomRightCausalInCrossAttention) {
  const int64_t sq = 4, skv = 9;
  Make(sq, skv);
  const std::vector<float> y = MustApply("causal_bottom_right");
  EXPECT_LT(RelativeError(y, Reference(q_, k_, v_,
                                       [&](int64_t, int64_t, int64_t i, int64_t j) {
                                         return j <= i + skv - sq;
                                       })),
            kF32Tolerance);
  EXPECT_GT(RelativeError(y, Reference(q_, k_, v_,
                                       [](int64_t, int64_t, int64_t i, int64_t j) {
                                         return j <= i;
                                       })),
            1e-3);
  // padding_causal_bottom_right: batch 1 has 2 queries and 5 keys.
  const auto padded = [&](int64_t b, int64_t i, int64_t j) {
    return b == 1 && (i >= 2 || j >= 5);
  };
  const HostTensor pad = BoolMask({kB, 1, sq, skv}, [&](int64_t n) {
    return padded(n / (sq * skv), n / skv % sq, n % skv);
  });
  EXPECT_LT(RelativeError(MustApply("padding_causal_bottom_right", pad),
                          Reference(q_, k_, v_,
                                    [&](int64_t b, int64_t, int64_t i, int64_t j) {
                                      const int64_t q_len = b == 1 ? 2 : sq;
                                      const int64_t kv_len = b == 1 ? 5 : skv;
                                      return !padded(b, i, j) && j <= i + kv_len - q_len;
                                    })),
            kF32Tolerance);
}

}  // namespace
}  // namespace te::client
