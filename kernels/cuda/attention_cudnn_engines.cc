// Which cuDNN engine config runs an attention graph (attention_cudnn_graph.h's
// MakePlan), and the candidates a probe can time against that choice
// (bench/kernels/cudnn_engine_probe).
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/attention_cudnn_graph.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace cudnn_graph {
namespace {

std::mutex probe_mu;
int probe_index = -1;
EngineChoice last_choice;

void Record(int candidates, std::string description) {
  std::lock_guard<std::mutex> lock(probe_mu);
  last_choice.candidates = candidates;
  last_choice.description = std::move(description);
}

// Heuristic mode `mode`'s engine configs for graph, best first.
absl::Status HeuristicConfigs(cudnnBackendDescriptor_t graph, cudnnBackendHeurMode_t mode,
                              DescriptorSet& set, std::vector<cudnnBackendDescriptor_t>* out) {
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t heuristics,
                   set.Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR));
  RETURN_IF_ERROR(SetDesc(heuristics, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, "heuristics"));
  RETURN_IF_ERROR(
      Set(heuristics, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics"));
  RETURN_IF_ERROR(Finalize(heuristics, "the engine heuristics"));
  int64_t count = 0;
  cudnnStatus_t status = cudnnBackendGetAttribute(
      heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
  if (status != CUDNN_STATUS_SUCCESS) return Declined("counting engine configs", status);
  if (count <= 0) return absl::OkStatus();
  std::vector<cudnnBackendDescriptor_t> configs(static_cast<size_t>(count));
  for (auto& config : configs) {
    ASSIGN_OR_RETURN(config, set.Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
  }
  int64_t returned = 0;
  status =
      cudnnBackendGetAttribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned, configs.data());
  if (status != CUDNN_STATUS_SUCCESS) return Declined("reading engine configs", status);
  out->insert(out->end(), configs.begin(), configs.begin() + returned);
  return absl::OkStatus();
}

// The plan of config, or UNIMPLEMENTED where it does not finalize.
absl::Status TryPlan(cudnnHandle_t handle, cudnnBackendDescriptor_t config, CudnnPlan* plan) {
  DescriptorSet& set = plan->descriptors;
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t made, set.Make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR));
  RETURN_IF_ERROR(
      Set(made, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "plan"));
  RETURN_IF_ERROR(SetDesc(made, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config, "plan"));
  const cudnnStatus_t finalized = cudnnBackendFinalize(made);
  if (finalized != CUDNN_STATUS_SUCCESS) {
    set.Destroy(made);
    return Declined("the plan", finalized);
  }
  int64_t workspace = 0;
  int64_t got = 0;
  const cudnnStatus_t status = cudnnBackendGetAttribute(
      made, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got, &workspace);
  if (status != CUDNN_STATUS_SUCCESS) return Declined("reading the plan's workspace", status);
  plan->plan = made;
  plan->workspace_bytes = workspace;
  return absl::OkStatus();
}

struct EngineOf {
  int64_t global_index = -1;
  std::map<int, int64_t> knobs;  // cudnnBackendKnobType_t -> value
};

absl::StatusOr<EngineOf> ReadConfig(cudnnBackendDescriptor_t config, DescriptorSet& set) {
  EngineOf e;
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t engine, set.Make(CUDNN_BACKEND_ENGINE_DESCRIPTOR));
  int64_t n = 0;
  cudnnStatus_t status = cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE,
                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &engine);
  if (status != CUDNN_STATUS_SUCCESS) return Declined("reading a config's engine", status);
  status = cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1,
                                    &n, &e.global_index);
  if (status != CUDNN_STATUS_SUCCESS) return Declined("reading an engine's index", status);
  std::vector<cudnnBackendDescriptor_t> choices(CUDNN_KNOB_TYPE_COUNTS);
  for (auto& c : choices) {
    ASSIGN_OR_RETURN(c, set.Make(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR));
  }
  status = cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES,
                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, CUDNN_KNOB_TYPE_COUNTS, &n,
                                    choices.data());
  if (status != CUDNN_STATUS_SUCCESS) return Declined("reading a config's knobs", status);
  for (int64_t i = 0; i < n; ++i) {
    cudnnBackendKnobType_t type;
    int64_t value = 0, got = 0;
    if (cudnnBackendGetAttribute(choices[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
                                 CUDNN_TYPE_KNOB_TYPE, 1, &got, &type) != CUDNN_STATUS_SUCCESS ||
        cudnnBackendGetAttribute(choices[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64,
                                 1, &got, &value) != CUDNN_STATUS_SUCCESS) {
      return absl::UnimplementedError("reading a knob choice");
    }
    e.knobs[static_cast<int>(type)] = value;
  }
  return e;
}

// A finalized engine of graph by its global index.
absl::StatusOr<cudnnBackendDescriptor_t> MakeEngine(cudnnBackendDescriptor_t graph,
                                                    int64_t global_index, DescriptorSet& set) {
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t engine, set.Make(CUDNN_BACKEND_ENGINE_DESCRIPTOR));
  RETURN_IF_ERROR(SetDesc(engine, CUDNN_ATTR_ENGINE_OPERATION_GRAPH, graph, "engine"));
  RETURN_IF_ERROR(Set(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &global_index,
                      "engine"));
  RETURN_IF_ERROR(Finalize(engine, "engine"));
  return engine;
}

struct KnobRange {
  int type;
  int64_t min, max, stride;
};

absl::StatusOr<std::vector<KnobRange>> KnobRanges(cudnnBackendDescriptor_t graph,
                                                  int64_t global_index, DescriptorSet& set) {
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t engine, MakeEngine(graph, global_index, set));
  std::vector<cudnnBackendDescriptor_t> infos(CUDNN_KNOB_TYPE_COUNTS);
  for (auto& info : infos) {
    ASSIGN_OR_RETURN(info, set.Make(CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR));
  }
  int64_t n = 0;
  const cudnnStatus_t status =
      cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_KNOB_INFO, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                               CUDNN_KNOB_TYPE_COUNTS, &n, infos.data());
  if (status != CUDNN_STATUS_SUCCESS) return Declined("reading an engine's knobs", status);
  std::vector<KnobRange> ranges;
  for (int64_t i = 0; i < n; ++i) {
    cudnnBackendKnobType_t type;
    KnobRange r{};
    int64_t got = 0;
    if (cudnnBackendGetAttribute(infos[i], CUDNN_ATTR_KNOB_INFO_TYPE, CUDNN_TYPE_KNOB_TYPE, 1,
                                 &got, &type) != CUDNN_STATUS_SUCCESS ||
        cudnnBackendGetAttribute(infos[i], CUDNN_ATTR_KNOB_INFO_MINIMUM_VALUE, CUDNN_TYPE_INT64,
                                 1, &got, &r.min) != CUDNN_STATUS_SUCCESS ||
        cudnnBackendGetAttribute(infos[i], CUDNN_ATTR_KNOB_INFO_MAXIMUM_VALUE, CUDNN_TYPE_INT64,
                                 1, &got, &r.max) != CUDNN_STATUS_SUCCESS ||
        cudnnBackendGetAttribute(infos[i], CUDNN_ATTR_KNOB_INFO_STRIDE, CUDNN_TYPE_INT64, 1, &got,
                                 &r.stride) != CUDNN_STATUS_SUCCESS) {
      return absl::UnimplementedError("reading a knob's range");
    }
    r.type = static_cast<int>(type);
    ranges.push_back(r);
  }
  return ranges;
}

// A finalized config of engine global_index with these knob values, or
// nullptr where cuDNN refuses it.
absl::StatusOr<cudnnBackendDescriptor_t> MakeConfig(cudnnBackendDescriptor_t graph,
                                                    const EngineOf& e, DescriptorSet& set) {
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t engine, MakeEngine(graph, e.global_index, set));
  std::vector<cudnnBackendDescriptor_t> choices;
  for (const auto& [type_int, value] : e.knobs) {
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t c, set.Make(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR));
    const auto type = static_cast<cudnnBackendKnobType_t>(type_int);
    RETURN_IF_ERROR(
        Set(c, CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &type, "knob choice"));
    RETURN_IF_ERROR(
        Set(c, CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &value, "knob choice"));
    if (cudnnBackendFinalize(c) != CUDNN_STATUS_SUCCESS) return nullptr;
    choices.push_back(c);
  }
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t config, set.Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
  RETURN_IF_ERROR(SetDesc(config, CUDNN_ATTR_ENGINECFG_ENGINE, engine, "engine config"));
  if (!choices.empty()) {
    RETURN_IF_ERROR(Set(config, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                        static_cast<int64_t>(choices.size()), choices.data(), "engine config"));
  }
  if (cudnnBackendFinalize(config) != CUDNN_STATUS_SUCCESS) return nullptr;
  return config;
}

}  // namespace

void SetEngineCandidate(int index) {
  std::lock_guard<std::mutex> lock(probe_mu);
  probe_index = index;
}

EngineChoice LastEngineChoice() {
  std::lock_guard<std::mutex> lock(probe_mu);
  return last_choice;
}

std::string DescribeEngineConfig(cudnnBackendDescriptor_t config) {
  if (config == nullptr) return "(refused by cuDNN)";
  DescriptorSet set;
  auto e = ReadConfig(config, set);
  if (!e.ok()) return std::string(e.status().message());
  std::vector<std::string> knobs;
  for (const auto& [type, value] : e->knobs) knobs.push_back(absl::StrCat(type, "=", value));
  return absl::StrCat("engine ", e->global_index, " knobs ", absl::StrJoin(knobs, ","));
}

absl::StatusOr<std::vector<cudnnBackendDescriptor_t>> EngineCandidates(
    cudnnBackendDescriptor_t graph, DescriptorSet& set) {
  std::vector<cudnnBackendDescriptor_t> out;
  for (cudnnBackendHeurMode_t mode :
       {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_B, CUDNN_HEUR_MODE_FALLBACK}) {
    // A mode that cannot serve the graph adds nothing.
    (void)HeuristicConfigs(graph, mode, set, &out);
  }
  if (out.empty()) return out;
  ASSIGN_OR_RETURN(const EngineOf first, ReadConfig(out.front(), set));
  ASSIGN_OR_RETURN(const std::vector<KnobRange> ranges,
                   KnobRanges(graph, first.global_index, set));
  for (const KnobRange& r : ranges) {
    const int64_t stride = r.stride > 0 ? r.stride : 1;
    const auto chosen = first.knobs.find(r.type);
    int made = 0;
    for (int64_t v = r.min; v <= r.max && made < kMaxKnobValues; v += stride, ++made) {
      if (chosen != first.knobs.end() && chosen->second == v) continue;
      EngineOf variant = first;
      variant.knobs[r.type] = v;
      ASSIGN_OR_RETURN(cudnnBackendDescriptor_t config, MakeConfig(graph, variant, set));
      out.push_back(config);
    }
  }
  return out;
}

absl::Status MakePlan(cudnnHandle_t handle, cudnnBackendDescriptor_t graph, CudnnPlan* plan) {
  int index;
  {
    std::lock_guard<std::mutex> lock(probe_mu);
    index = probe_index;
  }
  DescriptorSet& set = plan->descriptors;
  if (index >= 0) {
    ASSIGN_OR_RETURN(const std::vector<cudnnBackendDescriptor_t> candidates,
                     EngineCandidates(graph, set));
    const int count = static_cast<int>(candidates.size());
    if (index >= count || candidates[index] == nullptr) {
      Record(count, index >= count ? "(past the last candidate)" : "(refused by cuDNN)");
      return absl::UnimplementedError(absl::StrCat("engine candidate ", index, " of ", count));
    }
    const absl::Status made = TryPlan(handle, candidates[index], plan);
    Record(count, made.ok() ? DescribeEngineConfig(candidates[index])
                            : absl::StrCat("(no plan: ", made.message(), ")"));
    return made;
  }
  std::vector<cudnnBackendDescriptor_t> configs;
  RETURN_IF_ERROR(HeuristicConfigs(graph, CUDNN_HEUR_MODE_A, set, &configs));
  if (configs.empty()) return absl::UnimplementedError("no cuDNN engine supports this graph");
  absl::Status last;
  for (cudnnBackendDescriptor_t config : configs) {
    last = TryPlan(handle, config, plan);
    if (last.ok()) {
      Record(0, DescribeEngineConfig(config));
      return last;
    }
    if (!absl::IsUnimplemented(last)) return last;
  }
  return absl::UnimplementedError(absl::StrCat("none of ", configs.size(),
                                               " engine configs made a plan: ", last.message()));
}

}  // namespace cudnn_graph
}  // namespace cuda
}  // namespace te
