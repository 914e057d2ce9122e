// A kernel timeline for machines without Nsight Systems: a CUPTI activity
// tracer that the CUDA driver loads into any process started with
//
//   CUDA_INJECTION64_PATH=/path/libkernel_trace.so KERNEL_TRACE_OUT=trace.csv PROGRAM ...
//
// It records every kernel, memcpy and memset with its device start and end,
// and every CUDA runtime and driver API call with its host start and end, on
// one clock (CUPTI's), and writes them as CSV at exit:
//
//   kind,name,start_ns,end_ns,stream,correlation
//
// kind is kernel / memcpy / memset / runtime / driver. bench/tools/
// kernel_trace_report.py turns that into the step's busy time, its idle gaps
// and the host calls made during each gap. The records are buffered in memory
// (about 100 bytes each) and written once, so tracing costs the traced
// program little beyond CUPTI's own per-launch overhead.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8 << 20;

struct Record {
  const char* kind;
  std::string name;
  uint64_t start, end;
  uint32_t stream, correlation;
};

std::mutex mu;
std::vector<Record>* records = new std::vector<Record>();  // never freed: used at exit

std::string Demangle(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  char* out = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = status == 0 && out != nullptr ? out : name;
  std::free(out);
  // The parameter list adds nothing to a kernel's name: drop it (the last
  // balanced "(...)"; "(anonymous namespace)" earlier in the name stays).
  if (!s.empty() && s.back() == ')') {
    int depth = 0;
    for (size_t i = s.size(); i-- > 0;) {
      if (s[i] == ')') ++depth;
      if (s[i] == '(' && --depth == 0) {
        s.resize(i);
        break;
      }
    }
  }
  if (s.rfind("void ", 0) == 0) s.erase(0, 5);
  for (char& c : s) {
    if (c == ',') c = ';';
  }
  return s;
}

std::string ApiName(CUpti_CallbackDomain domain, CUpti_CallbackId cbid) {
  const char* name = nullptr;
  if (cuptiGetCallbackName(domain, cbid, &name) != CUPTI_SUCCESS || name == nullptr) return "?";
  return name;
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Record> batch;
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(record);
        batch.push_back({"kernel", Demangle(k->name), k->start, k->end, k->streamId,
                         k->correlationId});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(record);
        batch.push_back({"memcpy", "memcpy_kind" + std::to_string(m->copyKind) + "_" +
                                       std::to_string(m->bytes) + "B",
                         m->start, m->end, m->streamId, m->correlationId});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(record);
        batch.push_back({"memset", "memset_" + std::to_string(m->bytes) + "B", m->start, m->end,
                         m->streamId, m->correlationId});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        auto* a = reinterpret_cast<CUpti_ActivityAPI*>(record);
        const bool runtime = record->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
        batch.push_back({runtime ? "runtime" : "driver",
                         ApiName(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API,
                                 a->cbid),
                         a->start, a->end, a->threadId, a->correlationId});
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(mu);
  records->insert(records->end(), batch.begin(), batch.end());
}

void WriteAtExit() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  const char* path = std::getenv("KERNEL_TRACE_OUT");
  FILE* f = std::fopen(path != nullptr ? path : "kernel_trace.csv", "w");
  if (f == nullptr) return;
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(f, "kind,name,start_ns,end_ns,stream,correlation\n");
  for (const Record& r : *records) {
    std::fprintf(f, "%s,%s,%llu,%llu,%u,%u\n", r.kind, r.name.c_str(),
                 static_cast<unsigned long long>(r.start), static_cast<unsigned long long>(r.end),
                 r.stream, r.correlation);
  }
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu records written\n", records->size());
}

}  // namespace

// The CUDA driver calls this once, when it loads the library named by
// CUDA_INJECTION64_PATH.
extern "C" int InitializeInjection() {
  if (cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "kernel_trace: cuptiActivityRegisterCallbacks failed\n");
    return 0;
  }
  for (CUpti_ActivityKind kind :
       {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
        CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER}) {
    if (cuptiActivityEnable(kind) != CUPTI_SUCCESS) {
      std::fprintf(stderr, "kernel_trace: cuptiActivityEnable(%d) failed\n", kind);
    }
  }
  std::atexit(WriteAtExit);
  return 1;
}
