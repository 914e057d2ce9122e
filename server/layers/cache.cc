#include "server/layers/cache.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/variables.h"

namespace te::layers {

KvCacheNames KvCacheNamesAt(absl::string_view scope) {
  return {VariableName(kCache, scope, "cached_key"), VariableName(kCache, scope, "cached_value"),
          VariableName(kCache, scope, "cache_index")};
}

std::vector<VariableSpec> KvCacheSpecs(absl::string_view scope, int64_t batch, int64_t length,
                                       int64_t groups, int64_t head_dim, DType dtype) {
  const KvCacheNames names = KvCacheNamesAt(scope);
  const Shape shape = {batch, length, groups, head_dim};
  return {{names.key, shape, dtype}, {names.value, shape, dtype}, {names.index, {}, DType::kI32}};
}

absl::Status CheckCacheDType(DType dtype) {
  if (IsFloating(dtype) && !IsFloat8(dtype)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("x.dtype: ", DTypeName(dtype),
                   "; the cache holds keys and values in x's float dtype (float32, bfloat16 or "
                   "float16)"));
}

absl::Status InitCache(Ops& ops, const std::vector<VariableSpec>& specs, Variables* vars) {
  for (const VariableSpec& spec : specs) {
    ASSIGN_OR_RETURN(Tensor t, ops.Allocate(spec.dtype, spec.shape));
    if (IsFloating(spec.dtype)) {
      RETURN_IF_ERROR(ops.Fill(0.0f, &t));
    } else {
      const std::vector<char> zeros(t.nbytes(), 0);
      RETURN_IF_ERROR(ops.Upload(zeros.data(), &t));
    }
    (*vars)[spec.name] = t;
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<Tensor> CacheVariable(const Variables& vars, const std::string& name) {
  auto it = vars.find(name);
  if (it == vars.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "decode: the layer was initialised without an autoregressive cache (collection ", kCache,
        ", missing ", name, "): init with decode and the full-length x"));
  }
  return it->second;
}

absl::Status CheckCacheVariable(const Tensor& t, const std::string& name, const Shape& want,
                                DType dtype) {
  if (t.rank() != 4 || t.dim(0) != want[0] || t.dim(2) != want[2] || t.dim(3) != want[3] ||
      t.dim(1) < 1 || t.dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "variable ", name, " is ", ShapeString(t.shape()), " ", DTypeName(t.dtype()),
        " but this decode step needs [", want[0], ", length, ", want[2], ", ", want[3], "] ",
        DTypeName(dtype), " (TE: \"Autoregressive cache shape error\"): x does not fit the cache"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> ReadKvCacheIndex(Ops& ops, const Variables& vars, absl::string_view scope,
                                         int64_t known_index) {
  const std::string name = KvCacheNamesAt(scope).index;
  ASSIGN_OR_RETURN(const Tensor index, CacheVariable(vars, name));
  if (index.numel() != 1 || index.dtype() != DType::kI32) {
    return absl::InvalidArgumentError(absl::StrCat("variable ", name, " is ",
                                                   ShapeString(index.shape()), " ",
                                                   DTypeName(index.dtype()), "; want [] int32"));
  }
  if (known_index >= 0) return known_index;
  int32_t value = 0;
  RETURN_IF_ERROR(ops.Download(index, &value));
  return value;
}

absl::StatusOr<KvCache> OpenKvCache(Ops& ops, const Variables& vars, absl::string_view scope,
                                    int64_t batch, int64_t tokens, int64_t groups,
                                    int64_t head_dim, DType dtype, int64_t known_index) {
  KvCache cache;
  cache.names = KvCacheNamesAt(scope);
  cache.tokens = tokens;
  ASSIGN_OR_RETURN(cache.key, CacheVariable(vars, cache.names.key));
  ASSIGN_OR_RETURN(cache.value, CacheVariable(vars, cache.names.value));
  ASSIGN_OR_RETURN(cache.index, CacheVariable(vars, cache.names.index));
  const Shape want = {batch, 0, groups, head_dim};
  RETURN_IF_ERROR(CheckCacheVariable(cache.key, cache.names.key, want, dtype));
  RETURN_IF_ERROR(CheckCacheVariable(cache.value, cache.names.value, want, dtype));
  if (cache.value.shape() != cache.key.shape()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "variable ", cache.names.value, " is ", ShapeString(cache.value.shape()), " but ",
        cache.names.key, " is ", ShapeString(cache.key.shape()), ": they must match"));
  }
  ASSIGN_OR_RETURN(cache.position, ReadKvCacheIndex(ops, vars, scope, known_index));
  if (cache.position < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(cache.names.index, " is ", cache.position, ": an index must be >= 0"));
  }
  if (cache.position + tokens > cache.length()) {
    return absl::InvalidArgumentError(absl::StrCat(
        cache.names.index, " is ", cache.position, " and the step brings ", tokens,
        tokens == 1 ? " token" : " tokens", ", but the cache holds ", cache.length(),
        " positions (init's length): init with a longer x to decode further"));
  }
  return cache;
}

absl::Status WriteKvRows(Ops& ops, const Tensor& k, const Tensor& v, const KvCache& cache,
                         const Tensor& position) {
  const int64_t batch = cache.key.dim(0), tokens = cache.tokens;
  const int64_t groups = cache.key.dim(2), head_dim = cache.key.dim(3);
  const Shape step = {batch, tokens, groups, head_dim};
  for (const Tensor* t : {&k, &v}) {
    if (t->shape() != step || t->dtype() != cache.key.dtype()) {
      return absl::InternalError(absl::StrCat("decode: new keys or values are ",
                                              ShapeString(t->shape()), " ",
                                              DTypeName(t->dtype()), "; the cache takes ",
                                              ShapeString(step), " ",
                                              DTypeName(cache.key.dtype())));
    }
  }
  Tensor key = cache.key, value = cache.value;
  RETURN_IF_ERROR(ops.CopyRowsAt(k, position, &key));
  return ops.CopyRowsAt(v, position, &value);
}

absl::Status CheckQkvRows(const Tensor& qkv, const KvCache& cache) {
  const int64_t batch = cache.key.dim(0), tokens = cache.tokens;
  const Shape step = {batch, tokens, 3, cache.key.dim(2), cache.key.dim(3)};
  if (qkv.shape() != step || qkv.dtype() != cache.key.dtype()) {
    return absl::InternalError(absl::StrCat("decode: the new rows are ", ShapeString(qkv.shape()),
                                            " ", DTypeName(qkv.dtype()), "; the cache takes ",
                                            ShapeString(step), " ",
                                            DTypeName(cache.key.dtype())));
  }
  return absl::OkStatus();
}

absl::Status DecodeContext::Reserve(Ops& ops, int64_t batch, const std::vector<int64_t>& values) {
  if (batch < 1 || values.empty()) return absl::OkStatus();
  const int64_t rows = static_cast<int64_t>(values.size());
  std::vector<int32_t> host;
  host.reserve(static_cast<size_t>(rows * batch));
  for (int64_t v : values) {
    host.insert(host.end(), static_cast<size_t>(batch), static_cast<int32_t>(v));
  }
  ASSIGN_OR_RETURN(Tensor table, ops.Allocate(DType::kI32, {rows, batch}));
  RETURN_IF_ERROR(ops.Upload(host.data(), &table));
  ++uploads_;
  for (int64_t i = 0; i < rows; ++i) {
    lengths_[{batch, values[i]}] = table.Slice0(i, i + 1).Reshaped({batch});
  }
  return absl::OkStatus();
}

absl::Status DecodeContext::SetStep(Ops& ops, int64_t batch, int64_t position, int64_t tokens) {
  if (!step_.defined() || step_.dim(0) != 1 + batch) {
    ASSIGN_OR_RETURN(step_, ops.Allocate(DType::kI32, {1 + batch}));
  }
  std::vector<int32_t> host(static_cast<size_t>(1 + batch),
                            static_cast<int32_t>(position + tokens));
  host[0] = static_cast<int32_t>(position);
  RETURN_IF_ERROR(ops.Upload(host.data(), &step_));
  ++uploads_;
  return absl::OkStatus();
}

absl::Status DecodeContext::AdvanceOneToken(Ops& ops) {
  if (!step_.defined()) {
    return absl::FailedPreconditionError("DecodeContext::AdvanceOneToken before SetStep");
  }
  Tensor state = step_;
  return ops.AddScalarI32(1, &state);
}

Tensor DecodePosition(const Tensor& cache_index, const DecodeContext* context) {
  return context != nullptr && context->has_step() ? context->step_position() : cache_index;
}

absl::StatusOr<Tensor> DecodeContext::Lengths(Ops& ops, int64_t batch, int64_t value) {
  auto it = lengths_.find({batch, value});
  if (it != lengths_.end()) return it->second;
  const std::vector<int32_t> host(static_cast<size_t>(batch), static_cast<int32_t>(value));
  ASSIGN_OR_RETURN(Tensor lengths, ops.Allocate(DType::kI32, {batch}));
  RETURN_IF_ERROR(ops.Upload(host.data(), &lengths));
  ++uploads_;
  lengths_[{batch, value}] = lengths;
  return lengths;
}

absl::Status AdvanceKvCache(Ops& ops, const KvCache& cache, DecodeContext& context) {
  if (!context.write_index) return absl::OkStatus();
  // Row position + tokens of the lengths the step's attention read already.
  ASSIGN_OR_RETURN(const Tensor next,
                   context.Lengths(ops, cache.key.dim(0), cache.position + cache.tokens));
  Tensor index = cache.index;
  return ops.Copy(next.Slice0(0, 1).Reshaped(index.shape()), &index);
}

absl::StatusOr<KvView> VisibleKv(Ops& ops, const KvCache& cache, DecodeContext& context) {
  KvView view;
  const int64_t batch = cache.key.dim(0), tokens = cache.tokens;
  view.key = cache.key;
  view.value = cache.value;
  view.mask = tokens == 1            ? MaskType::kPadding
              : cache.position == 0 ? MaskType::kPaddingCausal
                                    : MaskType::kPaddingCausalBottomRight;
  ASSIGN_OR_RETURN(view.q_seqlens, context.Lengths(ops, batch, tokens));
  if (context.has_step()) {
    view.kv_seqlens = context.step_kv_lengths();
  } else {
    ASSIGN_OR_RETURN(view.kv_seqlens, context.Lengths(ops, batch, cache.position + tokens));
  }
  return view;
}

}  // namespace te::layers
