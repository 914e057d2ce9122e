#include "client/transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "kernels/status_macros.h"

namespace te::client {
namespace {

constexpr size_t kBlockAlignment = 4096;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// A registration error that will not change by retrying: the server runs
// without --enable_shm, is on another host (it cannot see the object), may
// not open it, or does not know the RPC.
bool IsRefusal(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kUnimplemented: return true;
    default: return false;
  }
}

// A name no other process will pick: pid, a counter, and 64 random bits.
std::string NewObjectName() {
  static std::atomic<int> counter{0};
  std::random_device device;
  const uint64_t noise = (static_cast<uint64_t>(device()) << 32) ^ device();
  return absl::StrCat("/te_client_", getpid(), "_", counter.fetch_add(1), "_",
                      absl::Hex(noise, absl::kZeroPad16));
}

}  // namespace

const char* TransportName(Transport transport) {
  switch (transport) {
    case Transport::kAuto: return "auto";
    case Transport::kInline: return "inline";
    case Transport::kStream: return "stream";
    case Transport::kSharedMemory: return "shm";
  }
  return "?";
}

absl::StatusOr<Transport> ParseTransport(const std::string& name) {
  for (Transport t :
       {Transport::kAuto, Transport::kInline, Transport::kStream, Transport::kSharedMemory}) {
    if (name == TransportName(t)) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("transport '", name, "': expected auto, inline, stream or shm"));
}

Transport Choose(Transport chosen, size_t bytes, size_t inline_bytes,
                 const std::function<bool()>& shm_usable) {
  if (chosen != Transport::kAuto) return chosen;
  if (bytes <= inline_bytes) return Transport::kInline;
  return shm_usable() ? Transport::kSharedMemory : Transport::kStream;
}

// ---- SharedMemoryPool ------------------------------------------------------------

SharedMemoryPool::SharedMemoryPool(Registrar registrar, size_t min_region_bytes, int max_regions)
    : registrar_(std::move(registrar)),
      min_region_bytes_(RoundUp(std::max<size_t>(min_region_bytes, 1), kBlockAlignment)),
      max_regions_(max_regions) {}

SharedMemoryPool::~SharedMemoryPool() {
  absl::MutexLock lock(&mu_);
  for (const auto& region : regions_) munmap(region->base, region->size);
}

bool SharedMemoryPool::available() const {
  absl::MutexLock lock(&mu_);
  return unavailable_.ok();
}

absl::Status SharedMemoryPool::Probe() {
  absl::MutexLock lock(&mu_);
  if (!unavailable_.ok()) return unavailable_;
  if (!regions_.empty()) return absl::OkStatus();
  return NewRegionLocked(0).status();
}

absl::StatusOr<SharedMemoryPool::Region*> SharedMemoryPool::NewRegionLocked(size_t at_least) {
  if (static_cast<int>(regions_.size()) >= max_regions_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the session's ", max_regions_, " shared-memory regions are full"));
  }
  const size_t size = std::max(min_region_bytes_, RoundUp(at_least, kBlockAlignment));
  const std::string name = NewObjectName();
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shm_open(", name, "): ", std::strerror(errno)));
  }
  // Reserve the pages now (contract 1): posix_fallocate returns the error.
  const int reserved = ftruncate(fd, static_cast<off_t>(size)) == 0
                           ? posix_fallocate(fd, 0, static_cast<off_t>(size))
                           : errno;
  void* base =
      reserved == 0 ? mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int map_error = errno;
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("a shared-memory region of ", size,
                     " bytes: ", std::strerror(reserved != 0 ? reserved : map_error)));
  }
  absl::StatusOr<std::string> id = registrar_(name, size);
  shm_unlink(name.c_str());  // registered or not, the name has served
  if (!id.ok()) {
    munmap(base, size);
    if (!IsRefusal(id.status())) return id.status();  // busy or unreachable: maybe later
    // The server cannot use it (another host, no --enable_shm): for good.
    unavailable_ = absl::FailedPreconditionError(
        absl::StrCat("shared memory is unavailable for this session: ", id.status().message()));
    return unavailable_;
  }
  auto region = std::make_unique<Region>();
  region->id = *std::move(id);
  region->base = static_cast<char*>(base);
  region->size = size;
  region->free[0] = size;
  regions_.push_back(std::move(region));
  return regions_.back().get();
}

absl::StatusOr<SharedMemoryPool::Block> SharedMemoryPool::Allocate(size_t bytes) {
  const size_t need = RoundUp(std::max<size_t>(bytes, 1), kBlockAlignment);
  absl::MutexLock lock(&mu_);
  if (!unavailable_.ok()) return unavailable_;
  auto take = [&](Region& region) -> std::optional<Block> {
    for (auto it = region.free.begin(); it != region.free.end(); ++it) {
      if (it->second < need) continue;
      const uint64_t offset = it->first;
      const size_t left = it->second - need;
      region.free.erase(it);
      if (left > 0) region.free[offset + need] = left;
      return Block{region.id, offset, region.base + offset, bytes};
    }
    return std::nullopt;
  };
  for (const auto& region : regions_) {
    if (std::optional<Block> block = take(*region)) return *block;
  }
  absl::StatusOr<Region*> region = NewRegionLocked(need);
  if (!region.ok()) return region.status();
  return *take(**region);
}

void SharedMemoryPool::Free(const Block& block) {
  const size_t size = RoundUp(std::max<size_t>(block.size, 1), kBlockAlignment);
  absl::MutexLock lock(&mu_);
  for (const auto& region : regions_) {
    if (region->id != block.region_id) continue;
    auto [it, inserted] = region->free.emplace(block.offset, size);
    if (!inserted) return;  // freed twice: ignore
    // Coalesce with the neighbours.
    auto next = std::next(it);
    if (next != region->free.end() && it->first + it->second == next->first) {
      it->second += next->second;
      region->free.erase(next);
    }
    if (it != region->free.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        region->free.erase(it);
      }
    }
    return;
  }
}

absl::StatusOr<const char*> SharedMemoryPool::View(const std::string& region_id, uint64_t offset,
                                                   size_t bytes) const {
  absl::MutexLock lock(&mu_);
  for (const auto& region : regions_) {
    if (region->id != region_id) continue;
    if (offset > region->size || bytes > region->size - offset) break;
    return static_cast<const char*>(region->base + offset);
  }
  return absl::InvalidArgumentError(absl::StrCat("shared memory ", region_id, " at ", offset, " (",
                                                 bytes, " bytes) is not this session's"));
}

}  // namespace te::client

// ---- Session's transport (declared in client.h) ------------------------------------

namespace te::client {

Transport Session::TransportFor(size_t bytes) const {
  return Choose(transport_, bytes, options_.inline_tensor_bytes,
                [this] { return shm_.available(); });
}

absl::StatusOr<std::string> Session::RegisterRegion(const std::string& name, uint64_t size) {
  te::v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.set_size(size);
  grpc::ClientContext context;
  PrepareContext(&context);
  *request.mutable_session() = NextRef();
  te::v1::RegisterSharedMemoryResponse response;
  RETURN_IF_ERROR(CallStatus(request.session().sequence(),
                             stub_->RegisterSharedMemory(&context, request, &response)));
  return response.region_id();
}

absl::StatusOr<ResidentTensor> Session::PutShared(const HostTensor& tensor,
                                                  const SharedMemoryPool::Block& block) {
  ++counts_.shm_tensors;
  std::memcpy(block.data, tensor.bytes().data(), tensor.bytes().size());
  grpc::ClientContext context;
  PrepareContext(&context);
  te::v1::PutTensorResponse response;
  std::unique_ptr<grpc::ClientWriter<te::v1::PutTensorChunk>> writer =
      stub_->PutTensor(&context, &response);
  te::v1::PutTensorChunk header;
  te::v1::PutTensorHeader* h = header.mutable_header();
  h->mutable_tensor()->set_dtype(DTypeToProto(tensor.dtype()));
  for (int64_t d : tensor.shape()) h->mutable_tensor()->add_shape(d);
  h->mutable_shm()->set_region_id(block.region_id);
  h->mutable_shm()->set_offset(block.offset);
  *h->mutable_session() = NextRef();
  writer->Write(header);  // a failure shows in Finish
  writer->WritesDone();
  RETURN_IF_ERROR(CallStatus(h->session().sequence(), writer->Finish()));
  return ResidentTensor{response.tensor_id(), tensor.dtype(), tensor.shape()};
}

absl::StatusOr<HostTensor> Session::GetShared(const std::string& tensor_id, DType dtype,
                                              const Shape& shape,
                                              const SharedMemoryPool::Block& block) {
  ++counts_.shm_tensors;
  te::v1::GetTensorRequest request;
  request.set_tensor_id(tensor_id);
  request.mutable_destination()->set_region_id(block.region_id);
  request.mutable_destination()->set_offset(block.offset);
  grpc::ClientContext context;
  PrepareContext(&context);
  *request.mutable_session() = NextRef();
  std::unique_ptr<grpc::ClientReader<te::v1::TensorChunk>> reader =
      stub_->GetTensor(&context, request);
  te::v1::TensorChunk chunk;
  std::optional<te::v1::TensorHeader> header;
  while (reader->Read(&chunk)) {
    if (chunk.has_header()) header = chunk.header();
  }
  RETURN_IF_ERROR(CallStatus(request.session().sequence(), reader->Finish()));
  if (!header.has_value() || header->dtype() != DTypeToProto(dtype) ||
      Shape(header->shape().begin(), header->shape().end()) != shape) {
    return absl::InternalError(
        absl::StrCat("GetTensor(", tensor_id, "): the server's header does not match the tensor"));
  }
  return HostTensor::FromBytes(dtype, shape, std::string(block.data, block.size));
}

absl::StatusOr<HostTensor> Session::ReadShared(const te::v1::Tensor& tensor,
                                               const std::string& field) {
  ASSIGN_OR_RETURN(DType dtype, DTypeFromProto(tensor.dtype(), field + ".dtype"));
  const Shape shape(tensor.shape().begin(), tensor.shape().end());
  const int64_t n = NumElements(shape);
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat(field, ".shape: negative"));
  const size_t bytes = static_cast<size_t>(n) * DTypeSize(dtype);
  absl::StatusOr<const char*> view =
      shm_.View(tensor.shm().region_id(), tensor.shm().offset(), bytes);
  if (!view.ok())
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", view.status().message()));
  ++counts_.shm_tensors;
  return HostTensor::FromBytes(dtype, shape, std::string(*view, bytes));
}

bool Session::FreeShared(const std::string& upload_id) {
  // "shm:<region id>:<offset>:<size>", as Send writes it.
  if (upload_id.rfind("shm:", 0) != 0) return false;
  std::vector<std::string> parts = absl::StrSplit(upload_id.substr(4), ':');
  SharedMemoryPool::Block block;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[1], &block.offset) ||
      !absl::SimpleAtoi(parts[2], &block.size)) {
    return true;  // ours, but malformed: nothing to free
  }
  block.region_id = parts[0];
  shm_.Free(block);
  return true;
}

}  // namespace te::client
