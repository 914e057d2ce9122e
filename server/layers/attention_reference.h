// Float64 references for the attention layer tests: written as directly as
// the math reads (TE's / Flax's definitions), independent of kernels/ops.h.
// Tensors are row-major std::vector<double>.
#ifndef TE_SERVER_LAYERS_ATTENTION_REFERENCE_H_
#define TE_SERVER_LAYERS_ATTENTION_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace te::layers::reference {

using Vec = std::vector<double>;

struct AttentionShape {
  int64_t batch = 0, q_len = 0, kv_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
};

// Whether key j is visible to query i of batch b, query head h.
using Visibility = std::function<bool(int64_t b, int64_t h, int64_t i, int64_t j)>;

// out [B, Sq, Hq, D] = softmax(scale q.k + bias over the visible keys) v,
// q [B, Sq, Hq, D], k, v [B, Skv, Hkv, D]; bias [Hq, Sq, Skv] or empty.
// A row with no visible key is zero.
inline Vec AttentionWhere(const AttentionShape& s, const Vec& q, const Vec& k, const Vec& v,
                          double scale, const Visibility& visible, const Vec& bias = {}) {
  Vec out(static_cast<size_t>(s.batch * s.q_len * s.q_heads * s.head_dim), 0.0);
  const int64_t group = s.q_heads / s.kv_heads;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.q_heads; ++h) {
      const int64_t kvh = h / group;
      for (int64_t i = 0; i < s.q_len; ++i) {
        std::vector<double> logits(static_cast<size_t>(s.kv_len),
                                   -std::numeric_limits<double>::infinity());
        double max_logit = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < s.kv_len; ++j) {
          if (!visible(b, h, i, j)) continue;
          double dot = 0.0;
          for (int64_t d = 0; d < s.head_dim; ++d) {
            dot += q[((b * s.q_len + i) * s.q_heads + h) * s.head_dim + d] *
                   k[((b * s.kv_len + j) * s.kv_heads + kvh) * s.head_dim + d];
          }
          logits[j] = scale * dot + (bias.empty() ? 0.0 : bias[(h * s.q_len + i) * s.kv_len + j]);
          max_logit = std::max(max_logit, logits[j]);
        }
        if (max_logit == -std::numeric_limits<double>::infinity()) continue;
        double sum = 0.0;
        for (double& l : logits) {
          l = std::exp(l - max_logit);
          sum += l;
        }
        for (int64_t j = 0; j < s.kv_len; ++j) {
          const double p = logits[j] / sum;
          if (p == 0.0) continue;
          for (int64_t d = 0; d < s.head_dim; ++d) {
            out[((b * s.q_len + i) * s.q_heads + h) * s.head_dim + d] +=
                p * v[((b * s.kv_len + j) * s.kv_heads + kvh) * s.head_dim + d];
          }
        }
      }
    }
  }
  return out;
}

// AttentionWhere with TE's padding and top-left causal masks: lengths [B] or
// empty; masked [B, Sq, Skv] (nonzero = masked out, TE's convention) or
// empty. A query past its length is zero.
inline Vec Attention(const AttentionShape& s, const Vec& q, const Vec& k, const Vec& v,
                     double scale, bool causal, const std::vector<int>& q_lens,
                     const std::vector<int>& kv_lens, const Vec& bias = {},
                     const std::vector<char>& masked = {}) {
  const Visibility visible = [&](int64_t b, int64_t, int64_t i, int64_t j) {
    if (!q_lens.empty() && i >= q_lens[b]) return false;
    if (!kv_lens.empty() && j >= kv_lens[b]) return false;
    if (causal && j > i) return false;
    return masked.empty() || !masked[(b * s.q_len + i) * s.kv_len + j];
  };
  return AttentionWhere(s, q, k, v, scale, visible, bias);
}

// y [N, M] = x [N, K] @ w [K, M] (+ bias [M]).
inline Vec Matmul(const Vec& x, const Vec& w, int64_t n, int64_t k, int64_t m,
                  const Vec& bias = {}) {
  Vec y(static_cast<size_t>(n * m), 0.0);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < m; ++c) {
      double acc = bias.empty() ? 0.0 : bias[c];
      for (int64_t i = 0; i < k; ++i) acc += x[r * k + i] * w[i * m + c];
      y[r * m + c] = acc;
    }
  }
  return y;
}

// LayerNorm / RMSNorm over rows of x [N, H].
inline Vec Norm(const Vec& x, int64_t n, int64_t h, const Vec& gamma, const Vec& beta, double eps,
                bool rms = false, bool zero_centered = false) {
  Vec y(x.size());
  for (int64_t r = 0; r < n; ++r) {
    double mean = 0.0, sq = 0.0;
    for (int64_t c = 0; c < h; ++c) mean += x[r * h + c];
    mean = rms ? 0.0 : mean / h;
    for (int64_t c = 0; c < h; ++c) sq += (x[r * h + c] - mean) * (x[r * h + c] - mean);
    const double rsigma = 1.0 / std::sqrt(sq / h + eps);
    for (int64_t c = 0; c < h; ++c) {
      const double g = zero_centered ? 1.0 + gamma[c] : gamma[c];
      y[r * h + c] = (x[r * h + c] - mean) * rsigma * g + (beta.empty() ? 0.0 : beta[c]);
    }
  }
  return y;
}

inline double Gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}
inline double Relu(double x) { return x > 0.0 ? x : 0.0; }

// TE's rotary_pos_emb, group method "consecutive": pairs (2i, 2i+1) of
// x [B, S, H, D] rotate by p / (min * (max/min)^(2i/D)).
inline Vec Rotary(const Vec& x, int64_t batch, int64_t seq, int64_t heads, int64_t dim,
                  double min_ts = 1.0, double max_ts = 10000.0) {
  Vec y(x.size());
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t p = 0; p < seq; ++p) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = ((b * seq + p) * heads + h) * dim;
        for (int64_t i = 0; i < dim / 2; ++i) {
          const double angle = p / (min_ts * std::pow(max_ts / min_ts, 2.0 * i / dim));
          const double a = x[base + 2 * i], c = x[base + 2 * i + 1];
          y[base + 2 * i] = a * std::cos(angle) - c * std::sin(angle);
          y[base + 2 * i + 1] = c * std::cos(angle) + a * std::sin(angle);
        }
      }
    }
  }
  return y;
}

// Elements [offset, offset + width) of every row of width `row` in x.
inline Vec Columns(const Vec& x, int64_t row, int64_t offset, int64_t width) {
  Vec y;
  for (size_t r = 0; r < x.size() / row; ++r) {
    y.insert(y.end(), x.begin() + r * row + offset, x.begin() + r * row + offset + width);
  }
  return y;
}

inline Vec Add(const Vec& a, const Vec& b) {
  Vec y(a.size());
  for (size_t i = 0; i < a.size(); ++i) y[i] = a[i] + b[i];
  return y;
}

// TE's MultiHeadAttention (self-attention) from its parameters, looked up by
// full name ("params/<scope>/qkv/kernel"); x [B, S, hidden]; `bias` [H, S, S]
// or empty; `lens` valid lengths or empty.
struct MhaShape {
  std::string scope;  // "" or "attention"
  int64_t batch = 0, seq = 0, hidden = 0;
  int heads = 0, groups = 0, head_dim = 0;
  bool bias = false, rotary = false, rms = false, zero_centered = false;
  bool input_layernorm = true, scale_logits = false, causal = true;
  double eps = 1e-6;
};
using VarLookup = std::function<Vec(const std::string&)>;

inline Vec MultiHeadAttention(const MhaShape& c, const VarLookup& var, const Vec& x,
                              const std::vector<int>& lens, const Vec& attention_bias = {}) {
  const int64_t n = c.batch * c.seq, hd = c.heads * c.head_dim, gd = c.groups * c.head_dim;
  const bool gqa = c.heads != c.groups;
  const std::string p = c.scope.empty() ? "params/" : "params/" + c.scope + "/";
  const std::string norm_scope = p + (gqa ? "query" : "qkv");
  Vec ln = x;
  if (c.input_layernorm) {
    ln = Norm(x, n, c.hidden, var(norm_scope + "/scale"),
              c.rms ? Vec() : var(norm_scope + "/ln_bias"), c.eps, c.rms, c.zero_centered);
  }
  Vec q, k, v;
  if (!gqa) {
    const Vec qkv = Matmul(ln, var(p + "qkv/kernel"), n, c.hidden, 3 * hd,
                           c.bias ? var(p + "qkv/bias") : Vec());
    q = Columns(qkv, 3 * hd, 0, hd);
    k = Columns(qkv, 3 * hd, hd, hd);
    v = Columns(qkv, 3 * hd, 2 * hd, hd);
  } else {
    q = Matmul(ln, var(p + "query/kernel"), n, c.hidden, hd,
               c.bias ? var(p + "query/bias") : Vec());
    const Vec kv =
        Matmul(ln, var(p + "kv/kernel"), n, c.hidden, 2 * gd, c.bias ? var(p + "kv/bias") : Vec());
    k = Columns(kv, 2 * gd, 0, gd);
    v = Columns(kv, 2 * gd, gd, gd);
  }
  if (c.rotary) {
    q = Rotary(q, c.batch, c.seq, c.heads, c.head_dim);
    k = Rotary(k, c.batch, c.seq, c.groups, c.head_dim);
  }
  const Vec ctx = Attention({c.batch, c.seq, c.seq, c.heads, c.groups, c.head_dim}, q, k, v,
                            c.scale_logits ? 1.0 / std::sqrt(static_cast<double>(c.head_dim)) : 1.0,
                            c.causal, lens, lens, attention_bias);
  return Matmul(ctx, var(p + "out/kernel"), n, hd, c.hidden, c.bias ? var(p + "out/bias") : Vec());
}

inline double RelativeError(const Vec& out, const Vec& ref) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

}  // namespace te::layers::reference

#endif  // TE_SERVER_LAYERS_ATTENTION_REFERENCE_H_
