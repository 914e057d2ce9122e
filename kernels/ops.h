// The op interface: every computation a layer needs, backend-neutral.
//
// Layers (server/layers) are written once against `Ops`; two backends implement
// it: kernels/cpu (the reference: float32 accumulation, exact bf16/FP8 rounding)
// and kernels/cuda (CUDA kernels, cuBLASLt, cuDNN). An `Ops` object is one
// ordered stream of work on one device (a CUDA stream; the calling thread on
// the CPU) with its own memory account. It is not thread-safe: a session owns
// one and calls it from one thread at a time.
//
// Conventions, for every op:
//  * Tensors are row-major. "[N, H]" means N rows of H. All inputs and outputs
//    live on this Ops' device; outputs are allocated by the caller with the
//    shape stated, and their dtype chooses the output format.
//  * "float" dtypes are f32, bf16 and f16: inputs are read as float32,
//    arithmetic accumulates in float32, and each output element is rounded once
//    (round to nearest even) to its dtype.
//  * An output may be FP8 only where the op takes an `Fp8Output`: the value v is
//    written as cast_fp8(v * scale) (nearest even, saturating to the format's
//    max), amax = max |v| over the whole output is written to `amax`, and
//    1/scale to `scale_inv`. This is TE's fused "op + quantize + amax".
//  * Errors: INVALID_ARGUMENT for shapes/dtypes that do not fit the op (the
//    message names the argument), RESOURCE_EXHAUSTED when memory is over the
//    account's limit, INTERNAL for a device/library failure. Ops are
//    asynchronous on a GPU: a later op or Synchronize() may report a failure.
#ifndef TE_KERNELS_OPS_H_
#define TE_KERNELS_OPS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace te {

// Where an op's FP8 output puts its scaling side outputs. All [1] float32, on
// device. `amax` usually aliases row 0 of a quantizer's amax_history; left
// undefined, no amax is recorded (a step whose amaxes nobody reads back, as
// a generation's: no zeroing, no atomics).
struct Fp8Output {
  Tensor scale;      // input: multiply before the cast
  Tensor amax;       // output: max |v| before scaling; undefined: not recorded
  Tensor scale_inv;  // output: 1 / scale, for the consumer to dequantize
};

enum class NormType { kLayerNorm, kRMSNorm };

struct NormArgs {
  NormType type = NormType::kLayerNorm;
  float epsilon = 1e-6f;
  // TE: y = xhat * (1 + gamma) + beta; gamma is stored centred on zero.
  bool zero_centered_gamma = false;
};

// TE JAX activation names. A layer's activation list has one entry, or two for
// the gated pairs: for x = [x_0 | x_1] (each [N, I]), y = act_0(x_0) * act_1(x_1).
enum class Activation { kGelu, kSilu, kRelu, kQuickGelu, kSquaredRelu, kLinear };
// gelu: tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)));
// silu: x sigmoid(x); quick_gelu: x sigmoid(1.702 x); squared_relu: relu(x)^2.

// TE's AttnMaskType. Causal types mask key j for query i unless
// j <= i + offset: offset 0 for the top-left aligned types (causal,
// padding_causal); for the bottom-right aligned ones the key count minus the
// query count, Skv - Sq (causal_bottom_right) or kv_seqlens[b] - q_seqlens[b]
// (padding_causal_bottom_right: TE's per-batch actual lengths), so that the
// last valid query sees every valid key. With Sq == Skv, causal_bottom_right
// is causal.
enum class MaskType {
  kNoMask,
  kPadding,
  kCausal,
  kPaddingCausal,
  kCausalBottomRight,
  kPaddingCausalBottomRight,
};
// The types that read q_seqlens / kv_seqlens.
inline bool IsPaddingMask(MaskType m) {
  return m == MaskType::kPadding || m == MaskType::kPaddingCausal ||
         m == MaskType::kPaddingCausalBottomRight;
}
inline bool IsCausalMask(MaskType m) {
  return m == MaskType::kCausal || m == MaskType::kPaddingCausal ||
         m == MaskType::kCausalBottomRight || m == MaskType::kPaddingCausalBottomRight;
}
inline bool IsBottomRightMask(MaskType m) {
  return m == MaskType::kCausalBottomRight || m == MaskType::kPaddingCausalBottomRight;
}

struct AttentionArgs {
  MaskType mask = MaskType::kNoMask;
  float scale = 1.0f;  // logits = scale * q.k (TE: 1/sqrt(head_dim) by default)
  float dropout_rate = 0.0f;  // on the softmax probabilities, inverted
  uint64_t dropout_seed = 0;
  // Padding masks: valid lengths, int32 [B]. Query rows at or past q_seqlens[b]
  // produce zeros; keys at or past kv_seqlens[b] are masked. Undefined otherwise.
  Tensor q_seqlens;
  Tensor kv_seqlens;
  // Optional additive bias on the logits (after scaling), [H, Sq, Skv], shared
  // over the batch (T5 relative position bias): float32, or the operands'
  // dtype, which a backend that adds the bias in that dtype (cuDNN) reads
  // without a cast.
  Tensor bias;
  // Optional, instead of `bias`: the T5 relative bias named by its table, the
  // bias RelativeBiasForward(table, buckets, first_row) would make (a decode
  // step's rows at a position that lives on the device). The forwards and,
  // without first_row, the relative backwards (AttentionBackward[Packed]
  // Relative) take it. A backend may apply each logit's bias by its
  // distance rather than make [H, Sq, Skv] (CUDA: the one-row decode kernel,
  // and the far/band split of a causal self-attention,
  // kernels/cuda/relative_band_split.cu); the others make it
  // (WithRelativeBiasMade) and add it as `bias`.
  struct RelativeBiasTable {
    Tensor table;      // [Hq, NB] (TE's layout), float32 or q's dtype
    Tensor buckets;    // int32 [R, Skv]
    Tensor first_row;  // int32, one element on the device; undefined: 0 (then R == Sq)
    // As RelativeBuckets::uniform_from (0: not stated): where the buckets
    // settle, which lets a backend split a causal self-attention into a
    // bias-free far part and a band of that many diagonals.
    int64_t uniform_from = 0;
    bool defined() const { return table.defined(); }
  } relative_bias;
  // Optional elementwise mask, true = masked out (TE's convention): bool
  // [B, Sq, Skv], shared over the heads, or [B, Hq, Sq, Skv], one plane per
  // query head: an arbitrary mask as TE's unfused softmax applies it (it
  // broadcasts the mask against the logits [B, Hq, Sq, Skv]). It masks in
  // addition to `mask` (its causality and lengths): key j is visible to
  // query i iff both allow it.
  Tensor elementwise_mask;
  // No backward will read this forward (inference, a decode step): a backend
  // may take a path whose backward it could not run.
  bool forward_only = false;
};
// A query row with no visible key outputs 0.

class Ops;
// `args` with its relative_bias made into `bias` (RelativeBiasForward, [Hq,
// Sq, Skv], in q's dtype where that is bf16 or f16, as cuDNN adds it and as
// the band kernels round it, else float32); `args` itself where it has none.
absl::StatusOr<AttentionArgs> WithRelativeBiasMade(Ops& ops, const AttentionArgs& args,
                                                   int64_t q_seq, DType q_dtype);
// The same for a relative backward, Sq from q [B, Sq, ...] (or a packed qkv
// [B, S, 3, H, D]); INVALID_ARGUMENT naming `op` for a decode step's
// first_row.
absl::StatusOr<AttentionArgs> WithRelativeBiasMadeForBackward(Ops& ops, const AttentionArgs& args,
                                                              const Tensor& q, const char* op);

// A T5 relative-position bias named by its table: the bias an AttentionArgs
// carries is RelativeBiasForward(table, buckets), and its gradient is wanted
// as the table's, dtable [H, NB], not as dbias [H, Sq, Skv].
struct RelativeBuckets {
  Tensor buckets;  // int32 [Sq, Skv], RelativeBiasForward's
  // > 0: every visible key at least this many positions before its query has
  // one bucket (causal T5 buckets saturate near max_distance); 0: not stated.
  // With a causal mask it lets a backend reduce dtable from the first
  // `uniform_from` diagonals alone: each row's logit gradients sum to zero,
  // so the far bucket's share is minus the band's.
  int64_t uniform_from = 0;
};


// ---- jax.numpy's elementwise ops, reductions and softmax (Ops::Binary ...) ----
// Broadcasting, numpy's: an operand of shape s fits an output of shape y when
// rank(s) <= rank(y) and, aligned from the right, each dim of s is y's or 1
// (repeated along that dim). At most kBroadcastMaxRank dims (after the
// backends merge neighbouring dims that broadcast alike).
inline constexpr int kBroadcastMaxRank = 8;

// Binary's operations. Arithmetic in float32; comparisons give bool.
enum class BinaryOp {
  kAdd,
  kSubtract,
  kMultiply,
  kDivide,
  kMaximum,  // NaN if either is NaN (jnp.maximum)
  kMinimum,
  kPower,    // powf(a, b)
  kGreater,
  kGreaterEqual,
  kLess,
  kLessEqual,
  kEqual,
  kNotEqual,
};
inline bool IsComparison(BinaryOp op) { return op >= BinaryOp::kGreater; }

// One operand may be a constant instead of a tensor: then b is not read and
// y = op(a, scalar), or op(scalar, a) when scalar_first.
struct BinaryArgs {
  BinaryOp op = BinaryOp::kAdd;
  bool has_scalar = false;
  float scalar = 0.0f;
  bool scalar_first = false;
};

// Unary's operations, with the derivatives UnaryBackward uses (JAX's):
//   negative -1; exp e^x; log 1/x; tanh 1 - tanh^2; sqrt 0.5/sqrt(x);
//   rsqrt -0.5 x^-1.5; abs sign(x) (0 at 0); square 2x; sigmoid s(1 - s);
//   relu 1 where x > 0 (0 at 0); silu s (1 + x (1 - s)); gelu the tanh
//   approximation (Activation's); gelu_exact 0.5 x (1 + erf(x / sqrt 2)),
//   derivative Phi(x) + x phi(x). logical_not: bool -> bool, no derivative.
enum class UnaryOp {
  kNegative,
  kExp,
  kLog,
  kTanh,
  kSqrt,
  kRsqrt,
  kAbs,
  kSquare,
  kSigmoid,
  kRelu,
  kSilu,
  kGelu,
  kGeluExact,
  kLogicalNot,
};

// jnp.where(cond, x, y) with x or y a constant where has_*_scalar.
struct WhereArgs {
  bool has_x_scalar = false;
  float x_scalar = 0.0f;
  bool has_y_scalar = false;
  float y_scalar = 0.0f;
};

enum class ReduceOp { kSum, kMean, kMax, kMin };

// Block-scaled formats, emulated (quantize-dequantize) where not native.
enum class BlockFormat {
  kMXFP8,  // E4M3 values, 1x32 blocks, E8M0 block scales 2^ceil(log2(amax/448)) (TE)
  kNVFP4,  // E2M1 values, 1x16 blocks, E4M3 block scales + one f32 global scale
};

struct DelayedScalingArgs {
  float fp8_max = 448.0f;
  float margin = 0.0f;
  bool most_recent = false;  // amax_compute_algo "most_recent" (else "max")
};

struct RotaryArgs {
  float min_timescale = 1.0f;  // TE JAX rotary_pos_emb_windows
  float max_timescale = 10000.0f;
  // As TE JAX's rotary_pos_emb_group_method: "consecutive" rotates adjacent
  // pairs (x[2i], x[2i+1]); "alternate" rotates halves (x[i], x[i + D/2]).
  bool consecutive = true;
  bool inverse = false;  // rotate by -angle: the backward of the forward
  // The position of x's first row along S (>= 0): a decode step rotates its
  // one new token at the token's place in the sequence, not at 0.
  int64_t position_offset = 0;
  // Optional: an int32 tensor of one element on the op's device, added to
  // position_offset when the kernels run. A decode step's position lives on
  // the device, so the same launches serve every position (a replayed step).
  Tensor position;
  // Optional, not with `position`: these args' cos and sin for the S rows,
  // float32 [2, S, D/2] (cos, then sin, at [s * D/2 + i]), as
  // Ops::RotaryTable(args, S, D) makes them. The ops read it instead of
  // making their own: a layer that rotates the same positions at every step
  // keeps one (DeviceConstants) and launches nothing for its angles.
  Tensor table;
};
// Position p = position_offset + s (s 0-based along S), frequency index i in
// [0, D/2):
//   timescale_i = min * (max/min)^(2i/D); angle = p / timescale_i
//   (a, b) -> (a cos - b sin, b cos + a sin)

// One step of an optax optimizer for one parameter tensor (OptimizerUpdate).
// The host evaluates the step's scalars (the learning-rate schedule at the
// step count, Adam's bias corrections) in float64 and passes them rounded to
// float32; the kernels do the elementwise rest.
struct OptimizerUpdateArgs {
  enum class Rule {
    kSgd,   // optax.sgd: optax.trace(momentum, nesterov) when mu is given
    kAdam,  // optax.scale_by_adam; with weight_decay, optax.adamw
  };
  Rule rule = Rule::kSgd;
  float learning_rate = 0.0f;  // the schedule's value at this step
  float momentum = 0.0f;       // sgd with a trace
  bool nesterov = false;
  float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, eps_root = 0.0f;
  float bias_correction1 = 1.0f;  // 1 - b1^t, t = the step count after this step
  float bias_correction2 = 1.0f;  // 1 - b2^t
  float weight_decay = 0.0f;      // optax.add_decayed_weights (adamw's decoupled decay)
  float max_norm = 0.0f;          // optax.clip_by_global_norm; 0: no clipping
};

// ---- the multi-tensor step (OptimizerStep) -----------------------------------
// What stays fixed over a training run's steps; the step's scalars are
// evaluated from the count on the device (kernels/optimizer_math.h defines
// them, once, for both backends and the server).

// optax's learning-rate schedules as data: a small tree of nodes in fixed
// arrays (kernel arguments, no pointers), one table per optimizer, shared by
// its links. LearningRateAt(table, node, count) evaluates one node.
inline constexpr int kMaxScheduleNodes = 16;
inline constexpr int kMaxScheduleKnots = 32;
struct ScheduleNode {
  enum class Kind : int32_t {
    kConstant,          // init_value
    kPolynomial,        // optax.polynomial_schedule (linear_schedule: power 1):
                        //   init_value, end_value, power, steps, begin
    kCosineDecay,       // optax.cosine_decay_schedule: init_value, steps
                        //   (decay_steps > 0), alpha, power (its exponent)
    kExponentialDecay,  // optax.exponential_decay: init_value, steps, rate,
                        //   begin, staircase, end_value when has_end
    kPiecewiseConstant, // optax.piecewise_constant_schedule: init_value times
                        //   knots[first, first + num).scale from each .step
                        //   on (sorted by step)
    kJoin,              // optax.join_schedules: knots[first + i].node from
                        //   knots[first + i].step on (i > 0; knot 0's step
                        //   unused), counting its steps from there
  };
  Kind kind = Kind::kConstant;
  int32_t first = 0, num = 0;  // knots
  int32_t staircase = 0, has_end = 0;
  double init_value = 0.0, end_value = 0.0, power = 1.0, alpha = 0.0, rate = 1.0;
  int64_t steps = 0, begin = 0;
};
struct ScheduleKnot {
  int64_t step = 0;
  double scale = 1.0;  // kPiecewiseConstant
  int32_t node = 0;    // kJoin
  int32_t unused = 0;
};
struct ScheduleTable {
  int32_t num_nodes = 0, num_knots = 0;
  ScheduleNode nodes[kMaxScheduleNodes];
  ScheduleKnot knots[kMaxScheduleKnots];
  // Appends a node (its index), or -1 when the table is full.
  int32_t Add(const ScheduleNode& node) {
    if (num_nodes == kMaxScheduleNodes) return -1;
    nodes[num_nodes] = node;
    return num_nodes++;
  }
  int32_t AddConstant(double value) {
    ScheduleNode node;
    node.init_value = value;
    return Add(node);
  }
};

// One link of an optax.chain as the device runs it: optax's primitive
// transformations, each turning the update u (the gradient before the first
// link) into the next one, elementwise except clip_by_global_norm (a norm over
// every slot's u at that point). The optimizers are chains of these as optax
// defines them (sgd: trace?, scale_by_learning_rate; adamw: scale_by_adam,
// add_decayed_weights, scale_by_learning_rate; rmsprop: scale_by_rms or
// scale_by_stddev, scale_by_learning_rate, trace?; lion: scale_by_lion,
// add_decayed_weights, scale_by_learning_rate).
inline constexpr int kMaxOptimizerLinks = 16;
inline constexpr int kMaxSlotState = 8;  // state tensors per slot over all links
struct OptimizerLink {
  enum class Kind : int32_t {
    kTrace,                // optax.trace(decay=b1, nesterov=flag); state: trace
    kScaleByAdam,          // b1, b2, eps, eps_root; state: mu, nu
    kScaleByRms,           // decay=b2, eps, eps_in_sqrt=flag; state: nu
    kScaleByStddev,        // decay=b2, eps, eps_in_sqrt=flag; state: mu, nu
    kScaleByLion,          // b1, b2 (u = sign((1-b1) u + b1 mu)); state: mu
    kClipByGlobalNorm,     // max_norm=value
    kClip,                 // max_delta=value (elementwise)
    kScale,                // step_size=value
    kAddDecayedWeights,    // weight_decay=value (u += value * param)
    kScaleByLearningRate,  // u *= -LearningRateAt(schedule, count)
  };
  Kind kind = Kind::kScale;
  int32_t state = 0;      // its first state tensor in OptimizerSlot::state
  int32_t schedule = -1;  // kScaleByLearningRate: its node in the table
  int32_t flag = 0;
  double b1 = 0.0, b2 = 0.0, eps = 0.0, eps_root = 0.0, value = 0.0;
};

struct OptimizerHyperparams {
  // The fused rules (num_links == 0): clip_by_global_norm(max_norm) when
  // max_norm > 0, then OptimizerUpdate's rule.
  OptimizerUpdateArgs::Rule rule = OptimizerUpdateArgs::Rule::kSgd;
  double momentum = 0.0;  // sgd with a trace when the slots have mu
  bool nesterov = false;
  double b1 = 0.9, b2 = 0.999, eps = 1e-8, eps_root = 0.0;
  double weight_decay = 0.0;
  double max_norm = 0.0;  // 0: no clipping
  ScheduleTable schedules;
  // The rule's learning rate (a node of `schedules`), and the one the step
  // reports (OptimizerStepInfo) either way; -1: 0.
  int32_t learning_rate = -1;
  // A chain (num_links > 0) instead of the rule: links[0, num_links) in
  // order, then param += u. Each slot keeps num_state state tensors
  // (OptimizerSlot::state) and no mu or nu.
  int32_t num_links = 0;
  int32_t num_state = 0;
  OptimizerLink links[kMaxOptimizerLinks];
};
// An FP8 copy of a slot's param that the step writes as it writes the
// param: the weight of an FP8 GEMM in the two layouts Hopper's GEMMs take it,
// as Ops::QuantizeTransposeKept keeps it across steps. Under DelayedScaling
// the scale the next forward quantizes with is known before the update (the
// step's scaling update made it), so the update can write the copy from the
// new weight it holds in registers, and the next forward finds it current
// instead of reading the whole weight again.
struct OptimizerFp8Copy {
  Tensor data;        // [rows, cols] E4M3 or E5M2: the param's elements in order
  Tensor data_t;      // [cols, rows], data's dtype: data transposed
  Tensor scale_inv;   // [1] f32
  Tensor kept_scale;  // [1] f32: QuantizeTransposeKept's kept.scale for data
  Tensor kept_amax;   // [1] f32: its kept.amax
  // [1] f32: the quantizer's scale, read on the device by each step. Not part
  // of the plan: like a gradient it may be another tensor every step.
  Tensor scale;
};
// One parameter of a multi-tensor step: as OptimizerUpdate's param, mu, nu
// (mu and nu undefined where the rule keeps none), and optionally the FP8
// copy of param the step keeps current (fp8.data undefined: none). Under a
// chain, `state` holds the links' per-parameter state instead of mu and nu
// (OptimizerHyperparams::num_state tensors in the param's dtype and shape).
// compute_copy (undefined: none) is the param cast to the dtype its GEMMs
// compute in (bf16 or f16, any shape of the param's element count), as
// Ops::CastKept keeps it across a training session's steps: the step writes
// it from the new param as it writes the param, so the next forward reads
// it instead of casting every weight again.
struct OptimizerSlot {
  Tensor param, mu, nu;
  OptimizerFp8Copy fp8;
  std::vector<Tensor> state;
  Tensor compute_copy;
};
// What one step did, written on the device by the step itself (so the host
// reads it with the step's other results, never in between).
struct OptimizerStepInfo {
  double learning_rate = 0.0;  // the schedule at the count before the step
  float grad_norm_sq = 0.0f;   // optax.global_norm squared, float32
  int32_t applied = 0;         // 0 when grad_norm_sq was inf or NaN (skipped)
  int32_t count = 0;           // opt_state/count after the step
  int32_t total_notfinite = 0; // opt_state/total_notfinite after the step
};
static_assert(sizeof(OptimizerStepInfo) == 24, "OptimizerStepInfo is read as 6 int32 words");

// The device-side layout of one multi-tensor step (the slots' pointers and
// sizes, the work split, the norm's partial sums, the step's decision and
// OptimizerStepInfo), made once by Ops::NewOptimizerPlan for a set of slots
// and reused by every OptimizerStep over the same tensors. It keeps no
// reference to them: Matches() says whether they are still the ones planned.
class OptimizerPlan {
 public:
  virtual ~OptimizerPlan() = default;
  // True when `slots`, `count` and `total_notfinite` are the planned tensors
  // (the same memory, element counts and dtypes, in the same order; an FP8
  // copy's scale is not planned).
  bool Matches(const std::vector<OptimizerSlot>& slots, const Tensor& count,
               const Tensor& total_notfinite) const;
  // The last step's OptimizerStepInfo: int32 [6] on the device.
  const Tensor& info() const { return info_; }
  const OptimizerHyperparams& hyperparams() const { return hyperparams_; }

 protected:
  struct Planned {
    const void* data;
    int64_t numel;
    DType dtype;
  };
  OptimizerHyperparams hyperparams_;
  // Per slot the tensors PlannedOf names and its state, then count,
  // total_notfinite; planned_state_: each slot's state count.
  std::vector<Planned> planned_;
  std::vector<size_t> planned_state_;
  Tensor info_;
  static constexpr int kPlannedPerSlot = 9;
  static std::array<const Tensor*, kPlannedPerSlot> PlannedOf(const OptimizerSlot& s) {
    return {&s.param,         &s.mu,           &s.nu,
            &s.fp8.data,      &s.fp8.data_t,   &s.fp8.scale_inv,
            &s.fp8.kept_scale, &s.fp8.kept_amax, &s.compute_copy};
  }
  void Remember(const OptimizerHyperparams& h, const std::vector<OptimizerSlot>& slots,
                const Tensor& count, const Tensor& total_notfinite) {
    hyperparams_ = h;
    planned_.clear();
    planned_state_.clear();
    for (const OptimizerSlot& s : slots) {
      for (const Tensor* t : PlannedOf(s)) {
        planned_.push_back({t->data(), t->numel(), t->dtype()});
      }
      for (const Tensor& t : s.state) planned_.push_back({t.data(), t.numel(), t.dtype()});
      planned_state_.push_back(s.state.size());
    }
    for (const Tensor* t : {&count, &total_notfinite}) {
      planned_.push_back({t->data(), t->numel(), t->dtype()});
    }
  }
};

inline bool OptimizerPlan::Matches(const std::vector<OptimizerSlot>& slots, const Tensor& count,
                                   const Tensor& total_notfinite) const {
  if (planned_state_.size() != slots.size()) return false;
  size_t expected = 2;
  for (size_t k = 0; k < slots.size(); ++k) {
    if (planned_state_[k] != slots[k].state.size()) return false;
    expected += kPlannedPerSlot + slots[k].state.size();
  }
  if (planned_.size() != expected) return false;
  auto same = [](const Planned& p, const Tensor& t) {
    return p.data == t.data() && p.numel == t.numel() && p.dtype == t.dtype();
  };
  size_t i = 0;
  for (const OptimizerSlot& s : slots) {
    for (const Tensor* t : PlannedOf(s)) {
      if (!same(planned_[i++], *t)) return false;
    }
    for (const Tensor& t : s.state) {
      if (!same(planned_[i++], t)) return false;
    }
  }
  return same(planned_[i], count) && same(planned_[i + 1], total_notfinite);
}

// Memory that several Ops share (all the sessions on one device), with a
// limit over all of them. For a device whose own allocator cannot say "no"
// (the CPU's: Linux overcommits, and the OOM killer, not malloc, answers).
struct SharedMemoryAccount {
  explicit SharedMemoryAccount(int64_t limit_bytes) : limit(limit_bytes) {}
  const int64_t limit;
  std::atomic<int64_t> in_use{0};
  std::atomic<int64_t> peak_in_use{0};  // since made or the last Ops::ResetDevicePeaks
};

// A device's memory as JAX's device.memory_stats() reports it: bytes handed
// out to tensors (every session on the device) and bytes the allocator holds
// from the driver (in use plus its cache), now and at their peaks.
struct DeviceMemoryStats {
  int64_t bytes_in_use = 0;
  int64_t peak_bytes_in_use = 0;
  int64_t bytes_reserved = 0;
  int64_t peak_bytes_reserved = 0;
};

class Ops {
 public:
  virtual ~Ops() = default;

  // "cpu" or "cuda:N".
  virtual std::string device_name() const = 0;

  // Whether this backend applies a relative bias named by its table
  // (AttentionArgs::relative_bias) without making [Hq, Sq, Skv] where the
  // call allows (CUDA's far/band split, when switched on). A layer passes
  // the table where it does, and otherwise makes the bias once and passes it
  // made, so that the backward reads it rather than making it again.
  virtual bool AppliesRelativeBiasByTable() const { return false; }

  // ---- memory -----------------------------------------------------------
  // Allocates uninitialised memory, accounted against this Ops' limit
  // (RESOURCE_EXHAUSTED when over it). Freed when the last Tensor sharing it
  // goes away.
  absl::StatusOr<Tensor> Allocate(DType dtype, Shape shape);
  int64_t bytes_in_use() const { return bytes_in_use_->load(); }
  // The most bytes_in_use() has reached since this Ops was made or the last
  // ResetPeakBytesInUse() (a benchmark's timed steps).
  int64_t peak_bytes_in_use() const { return peak_bytes_in_use_->load(); }
  void ResetPeakBytesInUse() { peak_bytes_in_use_->store(bytes_in_use()); }
  // The whole device's memory (every Ops on it). The default, for a device
  // without a cache (the CPU's host memory): reserved is what is in use,
  // from the shared account (this Ops' own figures without one).
  virtual DeviceMemoryStats device_memory_stats() const;
  // Starts the device's peaks again from now.
  virtual void ResetDevicePeaks();
  int64_t memory_limit() const { return memory_limit_; }
  void set_memory_limit(int64_t bytes) { memory_limit_ = bytes; }
  // The most one allocation may take now: the least of what this Ops' limit
  // and the shared account (every session on the device) have left; 0 when
  // either is spent. For refusing work that cannot fit before it starts.
  int64_t memory_available() const;
  // Every allocation also draws on `account` (RESOURCE_EXHAUSTED past its
  // limit); none by default.
  void set_shared_account(std::shared_ptr<SharedMemoryAccount> account) {
    shared_account_ = std::move(account);
  }
  // Library scratch (cuBLASLt and cuDNN workspaces) that a backend grows on
  // demand and keeps, charged in bytes_in_use(): its size now, and a return
  // to `bytes` of it (the size before a call that failed, so that the call
  // leaves the session's memory as it found it). None by default.
  virtual int64_t scratch_bytes() const { return 0; }
  virtual absl::Status ShrinkScratch(int64_t bytes) { return absl::OkStatus(); }

  // ---- interruption -----------------------------------------------------
  // A check the caller installs for the length of one piece of work (a
  // server call: "has its client gone, has its deadline passed"). Layers ask
  // it between their parts (the stages of a composite, attention and MLP), so
  // long work stops soon after nobody waits for it; the work already issued
  // finishes on its own. OK while none is installed.
  using InterruptCheck = std::function<absl::Status()>;
  void set_interrupt_check(InterruptCheck check) { interrupt_check_ = std::move(check); }
  absl::Status CheckInterrupt() const {
    return interrupt_check_ ? interrupt_check_() : absl::OkStatus();
  }

  // ---- replayed steps -----------------------------------------------------
  // A step issued many times with the same launches (a generation's one-token
  // steps: their position lives on the device) costs its launches' host time
  // at every issue. CaptureStep runs `step` once without executing it,
  // recording what it issues on this Ops' stream; Replay(record) issues the
  // whole record again as one launch. Every tensor the step allocates stays
  // the record's (and counts in bytes_in_use()) for the record's life, so
  // its outputs hold each replay's results. The step must not wait for the
  // device or copy from the host; a capture that meets either fails and
  // leaves nothing behind. Backends without it (the CPU) answer
  // UNIMPLEMENTED: run the step itself instead.
  class StepRecord {
   public:
    virtual ~StepRecord() = default;
  };
  virtual absl::StatusOr<std::unique_ptr<StepRecord>> CaptureStep(
      const std::function<absl::Status()>& step);
  virtual absl::Status Replay(StepRecord& record);

  // ---- casts of tensors that stay put ------------------------------------
  // Generation's steps read the same weights, and a float32 weight feeding a
  // bfloat16 GEMM would be cast at every step. While a memo is installed,
  // CastKept(x, dtype) casts each x (the same memory, shape and dtype) once
  // and returns that copy after; without one it casts every time, as Cast.
  // The memo holds every x it has seen, so their memory is not reused for
  // other tensors while it lives, and its copies count in bytes_in_use()
  // until it goes. Only for tensors that do not change while it is
  // installed, or whose every change rewrites the copy too: weights, never
  // activations.
  class CastMemo;
  void set_cast_memo(std::shared_ptr<CastMemo> memo) { cast_memo_ = std::move(memo); }
  const std::shared_ptr<CastMemo>& cast_memo() const { return cast_memo_; }
  absl::StatusOr<Tensor> CastKept(const Tensor& x, DType dtype);

  // Host <-> device copies of dst.nbytes() / src.nbytes() bytes. Download waits
  // for the stream; Upload may return before the copy is done only if `src`
  // stays valid (the CPU copies at once; CUDA stages a small copy in
  // page-locked memory of its own, without waiting for the stream, and a
  // large one from pageable memory, which may wait).
  virtual absl::Status Upload(const void* src, Tensor* dst) = 0;
  virtual absl::Status Download(const Tensor& src, void* dst) = 0;
  // dst = src (same dtype and element count).
  virtual absl::Status Copy(const Tensor& src, Tensor* dst) = 0;
  // (*dst[i]) = *src[i] for every i, as Copy each: for many small tensors (a
  // step's FP8 state), which a GPU backend copies in one launch instead of
  // one per tensor. src and dst have the same length. The default runs Copy
  // for each pair.
  virtual absl::Status CopyAll(const std::vector<const Tensor*>& src,
                               const std::vector<Tensor*>& dst);
  // dst[b, p + s] = src[b, s] for src [B, S, ...] and dst [B, L, ...] (one
  // dtype, the same B and trailing dims), p = position's one int32 element
  // on the op's device, read when the kernel runs: a decode step writes its
  // keys and values into the cache at a position that lives on the device.
  // Rows with p + s outside [0, L) are not written (the host checks the
  // position before the step).
  virtual absl::Status CopyRowsAt(const Tensor& src, const Tensor& position, Tensor* dst) = 0;
  // Waits for all work issued so far; reports any deferred failure.
  virtual absl::Status Synchronize() = 0;

  // Staged uploads, for tensors that arrive in pieces (PutTensor streams):
  // host memory to gather pieces in, and an upload from it that may still be
  // reading `src` when it returns (`src` must stay unchanged until the next
  // Synchronize()). A backend that copies by DMA should return page-locked
  // memory and copy asynchronously on its stream, so the copy of one piece
  // overlaps the arrival of the next. The defaults: plain host memory (not
  // counted against the memory limit) and a synchronous Upload.
  virtual absl::StatusOr<std::shared_ptr<void>> AllocateStaging(size_t bytes) {
    return std::shared_ptr<void>(static_cast<void*>(new char[bytes]),
                                 [](void* p) { delete[] static_cast<char*>(p); });
  }
  virtual absl::Status UploadAsync(const void* src, Tensor* dst) { return Upload(src, dst); }

  // Downloads that do not wait, for a loop that issues its next step before
  // it reads the last one's result (generation's tokens): DownloadAsync
  // enqueues the copy of src into `dst` behind the work issued so far and
  // returns; `dst` holds the bytes once done->Wait() has returned OK, which
  // reports any failure of that work. A Completion is reusable: each
  // DownloadAsync re-arms it. `dst` should come from AllocateStaging (a DMA
  // backend copies into pageable memory only by waiting). The defaults copy
  // at once (Download) and a Completion that is always done.
  class Completion {
   public:
    virtual ~Completion() = default;
    virtual absl::Status Wait() { return absl::OkStatus(); }
  };
  virtual absl::StatusOr<std::unique_ptr<Completion>> NewCompletion() {
    return std::make_unique<Completion>();
  }
  virtual absl::Status DownloadAsync(const Tensor& src, void* dst, Completion* done) {
    return Download(src, dst);
  }
  // y += value, in place, for int32 y: a counter that lives on the device
  // (a generation's step state) advanced inside a recorded step.
  virtual absl::Status AddScalarI32(int32_t value, Tensor* y);

  // ---- elementwise ------------------------------------------------------
  virtual absl::Status Fill(float value, Tensor* y) = 0;
  // y = x converted to y's dtype (float dtypes; FP8 only through Quantize).
  virtual absl::Status Cast(const Tensor& x, Tensor* y) = 0;
  // y = alpha * a + beta * b (same element count). y may alias a or b.
  virtual absl::Status Axpby(float alpha, const Tensor& a, float beta, const Tensor& b,
                             Tensor* y) = 0;
  // y[permuted index] = x: y.shape[i] = x.shape[perm[i]], rank <= 5.
  virtual absl::Status Permute(const Tensor& x, const std::vector<int>& perm, Tensor* y) = 0;
  // y[h] = sum over rows of x [N, H] (float32 accumulation): bias gradients.
  virtual absl::Status SumRows(const Tensor& x, Tensor* y) = 0;
  // out (f32, one element) = sum over i of a[i] * b[i] (float a and b of one
  // dtype and element count; float32 accumulation): a step's loss vdot(y, dy).
  // The default is a [1, n] x [n, 1] Gemm; the CUDA backend reduces in one
  // pass over both.
  virtual absl::Status Dot(const Tensor& a, const Tensor& b, Tensor* out);

  // ---- jax.numpy: broadcasting elementwise ops, reductions, softmax, slices ----
  // Float operands are read as float32 whatever their float dtype (f32, bf16,
  // f16; each operand its own), computed in float32 and rounded once to y's.
  // Both backends implement these; Ops's defaults answer UNIMPLEMENTED.
  //
  // y = op(a, b), a and b (float, one dtype) broadcast to y's shape (see
  // kBroadcastMaxRank). y is float for arithmetic, bool for comparisons.
  virtual absl::Status Binary(const BinaryArgs& args, const Tensor& a, const Tensor& b, Tensor* y);
  // Binary's partial gradients at y's shape, before any sum over broadcast
  // dims (the caller reduces them to its operands' shapes with Reduce):
  //   da = dy * d op/da (a, b),  db = dy * d op/db (a, b)
  // add 1, 1; subtract 1, -1; multiply b, a; divide 1/b, -a/b^2; maximum
  // [a > b], [b > a] and minimum [a < b], [b < a], each 1/2 on a tie and 0
  // where one is NaN (jax.lax.max and min); power
  // b a^(b-1) (0 where b == 0), log(a) a^b (0 where a == 0), as JAX's.
  // dy: float of y's shape; da, db: float (f32 or the operands' dtype), y's
  // shape, either null when not wanted (db always with a scalar, whose
  // tensor operand is a). Not for comparisons (no gradient).
  virtual absl::Status BinaryBackward(const BinaryArgs& args, const Tensor& dy, const Tensor& a,
                                      const Tensor& b, Tensor* da, Tensor* db);
  // y = op(x) elementwise (UnaryOp), x and y of one element count: float, or
  // bool for kLogicalNot.
  virtual absl::Status Unary(UnaryOp op, const Tensor& x, Tensor* y);
  // dx = dy * op'(x) (UnaryOp's derivatives); dy, x, dx float of one count.
  virtual absl::Status UnaryBackward(UnaryOp op, const Tensor& dy, const Tensor& x, Tensor* dx);
  // out = cond ? x : y, cond bool and x, y float (or the args' constants),
  // each broadcast to out's shape; out float.
  virtual absl::Status Where(const WhereArgs& args, const Tensor& cond, const Tensor& x,
                             const Tensor& y, Tensor* out);
  // y = op over x's elements along the dims where y's dim is 1: y has x's
  // rank, each dim x's or 1 (keepdims; a sum over broadcast dims reduces to
  // the operand's shape padded with leading 1s). kMean divides the sum by
  // numel(x) / numel(y); kMax / kMin propagate NaN. Float x and y; each
  // output's terms are added in a fixed order (the same on every run).
  virtual absl::Status Reduce(ReduceOp op, const Tensor& x, Tensor* y);
  // jax.nn.softmax / log_softmax along `axis` of x (float, x viewed as
  // [outer, n, inner]), numerically stable, in float32 (m = max along axis):
  //   softmax y = exp(x - m) / sum exp(x - m); log: y = x - m - log(sum exp(x - m)).
  // y float of x's shape.
  virtual absl::Status Softmax(bool log, int axis, const Tensor& x, Tensor* y);
  // From the forward's y: softmax dx = y (dy - sum(dy y)); log_softmax
  // dx = dy - exp(y) sum(dy) (sums along axis). dy, y, dx float, one shape.
  virtual absl::Status SoftmaxBackward(bool log, int axis, const Tensor& dy, const Tensor& y,
                                       Tensor* dx);
  // x[start:...:stride] per dim (numpy's basic slicing, stride >= 1):
  //   y[i_0, ..] = x[start_0 + i_0 stride_0, ..], every index inside x.
  // x and y of one dtype (any) and rank (<= kBroadcastMaxRank); y's shape
  // chooses the slice's extent.
  virtual absl::Status Slice(const Tensor& x, const std::vector<int64_t>& start,
                             const std::vector<int64_t>& stride, Tensor* y);
  // Its gradient: dx = 0 but dx[start + i stride] = dy[i]; dy and dx float
  // of one dtype, dx overwritten.
  virtual absl::Status SliceBackward(const Tensor& dy, const std::vector<int64_t>& start,
                                     const std::vector<int64_t>& stride, Tensor* dx);

  // ---- FP8 scaling --------------------------------------------------------
  // y (E4M3 or E5M2) = cast(x * scale); writes fp8.amax and fp8.scale_inv.
  virtual absl::Status Quantize(const Tensor& x, const Fp8Output& fp8, Tensor* y) = 0;
  // Cast-transpose: y as Quantize gives it, and y_t [H, N] = y^T, for x
  // [N, H]: the two layouts FP8 GEMMs take an operand in (Hopper's FP8 GEMMs
  // are TN only). The default quantizes, then permutes; the CUDA backend
  // does both in one pass over x.
  virtual absl::Status QuantizeTranspose(const Tensor& x, const Fp8Output& fp8, Tensor* y,
                                         Tensor* y_t);
  // QuantizeTranspose, and dbias [H] (float) = the column sums of x (float32
  // accumulation): TE's cast-transpose-dbias, what a Dense backward does with
  // its output gradient under FP8. The default runs QuantizeTranspose and
  // SumRows; the CUDA backend reads x once.
  virtual absl::Status QuantizeTransposeDbias(const Tensor& x, const Fp8Output& fp8, Tensor* y,
                                              Tensor* y_t, Tensor* dbias);
  // y (float) = x (FP8) * scale_inv.
  // QuantizeTranspose of a tensor that seldom changes (a weight, whose FP8
  // copies a layer keeps across steps). `kept` records what y and y_t hold:
  // the scale they were quantized with (NaN: nothing yet) and x's amax. When
  // *kept.scale == *fp8.scale (compared on the device, no host sync), y and
  // y_t are left as they are and fp8.amax = *kept.amax; otherwise as
  // QuantizeTranspose, then kept records the new scale and amax (so fp8.amax
  // must be defined). The caller resets kept.scale to NaN (or drops the
  // copies) whenever x changes.
  struct KeptQuantization {
    Tensor scale;  // [1] f32
    Tensor amax;   // [1] f32
  };
  virtual absl::Status QuantizeTransposeKept(const Tensor& x, const Fp8Output& fp8,
                                             const KeptQuantization& kept, Tensor* y,
                                             Tensor* y_t);
  // QuantizeTransposeKept of each item, with the results of that many calls
  // (no item's outputs or record may be another's tensors or inputs): what a
  // forward does for every kept weight copy it will read, at its start. Every
  // item is checked before any moves. The default calls QuantizeTransposeKept
  // per item; the CUDA backend checks and, where the scale moved, quantizes
  // the items in one launch per (x dtype, y dtype) and 40 items: a step's
  // weight checks each took a launch of blocks that left at once.
  struct KeptQuantizeItem {
    Tensor x;
    Fp8Output fp8;
    KeptQuantization kept;
    Tensor y;
    Tensor y_t;
  };
  virtual absl::Status QuantizeTransposeKeptMany(const std::vector<KeptQuantizeItem>& items);
  virtual absl::Status Dequantize(const Tensor& x, const Tensor& scale_inv, Tensor* y) = 0;
  // amax [1] f32 = max |x|.
  virtual absl::Status Amax(const Tensor& x, Tensor* amax) = 0;
  // Float8CurrentScaling: scale = fp8_max * 2^-margin / max(amax, epsilon),
  // scale_inv = 1 / scale (scale = 1 where amax is inf or NaN).
  virtual absl::Status ScaleFromAmax(const Tensor& amax, float fp8_max, float margin,
                                     float epsilon, Tensor* scale, Tensor* scale_inv) = 0;
  // TE's delayed-scaling update, on the device, for one quantizer:
  //   amax = max(history) (most_recent: history[0]);
  //   history = roll(history, -1); history[0] = 0;
  //   scale = fp8_max * 2^-margin / amax, kept unchanged where amax is 0, inf or
  //   NaN; scale_inv = 1 / scale.  history: [L] f32, scale/scale_inv: [1] f32.
  virtual absl::Status DelayedScalingUpdate(const DelayedScalingArgs& args,
                                            Tensor* amax_history, Tensor* scale,
                                            Tensor* scale_inv) = 0;
  // The end of a step updates every quantizer of a layer: DelayedScalingUpdate
  // for each entry (no scale_inv), with the same results, in one launch on the
  // GPU. Every entry is checked before any moves. non_finite: null, or [1] f32
  // on this backend, to which the number of entries whose amax was inf or NaN
  // (their scale kept, as TE's update keeps it) is added, on the device: a
  // step reads it back with its other results, no sync of its own. The
  // default calls DelayedScalingUpdate per entry and reads each window back
  // to count (host memory on the CPU backend; the CUDA backend counts in its
  // kernel).
  struct DelayedScalingItem {
    DelayedScalingArgs args;
    Tensor amax_history;  // [L] f32
    Tensor scale;         // [1] f32
  };
  virtual absl::Status DelayedScalingUpdates(const std::vector<DelayedScalingItem>& items,
                                             Tensor* non_finite);
  // Emulated block scaling: y = dequantize(quantize(x)) with blocks of
  // consecutive elements along the last dimension of x [N, K] (K % block == 0).
  virtual absl::Status FakeQuantizeBlockScaled(BlockFormat format, const Tensor& x,
                                               Tensor* y) = 0;

  // ---- GEMM -------------------------------------------------------------
  // out [M, N] (+)= op(a) [M, K] @ op(b) [K, N] + bias [N], where op(t) = t^T
  // if transpose_*; a is [M, K] or, transposed, [K, M]. Operands are float, or
  // both FP8 with their scale_inv ([1] f32): then op(a) = a * a_scale_inv.
  // accumulate: out += result (bias must then be undefined).
  //
  // Fused epilogues (cuBLASLt's; a float out only). With p = op(a) @ op(b)
  // + bias (+ residual), in float32 before any rounding:
  //   residual [M, N] (out's dtype): added to p, as a residual connection
  //     after a projection (cuBLASLt's C with beta = 1). Not with
  //     accumulate, nor with an activation epilogue.
  //   kGeluAux:   aux [M, N] (out's dtype) = p, the pre-activation that the
  //               backward needs; out = gelu(p).
  // gelu is ops.h's tanh approximation, as cuBLASLt's. No backward
  // epilogue (cuBLASLt's DGELU_BGRAD, BGRADA): cuBLASLt runs each as a
  // reduction pass of its own after the GEMM, so it saves no pass over
  // ActivationBackward and SumRows (timings in
  // bench/results/2026-11-30-h200-fused-epilogues.md).
  enum class GemmEpilogue { kNone, kGeluAux };
  struct GemmArgs {
    Tensor a;
    bool transpose_a = false;
    Tensor a_scale_inv;
    Tensor b;
    bool transpose_b = false;
    Tensor b_scale_inv;
    Tensor bias;
    bool accumulate = false;
    Tensor residual;
    GemmEpilogue epilogue = GemmEpilogue::kNone;
    Tensor aux;
    // float32 operands: TensorFloat-32 products (operands rounded to 10
    // mantissa bits, float32 accumulation), where the device has them (the
    // CUDA backend since Ampere), as JAX's default matmul precision runs
    // float32 there. The CPU reference computes exact float32, as JAX's CPU
    // backend does at that precision. No effect on other dtypes.
    bool tf32 = false;
  };
  virtual absl::Status Gemm(const GemmArgs& args, Tensor* out) = 0;

  // ---- normalisation ----------------------------------------------------
  // x [N, H]; gamma, beta [H] (beta undefined for RMSNorm); y [N, H];
  // mu, rsigma [N] f32 (mu undefined for RMSNorm).
  //   LayerNorm: y = (x - mu) * rsigma * g + beta, rsigma = 1/sqrt(var + eps)
  //   RMSNorm:   y = x * rsigma * g, rsigma = 1/sqrt(mean(x^2) + eps)
  //   g = zero_centered_gamma ? 1 + gamma : gamma.
  // y may be FP8 (fp8 non-null).
  virtual absl::Status NormForward(const NormArgs& args, const Tensor& x, const Tensor& gamma,
                                   const Tensor& beta, Tensor* y, Tensor* mu, Tensor* rsigma,
                                   const Fp8Output* fp8 = nullptr) = 0;
  // NormForward with an FP8 y, and y_t [H, N] = y^T (the codes transposed):
  // the norm output in both layouts an FP8 GEMM takes it in (forward as is,
  // the wgrad transposed). The default runs NormForward, then Permute; the
  // CUDA backend writes both from one pass.
  virtual absl::Status NormForwardTransposed(const NormArgs& args, const Tensor& x,
                                             const Tensor& gamma, const Tensor& beta,
                                             const Fp8Output& fp8, Tensor* y, Tensor* y_t,
                                             Tensor* mu, Tensor* rsigma);
  // dx [N, H]; dgamma, dbeta [H] (dbeta undefined for RMSNorm), overwritten.
  // residual_grad (optional, dx's shape and dtype): added to dx, the
  // gradient that reaches x around the norm through a residual connection.
  virtual absl::Status NormBackward(const NormArgs& args, const Tensor& dy, const Tensor& x,
                                    const Tensor& mu, const Tensor& rsigma,
                                    const Tensor& gamma, Tensor* dx, Tensor* dgamma,
                                    Tensor* dbeta,
                                    const Tensor& residual_grad = Tensor()) = 0;

  // ---- activations ------------------------------------------------------
  // x [N, n * I] with n = acts.size() (1 or 2) -> y [N, I]; y may be FP8.
  virtual absl::Status ActivationForward(const std::vector<Activation>& acts, const Tensor& x,
                                         Tensor* y, const Fp8Output* fp8 = nullptr) = 0;
  // ActivationForward with an FP8 y [N, I], and y_t [I, N] = y^T: the
  // activation in both layouts an FP8 GEMM takes it (the next forward GEMM as
  // is, its wgrad transposed). The default runs ActivationForward, then
  // Permute; the CUDA backend writes both from one pass (single activations).
  virtual absl::Status ActivationForwardTransposed(const std::vector<Activation>& acts,
                                                   const Tensor& x, const Fp8Output& fp8,
                                                   Tensor* y, Tensor* y_t);
  // dy [N, I], x [N, n * I] -> dx [N, n * I]. dx may be dy itself (one
  // activation, same dtype): each element is read before it is written.
  virtual absl::Status ActivationBackward(const std::vector<Activation>& acts,
                                          const Tensor& dy, const Tensor& x, Tensor* dx) = 0;
  // ActivationBackward's dx, quantized in both layouts an FP8 GEMM takes it
  // (QuantizeTranspose's y and y_t) and, with dbias ([n * I] float), summed
  // per column (QuantizeTransposeDbias's): TE's dact-cast-transpose-dbias,
  // the output gradient of an MLP's first GEMM under FP8. x [N, n * I] is
  // 2-D; dx itself is not returned, and its values are the ones
  // ActivationBackward writes into a dx of x's dtype (so both paths make the
  // same codes, but for GELU's last float bits where the CUDA kernel takes
  // its form for codes, activation_fns.cuh's GeluForCodesFn). dy is
  // consumed: the default writes dx over it where shape and dtype allow
  // (one activation, x's dtype; else into a temporary), then
  // runs QuantizeTranspose(Dbias), so it holds no more than the fused kernel;
  // the CUDA backend reads dy and x once and writes no dx (one activation,
  // whole 128 x 64 tiles).
  virtual absl::Status ActivationBackwardQuantizeTranspose(const std::vector<Activation>& acts,
                                                           Tensor* dy, const Tensor& x,
                                                           const Fp8Output& fp8, Tensor* y,
                                                           Tensor* y_t, Tensor* dbias);

  // ---- dropout ----------------------------------------------------------
  // Inverted dropout: element i is kept iff DropoutUniform(seed, i) >= rate
  // (kernels/rng.h, so every backend drops the same elements); kept elements
  // are scaled by 1/(1-rate). mask: bool, same shape as x (1 = kept).
  virtual absl::Status DropoutForward(float rate, uint64_t seed, const Tensor& x, Tensor* y,
                                      Tensor* mask) = 0;
  virtual absl::Status DropoutBackward(float rate, const Tensor& dy, const Tensor& mask,
                                       Tensor* dx) = 0;

  // ---- attention --------------------------------------------------------
  // q [B, Sq, Hq, D], k and v [B, Skv, Hkv, D] with Hq % Hkv == 0 (GQA: query
  // head h uses kv head h / (Hq / Hkv)); out [B, Sq, Hq, D];
  // softmax_lse [B, Hq, Sq] f32, the log-sum-exp of each row's masked logits
  // (what backward needs). Dropout element index: ((b*Hq + h)*Sq + i)*Skv + j.
  // A row with no visible key (padded query, or every key masked) outputs 0 and
  // has softmax_lse = +inf (flash attention's convention: backward's
  // exp(logit - lse) is then 0 there with no special case).
  virtual absl::Status AttentionForward(const AttentionArgs& args, const Tensor& q,
                                        const Tensor& k, const Tensor& v, Tensor* out,
                                        Tensor* softmax_lse) = 0;
  // dq, dk, dv like q, k, v; dbias [H, Sq, Skv] f32 when args.bias is defined
  // (summed over the batch), else ignored.
  virtual absl::Status AttentionBackward(const AttentionArgs& args, const Tensor& q,
                                         const Tensor& k, const Tensor& v, const Tensor& out,
                                         const Tensor& dout, const Tensor& softmax_lse,
                                         Tensor* dq, Tensor* dk, Tensor* dv,
                                         Tensor* dbias) = 0;

  // Self-attention on TE's packed BS3HD layout, the fused QKV projection's
  // output as it is: qkv [B, S, 3, H, D] holds q, k and v at index 0, 1 and 2
  // of axis 2 (so Hq = Hkv = H, Sq = Skv = S); out [B, S, H, D]. The same
  // results as AttentionForward / AttentionBackward on the three parts, with
  // dqkv [B, S, 3, H, D] packed the same way. The defaults split and stack
  // with Permute; the CUDA backend reads and writes the packed tensors in
  // place (cuDNN strides), saving those copies.
  virtual absl::Status AttentionForwardPacked(const AttentionArgs& args, const Tensor& qkv,
                                              Tensor* out, Tensor* softmax_lse);
  virtual absl::Status AttentionBackwardPacked(const AttentionArgs& args, const Tensor& qkv,
                                               const Tensor& out, const Tensor& dout,
                                               const Tensor& softmax_lse, Tensor* dqkv,
                                               Tensor* dbias);
  // The same backwards with args.bias a relative-position bias over
  // `relative`'s buckets (or args.relative_bias naming it by its table, with
  // the same buckets and no first_row), writing dtable f32 [H, NB]
  // (overwritten) where the above write dbias: RelativeBiasBackward of their
  // dbias. The defaults run exactly that (making the bias first where it is
  // named by its table); the CUDA backend never forms dbias where
  // `uniform_from` allows (kernels/cuda/relative_band_split.cu,
  // relative_bias_grad.cu).
  virtual absl::Status AttentionBackwardRelative(const AttentionArgs& args, const Tensor& q,
                                                 const Tensor& k, const Tensor& v,
                                                 const Tensor& out, const Tensor& dout,
                                                 const Tensor& softmax_lse,
                                                 const RelativeBuckets& relative, Tensor* dq,
                                                 Tensor* dk, Tensor* dv, Tensor* dtable);
  virtual absl::Status AttentionBackwardPackedRelative(const AttentionArgs& args,
                                                       const Tensor& qkv, const Tensor& out,
                                                       const Tensor& dout,
                                                       const Tensor& softmax_lse,
                                                       const RelativeBuckets& relative,
                                                       Tensor* dqkv, Tensor* dtable);

  // ---- optimizers -------------------------------------------------------
  // One optax step for one parameter, in place, elementwise. grad has the
  // parameter's element count; grad_norm_sq (f32 [1], on the device) is the
  // sum of squares of every gradient the step updates with (optax.global_norm
  // squared). Each element, in float32:
  //   skipped entirely (nothing written) when grad_norm_sq is inf or NaN
  //     (optax.apply_if_finite);
  //   n = sqrt(grad_norm_sq); g = n < max_norm ? g : g / n * max_norm
  //     (clip_by_global_norm, when max_norm > 0);
  //   sgd:  mu undefined: u = g; else t = g + momentum * mu, mu = t,
  //         u = nesterov ? g + momentum * t : t  (optax.trace);
  //   adam: mu = (1 - b1) g + b1 mu, nu = (1 - b2) g^2 + b2 nu,
  //         u = (mu / bias_correction1) / (sqrt(nu / bias_correction2 + eps_root) + eps);
  //   u += weight_decay * param;  param = param - learning_rate * u.
  // param, mu and nu are float (f32, bf16, f16) of one dtype and grad's
  // element count; the moments are rounded to it when stored, and the update
  // uses them unrounded. sgd takes no nu.
  virtual absl::Status OptimizerUpdate(const OptimizerUpdateArgs& args, const Tensor& grad,
                                       const Tensor& grad_norm_sq, Tensor* param, Tensor* mu,
                                       Tensor* nu) = 0;

  // The whole step over many parameters, as one (or a few) launches: the
  // layout is planned once (NewOptimizerPlan: memory for the plan's tables,
  // one upload, RESOURCE_EXHAUSTED past the limit), and each OptimizerStep
  // then issues work only: no allocation, no host sync. Each step, in order:
  //   grad_norm_sq = sum over the slots with a gradient of sum(g^2) (float32);
  //   c = *count; applied = grad_norm_sq is finite;
  //   the slots' updates as OptimizerUpdate with UpdateArgsAt(hyperparams, c)
  //     (optimizer_math.h), or under a chain (num_links > 0) as ApplyLinks
  //     runs the links on each element in float32 (each state element read
  //     and rounded once per step), clip_by_global_norm at link k taking the
  //     float32 norm of every updated slot's u after links [0, k); skipped
  //     entirely when not applied;
  //   each updated slot's FP8 copy (slot.fp8) as QuantizeTranspose makes it
  //     from the new param viewed as [rows, cols] with slot.fp8.scale: data,
  //     data_t, scale_inv, kept_amax = max |param| (QuantizeTranspose's
  //     amax), kept_scale = scale; a skipped step, or a slot without a
  //     gradient, leaves the copy as it is (it still holds the param);
  //   each updated slot's compute_copy as Cast makes it from the new param
  //     (the same rule for skipped steps and slots without a gradient);
  //   *count = c + applied, *total_notfinite += !applied (both saturating at
  //     INT32_MAX), and plan.info() = OptimizerStepInfo.
  // count and total_notfinite: int32 [1] on the device. grads[i] is slot i's
  // gradient (float, the param's element count) or an undefined Tensor: that
  // slot keeps its value and moments. INVALID_ARGUMENT when `slots` etc. are
  // not the plan's (Matches), a gradient does not fit its slot, or an FP8
  // copy or a compute_copy does not fit its param (NewOptimizerPlan) or an
  // FP8 copy lacks its scale.
  virtual absl::StatusOr<std::unique_ptr<OptimizerPlan>> NewOptimizerPlan(
      const OptimizerHyperparams& hyperparams, const std::vector<OptimizerSlot>& slots,
      const Tensor& count, const Tensor& total_notfinite) = 0;
  virtual absl::Status OptimizerStep(OptimizerPlan& plan, const std::vector<OptimizerSlot>& slots,
                                     const std::vector<Tensor>& grads, Tensor* count,
                                     Tensor* total_notfinite) = 0;

  // ---- language-model ops -------------------------------------------------
  // nn.Embed: table [V, F] float, ids int32 [N], y [N, F] (float):
  //   y[n] = table[ids[n]], or NaN where ids[n] is outside [0, V) (jnp.take's
  //   "fill"; checked on the device, no host round trip).
  virtual absl::Status EmbedForward(const Tensor& table, const Tensor& ids, Tensor* y) = 0;
  // Its gradient: dtable [V, F] float (overwritten) = sum over the n with
  // ids[n] == v of dy[n] [N, F] (float), added in increasing n in float32,
  // so the result is the same on every run and backend; rows no id names
  // are 0 and ids outside [0, V) add nothing.
  virtual absl::Status EmbedBackward(const Tensor& dy, const Tensor& ids, Tensor* dtable) = 0;
  // optax.softmax_cross_entropy_with_integer_labels, averaged over the rows.
  // logits [N, V] float, labels int32 [N] (N >= 1), in float32:
  //   lse[n] = log(sum_v exp(logits[n, v]))  (max-subtracted), f32 [N];
  //   loss [1] f32 = (1 / N) sum_n (lse[n] - logits[n, labels[n]]),
  //   NaN when a label is outside [0, V). The rows' terms are added in a
  //   fixed order (the same result on every run).
  virtual absl::Status SoftmaxCrossEntropyForward(const Tensor& logits, const Tensor& labels,
                                                  Tensor* loss, Tensor* lse) = 0;
  // dlogits [N, V] float = dloss[0] / N * (exp(logits[n, v] - lse[n]) - [v == labels[n]]),
  // dloss [1] f32 on the device (the loss's upstream gradient).
  virtual absl::Status SoftmaxCrossEntropyBackward(const Tensor& logits, const Tensor& labels,
                                                   const Tensor& lse, const Tensor& dloss,
                                                   Tensor* dlogits) = 0;
  // jnp.argmax(x, axis=-1): x [..., V] float (V >= 1), y int32 with one
  // element per row of x: the index of the row's first maximum, or of its
  // first NaN where it has one. Greedy decoding on the device.
  virtual absl::Status ArgmaxLast(const Tensor& x, Tensor* y);

  // ---- position encodings -------------------------------------------------
  // x, y [B, S, H, D] (D even): rotary embedding as RotaryArgs states.
  virtual absl::Status Rotary(const RotaryArgs& args, const Tensor& x, Tensor* y) = 0;
  // RotaryArgs::table for `args` (its position fields host-side: no
  // `position`) over seq rows of head dim `dim` (even): float32
  // [2, seq, dim / 2], the values the rotary ops would compute themselves.
  // The default answers UNIMPLEMENTED: the ops then make their own.
  virtual absl::StatusOr<Tensor> RotaryTable(const RotaryArgs& args, int64_t seq, int64_t dim);
  // The fused QKV projection's output as it is, qkv [B, S, 3, H, D] (TE's
  // BS3HD, D even): parts 0 and 1 (q and k) rotated in place, each as Rotary
  // rotates a [B, S, H, D] tensor; part 2 (v) untouched. A self-attention
  // with rotary embedding then runs on the packed qkv (AttentionForwardPacked)
  // instead of splitting it. The default splits qkv with Permute, rotates the
  // two parts and permutes back; the CUDA backend rotates in place.
  virtual absl::Status RotaryQkInPlace(const RotaryArgs& args, Tensor* qkv);
  // RotaryQkInPlace, then the rotated qkv as rows [B * S, 3 * H * D]
  // quantized in both layouts an FP8 GEMM takes it (QuantizeTranspose's y
  // and y_t) and, with dbias ([3 * H * D]), summed per column
  // (QuantizeTransposeDbias's): the output gradient of a packed QKV
  // projection under FP8 with rotary embedding, the inverse rotation and the
  // codes from one pass. qkv is consumed (the default rotates it in place,
  // then quantizes it); the CUDA backend reads it once and writes only the
  // codes where the shape allows (2-byte dtype, adjacent pairs, host
  // positions, S past a few rows, whole 128 x 64 tiles, D % 8 == 0), the
  // rotated values rounded to qkv's dtype first as the default's are, so
  // both make the same codes.
  virtual absl::Status RotaryQkQuantizeTranspose(const RotaryArgs& args, Tensor* qkv,
                                                 const Fp8Output& fp8, Tensor* y, Tensor* y_t,
                                                 Tensor* dbias);
  // A decode step's new tokens from the fused QKV projection's output as it
  // is, qkv [B, T, 3, H, D] (TE's BS3HD): q [B, T, H, D] = part 0, and parts
  // 1 and 2 written into key_cache and value_cache [B, L, H, D] at rows p ..
  // p + T - 1 as CopyRowsAt writes them (p = position's one int32 element on
  // the op's device). With `rotary` (non-null; its own position fields, as
  // Rotary reads them), q and the keys are rotated on the way. One dtype
  // throughout. The default splits qkv with Permute, then runs Rotary and
  // CopyRowsAt; the CUDA backend does it in one pass.
  virtual absl::Status DecodeQkvRows(const Tensor& qkv, const RotaryArgs* rotary,
                                     const Tensor& position, Tensor* q, Tensor* key_cache,
                                     Tensor* value_cache);
  // A decode step's attention straight from the fused projection:
  // DecodeQkvRows(qkv, rotary, position, q, key_cache, value_cache), then
  // AttentionForward(args, *q, *key_cache, *value_cache, out, softmax_lse).
  // The default runs those two; the CUDA backend runs both in its one-row
  // attention kernel where that takes the step (one token a sequence).
  virtual absl::Status DecodeAttentionFromQkv(const AttentionArgs& args, const Tensor& qkv,
                                              const RotaryArgs* rotary, const Tensor& position,
                                              Tensor* q, Tensor* key_cache, Tensor* value_cache,
                                              Tensor* out, Tensor* softmax_lse);
  // T5 relative position bias: bias[h, i, j] = table[h, buckets[r0 + i, j]].
  // table [H, NB] (float; TE's layout of the parameter, read in place),
  // buckets int32 [R, Skv], bias [H, Sq, Skv] (any float dtype: the
  // attention's operands' saves a cast).
  // r0 = first_row's one int32 element (on the op's device), read when the
  // kernel runs: a decode step's rows of the [L, L] bucket table, at a
  // position that lives on the device. Without first_row, r0 = 0 and Sq == R.
  // With it, rows r0 + i at or past R give bias 0 (the host checks the
  // position before the step).
  virtual absl::Status RelativeBiasForward(const Tensor& table, const Tensor& buckets,
                                           const Tensor& first_row, Tensor* bias) = 0;
  // dtable [H, NB] = scatter-add of dbias over buckets (overwritten).
  virtual absl::Status RelativeBiasBackward(const Tensor& dbias, const Tensor& buckets,
                                            Tensor* dtable) = 0;

 protected:
  // Backend allocation of `bytes` (>0); the deleter must free the memory.
  virtual absl::StatusOr<std::shared_ptr<void>> AllocateBytes(size_t bytes) = 0;
  // While set (a capture), every allocation's storage is also kept in
  // `*hold`: a recorded step's memory is never handed to other work.
  void set_allocation_hold(std::vector<std::shared_ptr<void>>* hold) { allocation_hold_ = hold; }

 private:
  // Atomic: a tensor may be freed on another thread than the one that made it.
  std::shared_ptr<std::atomic<int64_t>> bytes_in_use_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<std::atomic<int64_t>> peak_bytes_in_use_ =
      std::make_shared<std::atomic<int64_t>>(0);
  int64_t memory_limit_ = INT64_MAX;
  std::shared_ptr<SharedMemoryAccount> shared_account_;
  InterruptCheck interrupt_check_;
  std::shared_ptr<CastMemo> cast_memo_;
  std::vector<std::shared_ptr<void>>* allocation_hold_ = nullptr;
};

class Ops::CastMemo {
 public:
  struct Kept {
    Tensor source;  // held: its memory stays x's alone
    Tensor copy;
    uint64_t stamp;  // Keep's count when it was kept (Forget's "since")
  };
  // By the source's memory and the copy's dtype.
  using Key = std::pair<const void*, DType>;

  // The copy of x in `dtype` made by an earlier call, or null.
  const Tensor* Find(const Tensor& x, DType dtype) const;
  void Keep(const Tensor& x, Tensor copy);
  size_t size() const { return kept_.size(); }

  // For a holder that keeps the memo across calls whose sources change in
  // place (a training session's layer: its optimizer rewrites each copy as
  // it writes the param, OptimizerSlot::compute_copy).
  const std::map<Key, Kept>& kept() const { return kept_; }
  void Forget(const Key& key) { kept_.erase(key); }
  void Clear() { kept_.clear(); }
  // Keep's count so far: ForgetSince(stamp()) later drops what was kept in
  // between (a failed call's copies).
  uint64_t stamp() const { return stamp_; }
  void ForgetSince(uint64_t stamp);

 private:
  std::map<Key, Kept> kept_;
  uint64_t stamp_ = 0;
};

// `memo` as the ops' cast memo while the scope lives; the memo installed
// before comes back at its end. Unless Commit() was called, what the memo
// kept meanwhile goes at the end too, so a failed call leaves no copy behind
// in a memo that outlives it (a session layer's). A null `memo` leaves the
// ops' memo alone.
class CastMemoScope {
 public:
  CastMemoScope(Ops& ops, std::shared_ptr<Ops::CastMemo> memo);
  ~CastMemoScope();
  void Commit() { committed_ = true; }
  CastMemoScope(const CastMemoScope&) = delete;
  CastMemoScope& operator=(const CastMemoScope&) = delete;

 private:
  Ops& ops_;
  const std::shared_ptr<Ops::CastMemo> memo_;
  const std::shared_ptr<Ops::CastMemo> previous_;
  const uint64_t since_;
  bool committed_ = false;
};

// What a device is and can do, for GetServerInfo.
struct DeviceInfo {
  std::string name;        // "cpu", "cuda:0"
  std::string description; // "NVIDIA H200", "x86_64 CPU"
  int compute_capability = 0;  // 90 for sm_90; 0 for the CPU
  int64_t memory_bytes = 0;
  bool fp8_native = false;           // FP8 GEMMs in hardware (sm_89+)
  bool block_scaling_native = false; // MXFP8 / NVFP4 in hardware (sm_100+)
};

// One physical device; makes streams (Ops) on it. Thread-safe.
class Device {
 public:
  virtual ~Device() = default;
  virtual DeviceInfo info() const = 0;
  // A new stream with a memory limit (bytes).
  virtual absl::StatusOr<std::unique_ptr<Ops>> NewOps(int64_t memory_limit) = 0;
  // False once the device hit an unrecoverable (sticky) error.
  virtual bool healthy() const { return true; }
};

// How a CUDA device is opened (te_server's --cuda_memory_* and
// --inject_device_fault flags).
struct CudaDeviceOptions {
  // The bytes the device's sessions may hold together (one
  // SharedMemoryAccount per device). 0: the device's free memory when it is
  // opened, less memory_reserve_bytes.
  int64_t memory_bytes = 0;
  // Left outside the account for what does not go through it: the CUDA
  // context's growth (kernels loaded lazily), the libraries' own allocations
  // (cuBLASLt and cuDNN handles, plans, runtime-compiled engines) and the
  // caching allocator's rounding. The caching allocator also gives cached
  // blocks back before its reservation would reach into it.
  int64_t memory_reserve_bytes = int64_t{4} << 30;
  // For testing the fault path only (never reachable from the API): after
  // this many kernel launches on the device, the next one fails as a sticky
  // fault would (cudaErrorLaunchFailure, through kernels/cuda/check.h).
  // Negative: never.
  int64_t fault_after_launches = -1;
  // TE's relative position bias through the far/band split
  // (kernels/cuda/relative_band_split.cu: no [heads, S, S] made) where it
  // applies, else the bias made dense. Off by default until the split's GPU
  // tests have passed on a GPU (te_server --relative_bias_split).
  // Process-wide: the last device opened sets it.
  bool relative_bias_split = false;
};

absl::StatusOr<std::unique_ptr<Device>> OpenCpuDevice();
// Defined only in builds with CUDA; returns UNAVAILABLE when no GPU/driver,
// and when the device has less free memory than options.memory_reserve_bytes
// (or options.memory_bytes).
absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal,
                                                       const CudaDeviceOptions& options = {});
bool CudaBackendBuilt();

}  // namespace te

#endif  // TE_KERNELS_OPS_H_
