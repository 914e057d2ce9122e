#include "server/metrics/rpc_bytes.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message_lite.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace te::metrics {
namespace {

using grpc::experimental::InterceptionHookPoints;

// One call's interceptor: made by gRPC through the factory, deleted by gRPC
// when the call ends.
class CallBytes final : public grpc::experimental::Interceptor {
 public:
  CallBytes(const ServerMetrics* metrics, const std::string* method, bool raw)
      : metrics_(metrics), method_(method), raw_(raw) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* batch) override {
    if (batch->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      // Null when the stream ended (or the request did not parse).
      if (const void* message = batch->GetRecvMessage(); message != nullptr) {
        metrics_->AddReceivedBytes(*method_, Size(message));
      }
    }
    if (batch->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      // The message as the handler gave it, or, where gRPC serialized it
      // already, the serialized bytes. Sizing the message instead of asking
      // for the serialized buffer leaves serialization (and its errors) to
      // gRPC, where it happens anyway.
      if (const void* message = batch->GetSendMessage(); message != nullptr) {
        metrics_->AddSentBytes(*method_, Size(message));
      } else if (const grpc::ByteBuffer* serialized = batch->GetSerializedSendMessage();
                 serialized != nullptr) {
        metrics_->AddSentBytes(*method_, static_cast<int64_t>(serialized->Length()));
      }
    }
    batch->Proceed();
  }

 private:
  // gRPC hands messages over as void*, made from a pointer to the method's
  // message type: grpc::ByteBuffer for a raw method, else a generated
  // protobuf class, whose MessageLite base sits at the same address (single
  // inheritance), as gRPC's own protobuf serialization relies on.
  int64_t Size(const void* message) const {
    if (raw_) return static_cast<int64_t>(static_cast<const grpc::ByteBuffer*>(message)->Length());
    return static_cast<int64_t>(
        static_cast<const google::protobuf::MessageLite*>(message)->ByteSizeLong());
  }

  const ServerMetrics* const metrics_;  // the factory's, which outlives the server's calls
  const std::string* const method_;
  const bool raw_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RpcBytesCounter>> RpcBytesCounter::Create(
    const ServerMetrics& metrics, absl::string_view service,
    absl::Span<const char* const> raw_methods) {
  const google::protobuf::ServiceDescriptor* descriptor =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(std::string(service));
  if (descriptor == nullptr) {
    return absl::NotFoundError(absl::StrCat("no gRPC service ", service, " is linked in"));
  }
  absl::flat_hash_map<std::string, Method> methods;
  for (int i = 0; i < descriptor->method_count(); ++i) {
    const std::string& name = descriptor->method(i)->name();
    methods[absl::StrCat("/", descriptor->full_name(), "/", name)] = Method{name, false};
  }
  for (const char* raw : raw_methods) {
    auto it = methods.find(absl::StrCat("/", descriptor->full_name(), "/", raw));
    if (it == methods.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("raw method ", raw, ": ", service, " has no such method"));
    }
    it->second.raw = true;
  }
  return std::unique_ptr<RpcBytesCounter>(new RpcBytesCounter(metrics, std::move(methods)));
}

grpc::experimental::Interceptor* RpcBytesCounter::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  const char* path = info->method();
  if (path == nullptr) return nullptr;
  auto it = methods_.find(absl::string_view(path));
  if (it == methods_.end()) return nullptr;  // another service's call: not counted
  return new CallBytes(&metrics_, &it->second.name, it->second.raw);
}

absl::Status CountRpcBytes(const ServerMetrics& metrics, absl::string_view service,
                           absl::Span<const char* const> raw_methods,
                           grpc::ServerBuilder* builder) {
  absl::StatusOr<std::unique_ptr<RpcBytesCounter>> counter =
      RpcBytesCounter::Create(metrics, service, raw_methods);
  if (!counter.ok()) return counter.status();
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::move(*counter));
  builder->experimental().SetInterceptorCreators(std::move(interceptors));
  return absl::OkStatus();
}

}  // namespace te::metrics
