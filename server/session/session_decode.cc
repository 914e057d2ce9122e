// Session: TE's decode (ForwardRequest.decode), the `cache` collection a
// decode step advances as a new version (session.h, contract 11).
//
// A decode step at cache index p writes row p of its cache's keys and values
// and reads rows 0..p (layers::Layer::CacheSpecs). So a version made by a
// step may share the key and value tensors with the version it read: the
// one read holds index p and never reads row p. Each step gets its own
// cache_index tensors (4 bytes each), so every index tensor, once made, is
// never written again. A step copies the keys and values first only where
// another holder of them (a retained version, a kept forward) holds an
// index past p and so reads the row the step would overwrite: a branch, as
// when a client decodes twice from one version. What a version holds of its
// cache is so its rows before its cache_index (AsDecoded): the rows from it
// on are zeros to its readers, as TE's are until a step writes them.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/cache.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"

namespace te::session {
namespace {

constexpr char kIndexLeaf[] = "cache_index";

// The caches in `vars`: one per "cache/<scope>/cache_index".
std::vector<DecodeCache> CachesIn(const layers::Variables& vars) {
  std::vector<DecodeCache> caches;
  const std::string collection = absl::StrCat(layers::kCache, "/");
  for (const auto& [name, tensor] : vars) {
    if (!absl::StartsWith(name, collection) || !absl::EndsWith(name, kIndexLeaf)) continue;
    const std::string prefix = name.substr(0, name.size() - (sizeof(kIndexLeaf) - 1));
    if (!prefix.empty() && prefix.back() != '/') continue;  // "cache/x_cache_index"
    DecodeCache cache;
    cache.index = name;
    cache.key = prefix + "cached_key";
    cache.value = prefix + "cached_value";
    caches.push_back(std::move(cache));
  }
  return caches;
}

const Tensor* Find(const layers::Variables& vars, const std::string& name) {
  auto it = vars.find(name);
  return it == vars.end() ? nullptr : &it->second;
}

}  // namespace

absl::StatusOr<int64_t> CacheRowsHeld(Ops& ops, const layers::Variables& vars,
                                      const std::string& name) {
  const std::string collection = absl::StrCat(layers::kCache, "/");
  if (!absl::StartsWith(name, collection)) return -1;
  std::string prefix;
  for (const char* leaf : {"cached_key", "cached_value"}) {
    if (absl::EndsWith(name, leaf)) prefix = name.substr(0, name.size() - std::strlen(leaf));
  }
  if (prefix.empty() || prefix.back() != '/') return -1;
  const Tensor* rows = Find(vars, name);
  const Tensor* index = Find(vars, prefix + kIndexLeaf);
  if (rows == nullptr || rows->rank() != 4 || index == nullptr || index->dtype() != DType::kI32 ||
      index->numel() != 1) {
    return -1;
  }
  int32_t value = 0;
  RETURN_IF_ERROR(ops.Download(*index, &value));
  return std::min<int64_t>(std::max<int64_t>(value, 0), rows->dim(1));
}

absl::StatusOr<Tensor> Session::AsDecoded(const layers::Variables& vars, const std::string& name,
                                          const Tensor& tensor) {
  ASSIGN_OR_RETURN(const int64_t held, CacheRowsHeld(*ops_, vars, name));
  if (held < 0 || held == tensor.dim(1)) return tensor;
  const int64_t batch = tensor.dim(0), length = tensor.dim(1);
  const int64_t groups = tensor.dim(2), head_dim = tensor.dim(3);
  ASSIGN_OR_RETURN(Tensor out, ops_->Allocate(tensor.dtype(), tensor.shape()));
  RETURN_IF_ERROR(ops_->Fill(0.0f, &out));
  if (held == 0) return out;
  const Tensor from_rows = tensor.Reshaped({batch * length, groups, head_dim});
  const Tensor to_rows = out.Reshaped({batch * length, groups, head_dim});
  std::vector<Tensor> from, to;
  for (int64_t b = 0; b < batch; ++b) {
    from.push_back(from_rows.Slice0(b * length, b * length + held));
    to.push_back(to_rows.Slice0(b * length, b * length + held));
  }
  std::vector<const Tensor*> src;
  std::vector<Tensor*> dst;
  for (size_t i = 0; i < from.size(); ++i) {
    src.push_back(&from[i]);
    dst.push_back(&to[i]);
  }
  RETURN_IF_ERROR(ops_->CopyAll(src, dst));
  return out;
}

absl::StatusOr<DecodeStep> Session::PrepareDecode(const Target& target, layers::Variables* vars) {
  LayerEntry& layer = *target.entry;
  DecodeStep step;
  step.caches = CachesIn(*vars);
  if (step.caches.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "decode: layer ", layer.id, " (", target.layer->type_name(),
        ") has no autoregressive cache (collection cache): InitLayer with decode and the "
        "full-length x creates it"));
  }
  // Every other holder of this layer's tensors.
  std::vector<const layers::Variables*> holders;
  for (const auto& [number, version] : layer.versions) {
    if (number != target.version) holders.push_back(&version.set.vars);
  }
  for (const auto& [id, saved] : saved_) {
    if (saved->layer_id == layer.id) holders.push_back(&saved->base.vars);
  }
  // The indices that decide where each cache may be written in place, read
  // in one copy: the version's own, then those of the holders that share its
  // keys or values under another index tensor.
  struct Sharer {
    size_t cache;
    size_t slot;  // in `indices`; npos: the holder has no index (always copy)
  };
  std::vector<const Tensor*> indices;
  std::vector<Sharer> sharers;
  for (DecodeCache& cache : step.caches) {
    const Tensor* key = Find(*vars, cache.key);
    const Tensor* value = Find(*vars, cache.value);
    if (key == nullptr || value == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "decode: layer ", layer.id, " has ", cache.index, " but not ",
          key == nullptr ? cache.key : cache.value,
          " (a SetVariables left the cache incomplete?); InitLayer with decode creates it whole"));
    }
    const Tensor& index = vars->at(cache.index);
    if (index.dtype() != DType::kI32 || index.numel() != 1) {
      return absl::InvalidArgumentError(absl::StrCat("variable ", cache.index, " is ",
                                                     ShapeString(index.shape()), " ",
                                                     DTypeName(index.dtype()), "; want [] int32"));
    }
    cache.slot = indices.size();
    indices.push_back(&index);
  }
  for (size_t c = 0; c < step.caches.size(); ++c) {
    const DecodeCache& cache = step.caches[c];
    const void* key = vars->at(cache.key).data();
    const void* value = vars->at(cache.value).data();
    const void* own_index = vars->at(cache.index).data();
    for (const layers::Variables* holder : holders) {
      const Tensor* their_key = Find(*holder, cache.key);
      const Tensor* their_value = Find(*holder, cache.value);
      const bool shares = (their_key != nullptr && their_key->data() == key) ||
                          (their_value != nullptr && their_value->data() == value);
      if (!shares) continue;
      const Tensor* their_index = Find(*holder, cache.index);
      if (their_index != nullptr && their_index->data() == own_index) continue;  // same index
      if (their_index == nullptr || their_index->dtype() != DType::kI32 ||
          their_index->numel() != 1) {
        sharers.push_back({c, std::string::npos});
        continue;
      }
      sharers.push_back({c, indices.size()});
      indices.push_back(their_index);
    }
  }
  std::vector<int32_t> values(indices.size());
  {
    ASSIGN_OR_RETURN(Tensor gathered,
                     ops_->Allocate(DType::kI32, {static_cast<int64_t>(indices.size())}));
    std::vector<Tensor> slots;
    slots.reserve(indices.size());
    for (size_t i = 0; i < indices.size(); ++i) {
      slots.push_back(gathered.Slice0(static_cast<int64_t>(i), static_cast<int64_t>(i) + 1));
    }
    std::vector<Tensor*> to;
    for (Tensor& slot : slots) to.push_back(&slot);
    RETURN_IF_ERROR(ops_->CopyAll(indices, to));
    RETURN_IF_ERROR(ops_->Download(gathered, values.data()));
  }
  for (DecodeCache& cache : step.caches) cache.position = values[cache.slot];
  std::vector<bool> branch(step.caches.size(), false);
  for (const Sharer& sharer : sharers) {
    const int64_t theirs = sharer.slot == std::string::npos ? INT64_MAX : values[sharer.slot];
    if (theirs > step.caches[sharer.cache].position) branch[sharer.cache] = true;
  }

  // The step's own tensors, then one copy into them: a fresh index per cache
  // (the layer advances it in place), and the keys and values of a branch.
  std::vector<const Tensor*> from;
  std::vector<Tensor> made;
  std::vector<std::string> names;
  auto own = [&](const std::string& name) -> absl::Status {
    const Tensor& original = vars->at(name);
    absl::StatusOr<Tensor> copy = ops_->Allocate(original.dtype(), original.shape());
    if (!copy.ok()) {
      if (!absl::IsResourceExhausted(copy.status())) return copy.status();
      return absl::ResourceExhaustedError(absl::StrCat(
          "decode: the step needs its own copy of ", name, " (", original.nbytes(),
          " bytes; another retained version decodes from it further), and that does not fit: ",
          copy.status().message(), "; release versions no longer used (ReleaseVersions)"));
    }
    from.push_back(&original);
    made.push_back(*std::move(copy));
    names.push_back(name);
    return absl::OkStatus();
  };
  for (size_t c = 0; c < step.caches.size(); ++c) {
    const DecodeCache& cache = step.caches[c];
    RETURN_IF_ERROR(own(cache.index));
    if (branch[c]) {
      RETURN_IF_ERROR(own(cache.key));
      RETURN_IF_ERROR(own(cache.value));
      ++step.branched;
    }
  }
  std::vector<Tensor*> to;
  for (Tensor& t : made) to.push_back(&t);
  RETURN_IF_ERROR(ops_->CopyAll(from, to));
  for (size_t i = 0; i < names.size(); ++i) (*vars)[names[i]] = std::move(made[i]);

  // One index for every cache (the usual case) spares each attention its own
  // read of it.
  step.common_index = step.caches.front().position;
  for (const DecodeCache& cache : step.caches) {
    if (cache.position != step.common_index) step.common_index = -1;
  }
  // The lengths of a one-token step at that index (q 1, kv index + 1), in
  // one upload for all the attentions, each of which also advances its
  // cache_index from them on the device. (A step whose x is not what TE
  // decodes is refused by the layers; caches at different indices upload
  // their own lengths.)
  step.context = std::make_shared<layers::DecodeContext>();
  const Tensor& key = vars->at(step.caches.front().key);
  if (step.common_index >= 0 && key.rank() == 4) {
    RETURN_IF_ERROR(step.context->Reserve(*ops_, key.dim(0), {1, step.common_index + 1}));
  }
  return step;
}

}  // namespace te::session
