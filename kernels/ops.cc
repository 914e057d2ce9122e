#include "kernels/ops.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace {

// *peak = max(*peak, now), racing other allocations safely.
void RaisePeak(std::atomic<int64_t>* peak, int64_t now) {
  int64_t seen = peak->load();
  while (now > seen && !peak->compare_exchange_weak(seen, now)) {
  }
}

}  // namespace

DeviceMemoryStats Ops::device_memory_stats() const {
  DeviceMemoryStats stats;
  if (shared_account_ != nullptr) {
    stats.bytes_in_use = shared_account_->in_use.load();
    stats.peak_bytes_in_use = shared_account_->peak_in_use.load();
  } else {
    stats.bytes_in_use = bytes_in_use();
    stats.peak_bytes_in_use = peak_bytes_in_use();
  }
  stats.bytes_reserved = stats.bytes_in_use;
  stats.peak_bytes_reserved = stats.peak_bytes_in_use;
  return stats;
}

int64_t Ops::memory_available() const {
  int64_t available = memory_limit_ - bytes_in_use_->load();
  if (shared_account_ != nullptr) {
    available = std::min(available, shared_account_->limit - shared_account_->in_use.load());
  }
  return std::max<int64_t>(available, 0);
}

void Ops::ResetDevicePeaks() {
  if (shared_account_ != nullptr) {
    shared_account_->peak_in_use.store(shared_account_->in_use.load());
  }
}

const Tensor* Ops::CastMemo::Find(const Tensor& x, DType dtype) const {
  auto it = kept_.find({x.data(), dtype});
  if (it == kept_.end()) return nullptr;
  const Tensor& source = it->second.source;
  return source.dtype() == x.dtype() && source.shape() == x.shape() ? &it->second.copy : nullptr;
}

void Ops::CastMemo::Keep(const Tensor& x, Tensor copy) {
  const DType dtype = copy.dtype();
  kept_.insert_or_assign({x.data(), dtype}, Kept{x, std::move(copy), ++stamp_});
}

void Ops::CastMemo::ForgetSince(uint64_t stamp) {
  for (auto it = kept_.begin(); it != kept_.end();) {
    it = it->second.stamp > stamp ? kept_.erase(it) : std::next(it);
  }
}

CastMemoScope::CastMemoScope(Ops& ops, std::shared_ptr<Ops::CastMemo> memo)
    : ops_(ops),
      memo_(std::move(memo)),
      previous_(ops.cast_memo()),
      since_(memo_ != nullptr ? memo_->stamp() : 0) {
  if (memo_ != nullptr) ops_.set_cast_memo(memo_);
}

CastMemoScope::~CastMemoScope() {
  if (memo_ == nullptr) return;
  ops_.set_cast_memo(previous_);
  if (!committed_) memo_->ForgetSince(since_);
}

absl::StatusOr<Tensor> Ops::CastKept(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  if (cast_memo_ != nullptr && x.data() != nullptr) {
    if (const Tensor* kept = cast_memo_->Find(x, dtype)) return *kept;
  }
  ASSIGN_OR_RETURN(Tensor y, Allocate(dtype, x.shape()));
  RETURN_IF_ERROR(Cast(x, &y));
  if (cast_memo_ != nullptr && x.data() != nullptr) cast_memo_->Keep(x, y);
  return y;
}

absl::StatusOr<Tensor> Ops::Allocate(DType dtype, Shape shape) {
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension in shape ", ShapeString(shape)));
  }
  const std::optional<int64_t> checked = CheckedNumBytes(shape, dtype);
  if (!checked) {
    return absl::ResourceExhaustedError(absl::StrCat("allocating ", ShapeString(shape), " ",
                                                     DTypeName(dtype), ": over 2^63 bytes"));
  }
  const size_t bytes = static_cast<size_t>(*checked);
  if (bytes == 0) return Tensor(nullptr, nullptr, dtype, std::move(shape));
  // Compared as a difference: the sum could overflow for a size near 2^63.
  if (static_cast<int64_t>(bytes) > memory_limit_ - bytes_in_use_->load()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("allocating ", bytes, " bytes for ", ShapeString(shape), " ", DTypeName(dtype),
                     " would exceed the memory limit of ", memory_limit_, " bytes (",
                     bytes_in_use_->load(), " in use)"));
  }
  std::shared_ptr<SharedMemoryAccount> shared = shared_account_;
  if (shared != nullptr) {
    // Charged only if it fits: a request that will be refused is never
    // counted, not even for a moment, so it cannot make another session's
    // small request fail beside it (a hog's 16 GB one beside a step's).
    int64_t before = shared->in_use.load();
    while (static_cast<int64_t>(bytes) <= shared->limit - before &&
           !shared->in_use.compare_exchange_weak(before, before + static_cast<int64_t>(bytes))) {
    }
    if (static_cast<int64_t>(bytes) > shared->limit - before) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "allocating ", bytes, " bytes for ", ShapeString(shape), " ", DTypeName(dtype),
          ": the sessions on ", device_name(), " already hold ", before, " of the ",
          shared->limit, " bytes the device has for them (", std::max<int64_t>(shared->limit - before, 0),
          " left); retry later"));
    }
  }
  auto raw = AllocateBytes(bytes);
  if (!raw.ok()) {
    if (shared != nullptr) shared->in_use -= static_cast<int64_t>(bytes);
    return raw.status();
  }
  std::shared_ptr<void> memory = *std::move(raw);
  void* data = memory.get();
  RaisePeak(peak_bytes_in_use_.get(), *bytes_in_use_ += static_cast<int64_t>(bytes));
  if (shared != nullptr) RaisePeak(&shared->peak_in_use, shared->in_use.load());
  // The accounts outlive this Ops if a tensor does.
  std::shared_ptr<std::atomic<int64_t>> account = bytes_in_use_;
  std::shared_ptr<void> storage(data, [memory, account, shared, bytes](void*) mutable {
    *account -= static_cast<int64_t>(bytes);
    if (shared != nullptr) shared->in_use -= static_cast<int64_t>(bytes);
    memory.reset();
  });
  if (allocation_hold_ != nullptr) allocation_hold_->push_back(storage);
  return Tensor(std::move(storage), data, dtype, std::move(shape));
}

absl::StatusOr<Tensor> Ops::RotaryTable(const RotaryArgs& args, int64_t seq, int64_t dim) {
  return absl::UnimplementedError(absl::StrCat(device_name(), " makes no rotary tables"));
}

absl::StatusOr<std::unique_ptr<Ops::StepRecord>> Ops::CaptureStep(
    const std::function<absl::Status()>& step) {
  return absl::UnimplementedError(
      absl::StrCat(device_name(), " does not record steps; run the step itself"));
}

absl::Status Ops::Replay(StepRecord& record) {
  return absl::UnimplementedError(absl::StrCat(device_name(), " does not replay steps"));
}

absl::Status Ops::QuantizeTranspose(const Tensor& x, const Fp8Output& fp8, Tensor* y, Tensor* y_t) {
  RETURN_IF_ERROR(CheckQuantizeTransposeArgs(x, fp8, y, y_t));
  RETURN_IF_ERROR(Quantize(x, fp8, y));
  return Permute(*y, {1, 0}, y_t);
}

absl::Status Ops::Dot(const Tensor& a, const Tensor& b, Tensor* out) {
  RETURN_IF_ERROR(CheckDotArgs(a, b, out));
  const int64_t n = a.numel();
  Tensor out_1x1 = out->Reshaped({1, 1});
  if (n == 0) return Fill(0.0f, &out_1x1);
  GemmArgs args;
  args.a = a.Reshaped({1, n});
  args.b = b.Reshaped({n, 1});
  return Gemm(args, &out_1x1);
}

absl::Status Ops::QuantizeTransposeKept(const Tensor& x, const Fp8Output& fp8,
                                        const KeptQuantization& kept, Tensor* y, Tensor* y_t) {
  RETURN_IF_ERROR(CheckQuantizeTransposeArgs(x, fp8, y, y_t));
  RETURN_IF_ERROR(CheckKeptQuantization(fp8, kept));
  // The reference decides on the host: a backend without a device-side
  // decision pays a read of two scalars.
  float kept_scale = 0.0f, scale = 0.0f;
  RETURN_IF_ERROR(Download(kept.scale, &kept_scale));
  RETURN_IF_ERROR(Download(fp8.scale, &scale));
  Tensor amax = fp8.amax;
  if (kept_scale == scale) return Copy(kept.amax, &amax);
  RETURN_IF_ERROR(QuantizeTranspose(x, fp8, y, y_t));
  Tensor kept_scale_out = kept.scale, kept_amax_out = kept.amax;
  RETURN_IF_ERROR(Copy(fp8.scale, &kept_scale_out));
  return Copy(fp8.amax, &kept_amax_out);
}

absl::Status Ops::QuantizeTransposeKeptMany(const std::vector<KeptQuantizeItem>& items) {
  RETURN_IF_ERROR(CheckQuantizeTransposeKeptManyArgs(items));
  for (const KeptQuantizeItem& item : items) {
    Tensor y = item.y, y_t = item.y_t;
    RETURN_IF_ERROR(QuantizeTransposeKept(item.x, item.fp8, item.kept, &y, &y_t));
  }
  return absl::OkStatus();
}

absl::Status Ops::ActivationForwardTransposed(const std::vector<Activation>& acts,
                                              const Tensor& x, const Fp8Output& fp8, Tensor* y,
                                              Tensor* y_t) {
  ASSIGN_OR_RETURN(const int64_t width, CheckActivationForwardTransposedArgs(acts, x, fp8, y, y_t));
  RETURN_IF_ERROR(ActivationForward(acts, x, y, &fp8));
  if (width == 0) return absl::OkStatus();
  return Permute(y->Reshaped({y->numel() / width, width}), {1, 0}, y_t);
}

absl::Status Ops::DelayedScalingUpdates(const std::vector<DelayedScalingItem>& items,
                                        Tensor* non_finite) {
  RETURN_IF_ERROR(CheckDelayedScalingUpdatesArgs(items, non_finite));
  if (items.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(Tensor scale_inv, Allocate(DType::kF32, {1}));
  float count = 0.0f;
  std::vector<float> window;
  for (const DelayedScalingItem& item : items) {
    if (non_finite != nullptr) {
      // The window the update takes its amax from (history[0] for
      // most_recent): max |v| is inf or NaN iff one of its values is.
      window.resize(static_cast<size_t>(item.args.most_recent ? 1 : item.amax_history.numel()));
      RETURN_IF_ERROR(Download(item.amax_history.Slice0(0, static_cast<int64_t>(window.size())),
                               window.data()));
      if (std::any_of(window.begin(), window.end(), [](float v) { return !std::isfinite(v); })) {
        count += 1.0f;
      }
    }
    Tensor history = item.amax_history, scale = item.scale;
    RETURN_IF_ERROR(DelayedScalingUpdate(item.args, &history, &scale, &scale_inv));
  }
  if (non_finite != nullptr && count > 0.0f) {
    float total = 0.0f;
    RETURN_IF_ERROR(Download(*non_finite, &total));
    total += count;
    RETURN_IF_ERROR(Upload(&total, non_finite));
  }
  return absl::OkStatus();
}

absl::Status Ops::CopyAll(const std::vector<const Tensor*>& src, const std::vector<Tensor*>& dst) {
  RETURN_IF_ERROR(CheckCopyAllArgs(src, dst));
  for (size_t i = 0; i < src.size(); ++i) RETURN_IF_ERROR(Copy(*src[i], dst[i]));
  return absl::OkStatus();
}

absl::Status Ops::QuantizeTransposeDbias(const Tensor& x, const Fp8Output& fp8, Tensor* y,
                                         Tensor* y_t, Tensor* dbias) {
  RETURN_IF_ERROR(CheckQuantizeTransposeArgs(x, fp8, y, y_t));
  RETURN_IF_ERROR(CheckSumRowsArgs(x, dbias));
  RETURN_IF_ERROR(QuantizeTranspose(x, fp8, y, y_t));
  return SumRows(x, dbias);
}

absl::Status Ops::ActivationBackwardQuantizeTranspose(const std::vector<Activation>& acts,
                                                      Tensor* dy, const Tensor& x,
                                                      const Fp8Output& fp8, Tensor* y,
                                                      Tensor* y_t, Tensor* dbias) {
  RETURN_IF_ERROR(
      CheckActivationBackwardQuantizeTransposeArgs(acts, dy, x, fp8, y, y_t, dbias).status());
  // ActivationBackward may write dx over dy (one activation, same dtype).
  Tensor dx = *dy;
  if (dy->shape() != x.shape() || dy->dtype() != x.dtype()) {
    ASSIGN_OR_RETURN(dx, Allocate(x.dtype(), x.shape()));
  }
  RETURN_IF_ERROR(ActivationBackward(acts, *dy, x, &dx));
  if (dbias != nullptr) return QuantizeTransposeDbias(dx, fp8, y, y_t, dbias);
  return QuantizeTranspose(dx, fp8, y, y_t);
}

absl::Status Ops::NormForwardTransposed(const NormArgs& args, const Tensor& x,
                                        const Tensor& gamma, const Tensor& beta,
                                        const Fp8Output& fp8, Tensor* y, Tensor* y_t, Tensor* mu,
                                        Tensor* rsigma) {
  RETURN_IF_ERROR(CheckNormForwardTransposedArgs(args, x, gamma, beta, fp8, y, y_t, mu, rsigma));
  RETURN_IF_ERROR(NormForward(args, x, gamma, beta, y, mu, rsigma, &fp8));
  return Permute(y->Reshaped({Rows(x), x.dim(-1)}), {1, 0}, y_t);
}

namespace {

// q, k and v of a packed qkv [B, S, 3, H, D], each [B, S, H, D], from
// `front` [3, B, S, H, D].
std::vector<Tensor> Unstack(const Tensor& front) {
  const Shape part(front.shape().begin() + 1, front.shape().end());
  std::vector<Tensor> parts;
  for (int64_t i = 0; i < 3; ++i) parts.push_back(front.Slice0(i, i + 1).Reshaped(part));
  return parts;
}

Shape FrontShape(const Tensor& qkv) {
  return {3, qkv.dim(0), qkv.dim(1), qkv.dim(3), qkv.dim(4)};
}

}  // namespace

absl::Status Ops::AttentionForwardPacked(const AttentionArgs& args, const Tensor& qkv,
                                         Tensor* out, Tensor* softmax_lse) {
  RETURN_IF_ERROR(CheckPackedQkv("AttentionForwardPacked", "qkv", qkv));
  ASSIGN_OR_RETURN(Tensor front, Allocate(qkv.dtype(), FrontShape(qkv)));
  RETURN_IF_ERROR(Permute(qkv, {2, 0, 1, 3, 4}, &front));
  const std::vector<Tensor> qkv_parts = Unstack(front);
  return AttentionForward(args, qkv_parts[0], qkv_parts[1], qkv_parts[2], out, softmax_lse);
}

absl::Status Ops::DecodeAttentionFromQkv(const AttentionArgs& args, const Tensor& qkv,
                                         const RotaryArgs* rotary, const Tensor& position,
                                         Tensor* q, Tensor* key_cache, Tensor* value_cache,
                                         Tensor* out, Tensor* softmax_lse) {
  RETURN_IF_ERROR(DecodeQkvRows(qkv, rotary, position, q, key_cache, value_cache));
  return AttentionForward(args, *q, *key_cache, *value_cache, out, softmax_lse);
}

absl::Status Ops::RotaryQkInPlace(const RotaryArgs& args, Tensor* qkv) {
  RETURN_IF_ERROR(CheckRotaryQkArgs(args, *qkv));
  ASSIGN_OR_RETURN(Tensor front, Allocate(qkv->dtype(), FrontShape(*qkv)));
  RETURN_IF_ERROR(Permute(*qkv, {2, 0, 1, 3, 4}, &front));
  std::vector<Tensor> parts = Unstack(front);
  RETURN_IF_ERROR(Rotary(args, parts[0], &parts[0]));
  RETURN_IF_ERROR(Rotary(args, parts[1], &parts[1]));
  return Permute(front, {1, 2, 0, 3, 4}, qkv);
}

absl::Status Ops::RotaryQkQuantizeTranspose(const RotaryArgs& args, Tensor* qkv,
                                            const Fp8Output& fp8, Tensor* y, Tensor* y_t,
                                            Tensor* dbias) {
  RETURN_IF_ERROR(CheckRotaryQkQuantizeTransposeArgs(args, qkv, fp8, y, y_t, dbias));
  RETURN_IF_ERROR(RotaryQkInPlace(args, qkv));
  const Tensor rows = PackedQkvRows(*qkv);
  if (dbias != nullptr) return QuantizeTransposeDbias(rows, fp8, y, y_t, dbias);
  return QuantizeTranspose(rows, fp8, y, y_t);
}

absl::Status Ops::DecodeQkvRows(const Tensor& qkv, const RotaryArgs* rotary,
                                const Tensor& position, Tensor* q, Tensor* key_cache,
                                Tensor* value_cache) {
  RETURN_IF_ERROR(CheckDecodeQkvRowsArgs(qkv, rotary, position, q, key_cache, value_cache));
  ASSIGN_OR_RETURN(Tensor front, Allocate(qkv.dtype(), FrontShape(qkv)));
  RETURN_IF_ERROR(Permute(qkv, {2, 0, 1, 3, 4}, &front));
  std::vector<Tensor> parts = Unstack(front);
  if (rotary != nullptr) {
    RETURN_IF_ERROR(Rotary(*rotary, parts[0], q));
    RETURN_IF_ERROR(Rotary(*rotary, parts[1], &parts[1]));
  } else {
    RETURN_IF_ERROR(Copy(parts[0], q));
  }
  RETURN_IF_ERROR(CopyRowsAt(parts[1], position, key_cache));
  return CopyRowsAt(parts[2], position, value_cache);
}

absl::Status Ops::AttentionBackwardPacked(const AttentionArgs& args, const Tensor& qkv,
                                          const Tensor& out, const Tensor& dout,
                                          const Tensor& softmax_lse, Tensor* dqkv,
                                          Tensor* dbias) {
  RETURN_IF_ERROR(CheckPackedQkv("AttentionBackwardPacked", "qkv", qkv));
  RETURN_IF_ERROR(CheckPackedQkv("AttentionBackwardPacked", "dqkv", *dqkv));
  if (dqkv->shape() != qkv.shape() || dqkv->dtype() != qkv.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AttentionBackwardPacked: dqkv is ", ShapeString(dqkv->shape()), " ",
        DTypeName(dqkv->dtype()), ", want qkv's ", ShapeString(qkv.shape()), " ",
        DTypeName(qkv.dtype())));
  }
  ASSIGN_OR_RETURN(Tensor front, Allocate(qkv.dtype(), FrontShape(qkv)));
  RETURN_IF_ERROR(Permute(qkv, {2, 0, 1, 3, 4}, &front));
  const std::vector<Tensor> parts = Unstack(front);
  ASSIGN_OR_RETURN(Tensor dfront, Allocate(qkv.dtype(), FrontShape(qkv)));
  std::vector<Tensor> dparts = Unstack(dfront);
  RETURN_IF_ERROR(AttentionBackward(args, parts[0], parts[1], parts[2], out, dout, softmax_lse,
                                    &dparts[0], &dparts[1], &dparts[2], dbias));
  return Permute(dfront, {1, 2, 0, 3, 4}, dqkv);
}

absl::StatusOr<AttentionArgs> WithRelativeBiasMadeForBackward(Ops& ops, const AttentionArgs& args,
                                                              const Tensor& q, const char* op) {
  if (!args.relative_bias.defined()) return args;
  if (args.relative_bias.first_row.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": relative_bias.first_row is a decode step's (forward only)"));
  }
  if (q.rank() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": q (or qkv) has shape ", ShapeString(q.shape())));
  }
  return WithRelativeBiasMade(ops, args, q.dim(1), q.dtype());
}

namespace {
// The dense dbias a relative backward reduces into dtable.
absl::StatusOr<Tensor> DenseBiasGrad(Ops& ops, const AttentionArgs& args, const char* op) {
  if (!args.bias.defined() || args.bias.numel() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": args.bias must hold the relative bias"));
  }
  return ops.Allocate(DType::kF32, args.bias.shape());
}
}  // namespace

absl::Status Ops::AttentionBackwardRelative(const AttentionArgs& args, const Tensor& q,
                                            const Tensor& k, const Tensor& v, const Tensor& out,
                                            const Tensor& dout, const Tensor& softmax_lse,
                                            const RelativeBuckets& relative, Tensor* dq,
                                            Tensor* dk, Tensor* dv, Tensor* dtable) {
  const char* op = "AttentionBackwardRelative";
  ASSIGN_OR_RETURN(const AttentionArgs made, WithRelativeBiasMadeForBackward(*this, args, q, op));
  ASSIGN_OR_RETURN(Tensor dbias, DenseBiasGrad(*this, made, op));
  RETURN_IF_ERROR(AttentionBackward(made, q, k, v, out, dout, softmax_lse, dq, dk, dv, &dbias));
  return RelativeBiasBackward(dbias, relative.buckets, dtable);
}

absl::Status Ops::AttentionBackwardPackedRelative(const AttentionArgs& args, const Tensor& qkv,
                                                  const Tensor& out, const Tensor& dout,
                                                  const Tensor& softmax_lse,
                                                  const RelativeBuckets& relative, Tensor* dqkv,
                                                  Tensor* dtable) {
  const char* op = "AttentionBackwardPackedRelative";
  ASSIGN_OR_RETURN(const AttentionArgs made,
                   WithRelativeBiasMadeForBackward(*this, args, qkv, op));
  ASSIGN_OR_RETURN(Tensor dbias, DenseBiasGrad(*this, made, op));
  RETURN_IF_ERROR(AttentionBackwardPacked(made, qkv, out, dout, softmax_lse, dqkv, &dbias));
  return RelativeBiasBackward(dbias, relative.buckets, dtable);
}

// ---- jax.numpy ops: both backends override these ------------------------------------
namespace {
absl::Status NotOnThisBackend(const Ops& ops, const char* op) {
  return absl::UnimplementedError(absl::StrCat(op, " is not implemented on ", ops.device_name()));
}
}  // namespace

absl::Status Ops::Binary(const BinaryArgs&, const Tensor&, const Tensor&, Tensor*) {
  return NotOnThisBackend(*this, "Binary");
}
absl::Status Ops::BinaryBackward(const BinaryArgs&, const Tensor&, const Tensor&, const Tensor&,
                                 Tensor*, Tensor*) {
  return NotOnThisBackend(*this, "BinaryBackward");
}
absl::Status Ops::Unary(UnaryOp, const Tensor&, Tensor*) { return NotOnThisBackend(*this, "Unary"); }
absl::Status Ops::UnaryBackward(UnaryOp, const Tensor&, const Tensor&, Tensor*) {
  return NotOnThisBackend(*this, "UnaryBackward");
}
absl::Status Ops::Where(const WhereArgs&, const Tensor&, const Tensor&, const Tensor&, Tensor*) {
  return NotOnThisBackend(*this, "Where");
}
absl::Status Ops::Reduce(ReduceOp, const Tensor&, Tensor*) { return NotOnThisBackend(*this, "Reduce"); }
absl::StatusOr<AttentionArgs> WithRelativeBiasMade(Ops& ops, const AttentionArgs& args,
                                                   int64_t q_seq, DType q_dtype) {
  if (!args.relative_bias.defined()) return args;
  const AttentionArgs::RelativeBiasTable& r = args.relative_bias;
  AttentionArgs made = args;
  made.relative_bias = AttentionArgs::RelativeBiasTable();
  const DType dtype = q_dtype == DType::kBF16 || q_dtype == DType::kF16 ? q_dtype : DType::kF32;
  ASSIGN_OR_RETURN(made.bias, ops.Allocate(dtype, {r.table.dim(0), q_seq, r.buckets.dim(1)}));
  RETURN_IF_ERROR(ops.RelativeBiasForward(r.table, r.buckets, r.first_row, &made.bias));
  return made;
}

absl::Status Ops::AddScalarI32(int32_t, Tensor*) { return NotOnThisBackend(*this, "AddScalarI32"); }
absl::Status Ops::ArgmaxLast(const Tensor&, Tensor*) { return NotOnThisBackend(*this, "ArgmaxLast"); }
absl::Status Ops::Softmax(bool, int, const Tensor&, Tensor*) {
  return NotOnThisBackend(*this, "Softmax");
}
absl::Status Ops::SoftmaxBackward(bool, int, const Tensor&, const Tensor&, Tensor*) {
  return NotOnThisBackend(*this, "SoftmaxBackward");
}
absl::Status Ops::Slice(const Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&,
                        Tensor*) {
  return NotOnThisBackend(*this, "Slice");
}
absl::Status Ops::SliceBackward(const Tensor&, const std::vector<int64_t>&,
                                const std::vector<int64_t>&, Tensor*) {
  return NotOnThisBackend(*this, "SliceBackward");
}

}  // namespace te
