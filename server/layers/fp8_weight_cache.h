// The FP8 copies of a layer's weights, kept across steps until the weights
// change. Under DelayedScaling every step would quantize each GEMM's kernel
// to FP8 in both layouts (a read of the weight and two writes, every step),
// yet a weight changes only through SetVariables, an optimizer update or a
// restore. A kept
// copy is rewritten on the device whenever the kernel quantizer's scale has
// moved since it was made (Ops::QuantizeTransposeKept), and the kernel's amax
// still enters its history every step, as TE records it; so results are bit
// for bit those of quantizing every step.
//
// The session owns one per layer and clears it on every path that writes the
// layer's parameters, except one: an optimizer step under DelayedScaling
// rewrites the copies itself as it writes the weights (CopiesForUpdate,
// OptimizerSlot::fp8), with the scale the next forward will use, so that
// forward finds them current instead of reading every weight again. A
// backward that runs after a later forward re-quantized a copy (a new scale,
// the same weights) reads the newer copy with its own scale_inv: the same
// weights, quantized with that scale.
//
// Memory: the copies are two bytes per parameter for as long as the layer
// lives (384 MiB for the quickstart TransformerLayer), which is what its
// FP8 step holds above the bf16 step at the peak
// (server/session/step_memory_test.cc). Both layouts are kept because each
// is read once a step, data_t by the forward GEMM and data by the dgrad
// (Hopper's FP8 GEMMs read both operands K-major): keeping one would make
// the other every step by a byte transpose (2 bytes moved per parameter,
// ~0.1 ms at 4 TB/s for that layer), keeping neither is the quantization
// above every step. Even with no copy the step would not fall to bf16's
// peak, as that test's comment explains.
#ifndef TE_SERVER_LAYERS_FP8_WEIGHT_CACHE_H_
#define TE_SERVER_LAYERS_FP8_WEIGHT_CACHE_H_

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "server/layers/fp8_state.h"

namespace te::layers {

class Fp8WeightCache {
 public:
  // `weight` ([in, out], entering side b of the forward GEMM) as
  // QuantizeGemmOperandBothLayouts gives it for the kernel role of `set`
  // under DelayedScaling `fp8`, from the kept copy where it is current.
  // Under fp8.inference a copy already checked for this scale in the open
  // Call is returned as it is: no launch at all.
  absl::StatusOr<GemmOperand> Quantize(Ops& ops, const Fp8Recipe& fp8, const QuantizerSet& set,
                                       const Tensor& weight, Variables* vars);
  // At a forward's start: every copy the last call read, checked against its
  // quantizer's scale as the layer's variables `vars` (by the layer's names)
  // hold it now, in one Ops::QuantizeTransposeKeptMany; the forward's
  // Quantize of each then launches nothing, as long as it finds the scale
  // and amax the copy was checked with. Nothing may move the weights, the
  // scales or the amax histories between this and the forward's Quantize
  // calls (ForgetChecks where something may). A weight the last call read
  // and this forward does not still has its amax recorded, as if it were
  // read: a graph's forward reads the same weights every step. Nothing under
  // fp8.inference (its checks are one per call already) or other recipes.
  absl::Status CheckBeforeForward(Ops& ops, const Fp8Recipe& fp8, const Variables& vars);
  // The step's scaling update or optimizer ran, or the call ended: no copy
  // counts as checked (a later call's variables may sit at the same addresses).
  void ForgetChecks();
  // The weights changed, or may have: every copy goes.
  void Clear() {
    entries_.clear();
    pending_.clear();
  }
  // An optimizer step is about to write the "params/..." of `vars` in place:
  // the kept copy of each param that the step is to rewrite as it writes the
  // param, by the param's storage (OptimizerSlot::fp8), with the kernel
  // quantizer's scale as `vars` (the layer's variables, by the layer's
  // names) holds it. Call it after the step's
  // delayed-scaling update, so that is the scale the next forward quantizes
  // with; if the scale moves after all, the copy's record (made with the
  // scale it was made with) makes that forward quantize again. Every copy
  // the step cannot rewrite (of a tensor that is not a whole param of
  // `vars`, a second copy of one param, one whose scale `vars` lacks) goes,
  // as Clear would drop it.
  std::map<const void*, OptimizerFp8Copy> CopiesForUpdate(const Variables& vars);
  // The kept copy of `weight` ([in, out], as Quantize takes it) in `dtype`,
  // or null.
  const GemmOperand* Find(const Tensor& weight, DType dtype) const;

  // The copies a call makes stay only if the call succeeds, so a failed call
  // leaves the session's memory as it was (session.h contract 2): a Call
  // destroyed without Commit drops what was made while it was open.
  class Call {
   public:
    explicit Call(Fp8WeightCache* cache) : cache_(cache) {
      cache_->pending_.clear();
      cache_->ForgetChecks();
      ++cache_->call_;
    }
    ~Call();
    void Commit() { committed_ = true; }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    Fp8WeightCache* cache_;
    bool committed_ = false;
  };
  int64_t bytes() const;
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    Tensor weight;  // held, so its address names it for as long as the entry lives
    GemmOperand op;
    Ops::KeptQuantization kept;
    // The kernel quantizer's scale it was last quantized for, by the layer's
    // name for it (a graph's module names it under its node:
    // Fp8Recipe::variables_scope), as CopiesForUpdate looks it up.
    std::string scale_name;
    std::string history_name;      // and its amax history's
    uint64_t checked_in_call = 0;  // call_ when it was last checked against that scale
    uint64_t used_in_call = 0;     // call_ when a Quantize last returned it
    // CheckBeforeForward checked it against the scale and amax at these
    // addresses (null: not checked since the last ForgetChecks).
    const void* checked_scale = nullptr;
    const void* checked_amax = nullptr;
  };
  // The weight's storage, its 2-D view and the FP8 dtype.
  using Key = std::tuple<const void*, int64_t, int64_t, DType>;
  std::map<Key, Entry> entries_;
  std::vector<Key> pending_;  // made since the open Call began
  uint64_t call_ = 1;         // the open Call's number (entries start at 0: unchecked)
};

// The kernel operand of a forward GEMM under per-tensor `fp8`: from
// fp8.weight_cache when there is one and the recipe is DelayedScaling (the
// only one whose scale is known before the weight is read), else quantized
// now (QuantizeGemmOperandBothLayouts).
absl::StatusOr<GemmOperand> QuantizeKernelOperand(Ops& ops, const Fp8Recipe& fp8,
                                                  const QuantizerSet& set, const Tensor& weight,
                                                  Variables* vars);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_FP8_WEIGHT_CACHE_H_
