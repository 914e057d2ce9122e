#include "server/layers/fp8_weight_cache.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "kernels/status_macros.h"
#include "server/layers/variables.h"

namespace te::layers {
namespace {

// The module's variable "<collection>/<rest>" as its layer names it when the
// module's variables are under `scope` ("fp8_metas/mlp/wi_kernel_scale" in
// "TransformerLayer_0": "fp8_metas/TransformerLayer_0/mlp/wi_kernel_scale"),
// as a graph scopes its module nodes' variables.
std::string InLayer(const std::string& scope, const std::string& name) {
  const size_t slash = name.find('/');
  if (slash == std::string::npos) return JoinScope(scope, name);
  return VariableName(name.substr(0, slash), scope, name.substr(slash + 1));
}

}  // namespace

absl::StatusOr<GemmOperand> Fp8WeightCache::Quantize(Ops& ops, const Fp8Recipe& fp8,
                                                     const QuantizerSet& set,
                                                     const Tensor& weight, Variables* vars) {
  if (weight.rank() != 2) {
    return absl::InternalError("Fp8WeightCache: a GEMM kernel must be 2-D");
  }
  RETURN_IF_ERROR(CheckQuantizerSet(*vars, set, &fp8));
  const DType dtype = QuantizerDType(fp8, QuantizerRole::kKernel);
  const Key key{weight.data(), weight.dim(0), weight.dim(1), dtype};
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    Entry entry;
    entry.weight = weight;
    ASSIGN_OR_RETURN(entry.op.data, ops.Allocate(dtype, weight.shape()));
    ASSIGN_OR_RETURN(entry.op.data_t, ops.Allocate(dtype, {weight.dim(1), weight.dim(0)}));
    ASSIGN_OR_RETURN(entry.op.scale_inv, ops.Allocate(DType::kF32, {1}));
    ASSIGN_OR_RETURN(entry.kept.scale, ops.Allocate(DType::kF32, {1}));
    ASSIGN_OR_RETURN(entry.kept.amax, ops.Allocate(DType::kF32, {1}));
    // NaN equals no scale: the first use quantizes.
    RETURN_IF_ERROR(ops.Fill(std::numeric_limits<float>::quiet_NaN(), &entry.kept.scale));
    it = entries_.emplace(key, std::move(entry)).first;
    pending_.push_back(key);
  }
  Entry& entry = it->second;
  // The scale and amax history by the layer's names, which the update
  // (CopiesForUpdate) and the forward's batched check (CheckBeforeForward) look
  // up in the layer's variables: a graph's module knows them by its own.
  const auto in_layer = [&](const std::string& own) {
    return fp8.variables_scope.empty() ? own : InLayer(fp8.variables_scope, own);
  };
  const std::string scale_name = in_layer(set.ScaleName(QuantizerRole::kKernel));
  entry.history_name = in_layer(set.HistoryName(QuantizerRole::kKernel));
  entry.used_in_call = call_;
  GemmOperand out = entry.op;
  out.transpose = false;
  // Inference moves no scale and writes no weight: a copy checked in this
  // call for this scale is still current.
  if (fp8.inference && entry.checked_in_call == call_ && entry.scale_name == scale_name) {
    return out;
  }
  entry.scale_name = scale_name;
  Fp8Output side;
  side.scale = vars->at(set.ScaleName(QuantizerRole::kKernel));
  side.amax = vars->at(set.HistoryName(QuantizerRole::kKernel)).Slice0(0, 1);  // history[0]
  side.scale_inv = entry.op.scale_inv;
  const bool checked = entry.checked_scale != nullptr &&
                       entry.checked_scale == side.scale.data() &&
                       entry.checked_amax == side.amax.data();
  // A check serves one read: a second read of the weight in this call checks again.
  entry.checked_scale = entry.checked_amax = nullptr;
  if (!checked) {
    RETURN_IF_ERROR(
        ops.QuantizeTransposeKept(weight, side, entry.kept, &entry.op.data, &entry.op.data_t));
  }
  entry.checked_in_call = call_;
  return out;
}

absl::Status Fp8WeightCache::CheckBeforeForward(Ops& ops, const Fp8Recipe& fp8,
                                                const Variables& vars) {
  ForgetChecks();
  if (fp8.inference || fp8.kind != Fp8Recipe::Kind::kDelayedScaling) return absl::OkStatus();
  uint64_t last = 0;
  for (const auto& [key, entry] : entries_) last = std::max(last, entry.used_in_call);
  if (last == 0) return absl::OkStatus();
  // Each copy's scale and amax slot as the layer names them; copies whose
  // amax slot is another's (one param read in two shapes) are left to their
  // own Quantize, which records them in the forward's order.
  struct Found {
    Entry* entry;
    Tensor scale;
    Tensor amax;
  };
  std::vector<Found> found;
  std::map<const void*, int> amax_users;
  for (auto& [key, entry] : entries_) {
    if (entry.used_in_call != last) continue;
    const auto scale = vars.find(entry.scale_name);
    const auto history = vars.find(entry.history_name);
    if (scale == vars.end() || history == vars.end()) continue;
    const Tensor& s = scale->second;
    const Tensor& h = history->second;
    if (s.dtype() != DType::kF32 || s.numel() != 1 || h.dtype() != DType::kF32 ||
        h.rank() != 1 || h.dim(0) < 1) {
      continue;
    }
    found.push_back({&entry, s, h.Slice0(0, 1)});
    ++amax_users[h.data()];
  }
  std::vector<Ops::KeptQuantizeItem> items;
  std::vector<const Found*> checked;
  for (const Found& f : found) {
    if (amax_users[f.amax.data()] != 1) continue;
    Ops::KeptQuantizeItem item;
    item.x = f.entry->weight;
    item.fp8.scale = f.scale;
    item.fp8.amax = f.amax;
    item.fp8.scale_inv = f.entry->op.scale_inv;
    item.kept = f.entry->kept;
    item.y = f.entry->op.data;
    item.y_t = f.entry->op.data_t;
    items.push_back(std::move(item));
    checked.push_back(&f);
  }
  RETURN_IF_ERROR(ops.QuantizeTransposeKeptMany(items));
  for (const Found* f : checked) {
    f->entry->checked_scale = f->scale.data();
    f->entry->checked_amax = f->amax.data();
  }
  return absl::OkStatus();
}

void Fp8WeightCache::ForgetChecks() {
  for (auto& [key, entry] : entries_) entry.checked_scale = entry.checked_amax = nullptr;
}

std::map<const void*, OptimizerFp8Copy> Fp8WeightCache::CopiesForUpdate(const Variables& vars) {
  ForgetChecks();
  std::map<const void*, const Tensor*> params;  // by storage
  for (const auto& [name, t] : vars) {
    if (absl::StartsWith(name, "params/") && t.data() != nullptr) params[t.data()] = &t;
  }
  std::map<const void*, int> copies_of;
  for (const auto& [key, entry] : entries_) ++copies_of[std::get<0>(key)];
  std::map<const void*, OptimizerFp8Copy> out;
  for (auto it = entries_.begin(); it != entries_.end();) {
    const Entry& entry = it->second;
    const void* data = entry.weight.data();
    auto param = params.find(data);
    auto scale = vars.find(entry.scale_name);
    const bool updatable = param != params.end() &&
                           param->second->numel() == entry.weight.numel() &&
                           copies_of[data] == 1 && scale != vars.end() &&
                           scale->second.dtype() == DType::kF32 && scale->second.numel() == 1;
    if (!updatable) {
      it = entries_.erase(it);
      continue;
    }
    OptimizerFp8Copy& copy = out[data];
    copy.data = entry.op.data;
    copy.data_t = entry.op.data_t;
    copy.scale_inv = entry.op.scale_inv;
    copy.kept_scale = entry.kept.scale;
    copy.kept_amax = entry.kept.amax;
    copy.scale = scale->second;
    ++it;
  }
  return out;
}

const GemmOperand* Fp8WeightCache::Find(const Tensor& weight, DType dtype) const {
  if (weight.rank() != 2) return nullptr;
  auto it = entries_.find(Key{weight.data(), weight.dim(0), weight.dim(1), dtype});
  return it == entries_.end() ? nullptr : &it->second.op;
}

Fp8WeightCache::Call::~Call() {
  cache_->ForgetChecks();
  if (!committed_) {
    for (const Key& key : cache_->pending_) cache_->entries_.erase(key);
  }
  cache_->pending_.clear();
}

int64_t Fp8WeightCache::bytes() const {
  int64_t total = 0;
  for (const auto& [key, entry] : entries_) {
    total += entry.op.bytes() + TensorBytes(entry.kept.scale) + TensorBytes(entry.kept.amax);
  }
  return total;
}

absl::StatusOr<GemmOperand> QuantizeKernelOperand(Ops& ops, const Fp8Recipe& fp8,
                                                  const QuantizerSet& set, const Tensor& weight,
                                                  Variables* vars) {
  if (fp8.weight_cache != nullptr && fp8.kind == Fp8Recipe::Kind::kDelayedScaling) {
    return fp8.weight_cache->Quantize(ops, fp8, set, weight, vars);
  }
  return QuantizeGemmOperandBothLayouts(ops, fp8, set, QuantizerRole::kKernel, weight,
                                        GemmSide::kB, false, vars);
}

}  // namespace te::layers
