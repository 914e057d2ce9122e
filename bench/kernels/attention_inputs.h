// The attention benchmarks' tensors, all [B, S, H, D] in one float dtype
// except lse [B, H, S] f32: q, k, v and dout random in [-1, 1), the outputs
// and gradients allocated.
#ifndef TE_BENCH_KERNELS_ATTENTION_INPUTS_H_
#define TE_BENCH_KERNELS_ATTENTION_INPUTS_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench/kernels/bench_random.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/fp8.h"
#include "kernels/tensor.h"

namespace te::bench {

// A new f32 or bf16 tensor of LcgFloats values; aborts when the device fails.
inline Tensor RandomTensor(cuda::CudaOps* ops, DType dtype, const Shape& shape, uint64_t seed) {
  Tensor t = *ops->Allocate(dtype, shape);
  LcgFloats random(seed * 0x9e3779b97f4a7c15ULL + 1);
  std::vector<float> values(static_cast<size_t>(t.numel()));
  for (float& v : values) v = random.Next();
  absl::Status uploaded;
  if (dtype == DType::kBF16) {
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) bits[i] = FloatToBf16(values[i]);
    uploaded = ops->Upload(bits.data(), &t);
  } else {
    uploaded = ops->Upload(values.data(), &t);
  }
  if (!uploaded.ok()) std::abort();
  return t;
}

// The shape and repetition flags both benchmarks take; a flag given in argv
// replaces the default the caller put in.
struct AttentionFlags {
  int64_t batch, seq, heads, dim;
  int reps;
  float dropout = 0.0f;  // attention dropout on the probabilities (cudnn_engine_probe)
};
inline void ParseAttentionFlags(int argc, char** argv, AttentionFlags* f) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--batch=", 8) == 0) f->batch = std::atoll(argv[i] + 8);
    if (std::strncmp(argv[i], "--seq=", 6) == 0) f->seq = std::atoll(argv[i] + 6);
    if (std::strncmp(argv[i], "--heads=", 8) == 0) f->heads = std::atoll(argv[i] + 8);
    if (std::strncmp(argv[i], "--dim=", 6) == 0) f->dim = std::atoll(argv[i] + 6);
    if (std::strncmp(argv[i], "--reps=", 7) == 0) f->reps = std::atoi(argv[i] + 7);
    if (std::strncmp(argv[i], "--dropout=", 10) == 0) f->dropout = std::strtof(argv[i] + 10, nullptr);
  }
}

struct AttentionTensors {
  Tensor q, k, v, dout, out, lse, dq, dk, dv;
};

inline AttentionTensors MakeAttentionTensors(cuda::CudaOps* ops, DType dtype, int64_t b, int64_t s,
                                             int64_t h, int64_t d) {
  const Shape shape = {b, s, h, d};
  AttentionTensors t;
  t.q = RandomTensor(ops, dtype, shape, 1);
  t.k = RandomTensor(ops, dtype, shape, 2);
  t.v = RandomTensor(ops, dtype, shape, 3);
  t.dout = RandomTensor(ops, dtype, shape, 4);
  t.out = *ops->Allocate(dtype, shape);
  t.lse = *ops->Allocate(DType::kF32, {b, h, s});
  t.dq = *ops->Allocate(dtype, shape);
  t.dk = *ops->Allocate(dtype, shape);
  t.dv = *ops->Allocate(dtype, shape);
  return t;
}

}  // namespace te::bench

#endif  // TE_BENCH_KERNELS_ATTENTION_INPUTS_H_
