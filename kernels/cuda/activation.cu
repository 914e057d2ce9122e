// Activations, forward (optionally fused with FP8 quantize + amax) and
// backward, plain and gated: for x = [x_0 | x_1] (each [N, I]),
// y = act_0(x_0) * act_1(x_1). Formulas as in kernels/ops.h and the CPU
// reference.
//
// Speed: these kernels are memory-bound at the MLP's sizes only if the
// per-element work stays small, so
// - the activation is a template parameter (a functor), chosen once at launch:
//   no switch per element, and the compiler sees each formula whole;
// - y and dy are always indexed flat (y's row r, column c is element
//   r * I + c); only x / dx of a gated op need the row, and each thread keeps
//   its row and column as a cursor advanced by a fixed stride (no division in
//   the loop);
// - each thread moves two 8-element packs per iteration, both loads issued
//   before any math, for more bytes in flight.
// The float math per element is the same expression as before, so results are
// unchanged bit for bit.
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/activation_fns.cuh"
#include "kernels/cuda/cast_transpose.cuh"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// The activation chosen per element: for the combinations not worth a kernel
// of their own (see DispatchActivations).
struct RuntimeFn {
  Activation act;
  __device__ __forceinline__ float Value(float x) const {
    switch (act) {
      case Activation::kGelu: return GeluFn().Value(x);
      case Activation::kSilu: return SiluFn().Value(x);
      case Activation::kRelu: return ReluFn().Value(x);
      case Activation::kQuickGelu: return QuickGeluFn().Value(x);
      case Activation::kSquaredRelu: return SquaredReluFn().Value(x);
      case Activation::kLinear: return LinearFn().Value(x);
    }
    return x;
  }
  __device__ __forceinline__ float Derivative(float x) const {
    switch (act) {
      case Activation::kGelu: return GeluFn().Derivative(x);
      case Activation::kSilu: return SiluFn().Derivative(x);
      case Activation::kRelu: return ReluFn().Derivative(x);
      case Activation::kQuickGelu: return QuickGeluFn().Derivative(x);
      case Activation::kSquaredRelu: return SquaredReluFn().Derivative(x);
      case Activation::kLinear: return LinearFn().Derivative(x);
    }
    return 1.0f;
  }
};

// Calls f(gated, act0, act1) with gated a std::bool_constant. With kSpecialize
// (the dtype combinations layers use), single activations and the gated pairs
// TE has, (X, linear), get compile-time functors; everything else (other
// gated pairs, mixed dtypes) shares one kernel per dtype combination that
// switches per element, so the number of kernels stays in the hundreds
// instead of thousands.
template <bool kSpecialize, typename F>
void DispatchActivations(const std::vector<Activation>& acts, F&& f) {
  const bool gated = acts.size() == 2;
  if constexpr (kSpecialize) {
    if (!gated || acts[1] == Activation::kLinear) {
      WithActivation(acts[0], [&](auto a0) {
        if (gated) {
          f(std::true_type{}, a0, LinearFn{});
        } else {
          f(std::false_type{}, a0, a0);
        }
      });
      return;
    }
  }
  const RuntimeFn a0{acts[0]}, a1{gated ? acts[1] : acts[0]};
  if (gated) {
    f(std::true_type{}, a0, a1);
  } else {
    f(std::false_type{}, a0, a0);
  }
}

// ---- walking the elements ------------------------------------------------------------

// A stride in items (packs or elements) split into whole rows and a remainder.
struct RowStep {
  int64_t rows, cols;
};
inline RowStep SplitStride(int64_t stride, int64_t per_row) {
  return RowStep{stride / per_row, stride % per_row};
}

// The row of a thread's current item, kept without dividing per item: item k
// is (row, col) with k = row * per_row + col, 0 <= col < per_row.
struct RowCursor {
  int64_t row, col;
  __device__ __forceinline__ void Start(int64_t k, int64_t per_row) {
    row = k / per_row;
    col = k - row * per_row;
  }
  __device__ __forceinline__ void Advance(RowStep step, int64_t per_row) {
    row += step.rows;
    col += step.cols;
    if (col >= per_row) {  // col < 2 * per_row: one carry at most
      col -= per_row;
      ++row;
    }
  }
};

// Geometry of one launch. Items are V-element groups (V = kVec on the vector
// path, 1 on the scalar one); y (and dy) item k starts at element k * V; x
// (and dx) item k starts there too, plus row * width when gated (row r of x is
// [x_0 | x_1], 2 * width long). Thread t handles items t + 2iT and t + (2i+1)T
// (T threads in all), so each load instruction of a warp is contiguous.
struct Walk {
  int64_t items;    // items in x_0 / y
  int64_t per_row;  // items per row (gated only)
  RowStep half;     // T as a RowStep (gated only)
  RowStep full;     // 2T
  int64_t tail;     // vector path, not gated: elements past items * kVec (< kVec)
};

Walk MakeWalk(bool gated, bool vec, int64_t rows, int64_t width, unsigned blocks) {
  const int64_t v = vec ? kVec : 1;
  const int64_t threads = int64_t{blocks} * kThreads;
  Walk w{};
  if (gated) {
    // vec implies width % kVec == 0. An empty row (width 0) has no items; 1
    // keeps the divisions defined.
    w.per_row = width / v > 0 ? width / v : 1;
    w.items = rows * (width / v);
    w.half = SplitStride(threads, w.per_row);
    w.full = SplitStride(2 * threads, w.per_row);
  } else {
    // Contiguous: one flat run of n elements, whatever the rows.
    const int64_t n = rows * width;
    w.per_row = 1;
    w.items = n / v;
    w.tail = n - w.items * v;
  }
  return w;
}

// Threads needed: two items each.
unsigned BlocksFor(bool vec, int64_t n, SmCount sms) {
  const int64_t items = vec ? n / kVec : n;
  return GridFor((items + 1) / 2, sms);
}

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> LoadPack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}
template <typename T, int V>
__device__ __forceinline__ void StorePack(T* p, const Pack<T, V>& v) {
  *reinterpret_cast<Pack<T, V>*>(p) = v;
}

// Item k's x_0 pack at x + at_x and, gated, its x_1 pack (width further on);
// b is a's copy when not gated.
template <typename S, int V>
struct XPacks {
  Pack<S, V> a, b;
};
template <typename S, int V, bool kGated>
__device__ __forceinline__ XPacks<S, V> LoadX(const S* x, int64_t at_x, int64_t width) {
  XPacks<S, V> p;
  p.a = LoadPack<S, V>(x + at_x);
  p.b = kGated ? LoadPack<S, V>(x + at_x + width) : p.a;
  return p;
}

// One thread's walk over its items (Walk): load(at, at_x) reads item k, whose
// y / dy element is `at` and x / dx element `at_x`, and compute(loaded, at,
// at_x) does its math and stores. Both items of an iteration are loaded
// before either is computed, for more bytes in flight.
template <int V, bool kGated, typename Load, typename Compute>
__device__ __forceinline__ void WalkItems(int64_t width, const Walk& w, Load load,
                                          Compute compute) {
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  RowCursor c0{0, 0}, c1{0, 0};
  if (kGated) {
    c0.Start(k, w.per_row);
    c1 = c0;
    c1.Advance(w.half, w.per_row);
  }
  for (; k + threads < w.items; k += 2 * threads) {
    const int64_t at0 = k * V, at1 = (k + threads) * V;
    const int64_t x0 = kGated ? at0 + c0.row * width : at0;
    const int64_t x1 = kGated ? at1 + c1.row * width : at1;
    const auto in0 = load(at0, x0);
    const auto in1 = load(at1, x1);
    compute(in0, at0, x0);
    compute(in1, at1, x1);
    if (kGated) {
      c0.Advance(w.full, w.per_row);
      c1.Advance(w.full, w.per_row);
    }
  }
  if (k < w.items) {  // the last item, without a partner
    const int64_t at0 = k * V;
    const int64_t x0 = kGated ? at0 + c0.row * width : at0;
    compute(load(at0, x0), at0, x0);
  }
}

// ---- forward ---------------------------------------------------------------------------

template <typename A, typename B>
constexpr bool kSame = std::is_same<A, B>::value;
template <typename Out>
constexpr bool kIsFp8 = kSame<Out, E4M3> || kSame<Out, E5M2>;

// V elements of y from x_0 (and x_1) at `x0`; amax over the float values.
template <typename In, typename Out, int V, bool kGated, typename A0, typename A1>
__device__ __forceinline__ void ForwardItem(const Pack<typename In::Storage, V>& a,
                                            const Pack<typename In::Storage, V>& b, A0 act0,
                                            A1 act1, float s, unsigned* amax_bits,
                                            typename Out::Storage* y) {
  Pack<typename Out::Storage, V> o;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    float v = act0.Value(In::Load(a.v[j]));
    if (kGated) v *= act1.Value(In::Load(b.v[j]));
    if (kIsFp8<Out>) *amax_bits = max(*amax_bits, AbsBits(v));  // only FP8 outputs have one
    o.v[j] = Out::Store(v * s);
  }
  StorePack<typename Out::Storage, V>(y, o);
}

template <typename In, typename Out, int V, bool kGated, typename A0, typename A1>
__device__ __forceinline__ void ForwardWalk(const typename In::Storage* x,
                                            typename Out::Storage* y, A0 act0, A1 act1,
                                            int64_t width, const Walk& w, float s,
                                            unsigned* amax_bits) {
  WalkItems<V, kGated>(
      width, w,
      [&](int64_t, int64_t at_x) { return LoadX<typename In::Storage, V, kGated>(x, at_x, width); },
      [&](const XPacks<typename In::Storage, V>& in, int64_t at, int64_t) {
        ForwardItem<In, Out, V, kGated>(in.a, in.b, act0, act1, s, amax_bits, y + at);
      });
}

// x: [rows, gated ? 2 * width : width]; y: [rows, width]. FP8 y: scale and
// scale_inv non-null, amax recorded or not. `vec`: x and y aligned for Pack
// access, and (gated) width % kVec == 0.
template <typename In, typename Out, bool kGated, typename A0, typename A1>
__global__ void ActivationForwardKernel(const typename In::Storage* x, typename Out::Storage* y,
                                        A0 act0, A1 act1, int64_t width, Walk w, bool vec,
                                        const float* scale, AmaxOut amax, float* scale_inv) {
  __shared__ unsigned scratch[32];
  const float s = scale != nullptr ? *scale : 1.0f;
  unsigned amax_bits = 0;
  if (vec) {
    ForwardWalk<In, Out, kVec, kGated>(x, y, act0, act1, width, w, s, &amax_bits);
    // Not gated: the last n % kVec elements, one per thread of block 0.
    if (!kGated && blockIdx.x == 0 && threadIdx.x < w.tail) {
      const int64_t at = w.items * kVec + threadIdx.x;
      const Pack<typename In::Storage, 1> a = LoadPack<typename In::Storage, 1>(x + at);
      ForwardItem<In, Out, 1, false>(a, a, act0, act1, s, &amax_bits, y + at);
    }
  } else {
    ForwardWalk<In, Out, 1, kGated>(x, y, act0, act1, width, w, s, &amax_bits);
  }
  if (scale_inv != nullptr) {  // FP8 y; its amax may go unrecorded
    if (amax.amax != nullptr) amax_bits = BlockMaxBits(amax_bits, scratch);
    if (threadIdx.x == 0) {
      FoldAmax(amax, amax_bits);
      if (blockIdx.x == 0) *scale_inv = 1.0f / s;
    }
  }
}

// ---- backward --------------------------------------------------------------------------

// Plain: dx = dy * act'(x). Gated: dx_0 = dy * act_1(x_1) * act_0'(x_0),
// dx_1 = dy * act_0(x_0) * act_1'(x_1).
template <typename In, typename D, typename Out, int V, bool kGated, typename A0, typename A1>
__device__ __forceinline__ void BackwardItem(const Pack<typename D::Storage, V>& g,
                                             const Pack<typename In::Storage, V>& a,
                                             const Pack<typename In::Storage, V>& b, A0 act0,
                                             A1 act1, int64_t width,
                                             typename Out::Storage* dx) {
  Pack<typename Out::Storage, V> o0, o1;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float gj = D::Load(g.v[j]);
    const float x0 = In::Load(a.v[j]);
    if (kGated) {
      const float x1 = In::Load(b.v[j]);
      o0.v[j] = Out::Store(gj * act1.Value(x1) * act0.Derivative(x0));
      o1.v[j] = Out::Store(gj * act0.Value(x0) * act1.Derivative(x1));
    } else {
      o0.v[j] = Out::Store(gj * act0.Derivative(x0));
    }
  }
  StorePack<typename Out::Storage, V>(dx, o0);
  if (kGated) StorePack<typename Out::Storage, V>(dx + width, o1);
}

template <typename In, typename D, typename Out, int V, bool kGated, typename A0, typename A1>
__device__ __forceinline__ void BackwardWalk(const typename D::Storage* dy,
                                             const typename In::Storage* x,
                                             typename Out::Storage* dx, A0 act0, A1 act1,
                                             int64_t width, const Walk& w) {
  struct Loaded {
    Pack<typename D::Storage, V> g;
    XPacks<typename In::Storage, V> in;
  };
  WalkItems<V, kGated>(
      width, w,
      [&](int64_t at, int64_t at_x) {
        return Loaded{LoadPack<typename D::Storage, V>(dy + at),
                      LoadX<typename In::Storage, V, kGated>(x, at_x, width)};
      },
      [&](const Loaded& l, int64_t, int64_t at_x) {
        BackwardItem<In, D, Out, V, kGated>(l.g, l.in.a, l.in.b, act0, act1, width, dx + at_x);
      });
}

// dy: [rows, width]; x, dx: [rows, gated ? 2 * width : width]. `vec` as for
// the forward.
template <typename In, typename D, typename Out, bool kGated, typename A0, typename A1>
__global__ void ActivationBackwardKernel(const typename D::Storage* dy,
                                         const typename In::Storage* x, typename Out::Storage* dx,
                                         A0 act0, A1 act1, int64_t width, Walk w, bool vec) {
  if (vec) {
    BackwardWalk<In, D, Out, kVec, kGated>(dy, x, dx, act0, act1, width, w);
    if (!kGated && blockIdx.x == 0 && threadIdx.x < w.tail) {
      const int64_t at = w.items * kVec + threadIdx.x;
      const Pack<typename D::Storage, 1> g = LoadPack<typename D::Storage, 1>(dy + at);
      const Pack<typename In::Storage, 1> a = LoadPack<typename In::Storage, 1>(x + at);
      BackwardItem<In, D, Out, 1, false>(g, a, a, act0, act1, width, dx + at);
    }
  } else {
    BackwardWalk<In, D, Out, 1, kGated>(dy, x, dx, act0, act1, width, w);
  }
}

}  // namespace

absl::Status CudaOps::ActivationForward(const std::vector<Activation>& acts, const Tensor& x,
                                        Tensor* y, const Fp8Output* fp8) {
  ASSIGN_OR_RETURN(const int64_t width, CheckActivationForwardArgs(acts, x, y, fp8));
  const bool quantized = IsFloat8(y->dtype());
  const int64_t rows = Rows(x);
  const int64_t n = rows * width;
  if (n == 0 && !quantized) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const bool gated = acts.size() == 2;
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloatOrFp8(y->dtype(), [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      const bool vec = (!gated || width % kVec == 0) && PackAligned<In, Out>(x, *y);
      const unsigned blocks = BlocksFor(vec, n, sms());
      const Walk walk = MakeWalk(gated, vec, rows, width, blocks);
      constexpr bool kSpecialize = kSame<In, Out> || kIsFp8<Out>;
      DispatchActivations<kSpecialize>(acts, [&](auto gated_tag, auto act0, auto act1) {
        ActivationForwardKernel<In, Out, decltype(gated_tag)::value>
            <<<blocks, kThreads, 0, stream()>>>(
                static_cast<const typename In::Storage*>(x.data()),
                static_cast<typename Out::Storage*>(y->data()), act0, act1, width, walk, vec,
                quantized ? fp8->scale.data_as<const float>() : nullptr,
                quantized ? AmaxOutFor(*fp8) : AmaxOut{},
                quantized ? fp8->scale_inv.data_as<float>() : nullptr);
      });
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::ActivationForwardTransposed(const std::vector<Activation>& acts,
                                                  const Tensor& x, const Fp8Output& fp8,
                                                  Tensor* y, Tensor* y_t) {
  ASSIGN_OR_RETURN(const int64_t width, CheckActivationForwardTransposedArgs(acts, x, fp8, y, y_t));
  // Gated pairs and shapes the tile kernel cannot take: activation, then
  // transpose.
  if (acts.size() != 1) return Ops::ActivationForwardTransposed(acts, x, fp8, y, y_t);
  const Tensor x2 = x.Reshaped({Rows(x), width});
  Tensor y2 = y->Reshaped({Rows(x), width});
  if (!TileKernelFits(x2, y2, *y_t)) return Ops::ActivationForwardTransposed(acts, x, fp8, y, y_t);
  RETURN_IF_ERROR(Enter());
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFp8(y->dtype(), [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      WithActivation(acts[0], [&](auto act) {
        const auto codes = ForCodes(act);
        using F = ValueOf<decltype(codes)>;
        LaunchCastTranspose<In, Out, false>(context(), stream(), x2, &y2, y_t,
                                            fp8.scale.data_as<const float>(), AmaxOutFor(fp8),
                                            fp8.scale_inv.data_as<float>(), nullptr, nullptr,
                                            nullptr, F{codes});
      });
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::ActivationBackwardQuantizeTranspose(const std::vector<Activation>& acts,
                                                          Tensor* dy_in, const Tensor& x,
                                                          const Fp8Output& fp8, Tensor* y,
                                                          Tensor* y_t, Tensor* dbias) {
  RETURN_IF_ERROR(
      CheckActivationBackwardQuantizeTransposeArgs(acts, dy_in, x, fp8, y, y_t, dbias).status());
  const Tensor& dy = *dy_in;
  // Gated pairs, mixed dtypes and shapes the wide tiles do not cover: dx
  // written, then quantized.
  if (acts.size() != 1 || dy.dtype() != x.dtype() || !WideTilesFit(x, *y, *y_t) ||
      reinterpret_cast<uintptr_t>(dy.data()) % 16 != 0) {
    return Ops::ActivationBackwardQuantizeTranspose(acts, dy_in, x, fp8, y, y_t, dbias);
  }
  RETURN_IF_ERROR(Enter());
  const int64_t cols = x.dim(1);
  Tensor partial;  // one row of column sums per 128-row tile row: 1 MiB at [8192, 16384]
  if (dbias != nullptr) {
    ASSIGN_OR_RETURN(partial, Allocate(DType::kF32, {CastTransposePartialRows(x, *y, *y_t), cols}));
  }
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFp8(y->dtype(), [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      WithActivation(acts[0], [&](auto act) {
        const auto codes = ForCodes(act);
        const GradientOf<In, decltype(codes)> f{codes};
        auto launch = [&](auto sums) {
          LaunchCastTranspose<In, Out, decltype(sums)::value>(
              context(), stream(), x, y, y_t, fp8.scale.data_as<const float>(),
              AmaxOutFor(fp8), fp8.scale_inv.data_as<float>(),
              partial.defined() ? partial.data_as<float>() : nullptr, nullptr, nullptr, f, &dy);
        };
        if (dbias != nullptr) {
          launch(std::true_type{});
        } else {
          launch(std::false_type{});
        }
      });
    });
  });
  if (dbias != nullptr) {
    LaunchPartialColumnSums(partial.data_as<const float>(), partial.dim(0), cols, dbias->dtype(),
                            dbias->data(), stream());
  }
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::ActivationBackward(const std::vector<Activation>& acts, const Tensor& dy,
                                         const Tensor& x, Tensor* dx) {
  ASSIGN_OR_RETURN(const int64_t width, CheckActivationBackwardArgs(acts, dy, x, dx));
  const int64_t rows = Rows(x);
  const int64_t n = rows * width;
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const bool gated = acts.size() == 2;
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(dy.dtype(), [&](auto d) {
      DispatchFloat(dx->dtype(), [&](auto out) {
        using In = decltype(in);
        using D = decltype(d);
        using Out = decltype(out);
        const bool vec = (!gated || width % kVec == 0) &&
                         PackAligned<typename D::Storage>(dy.data()) &&
                         PackAligned<typename In::Storage>(x.data()) &&
                         PackAligned<typename Out::Storage>(dx->data());
        const unsigned blocks = BlocksFor(vec, n, sms());
        const Walk walk = MakeWalk(gated, vec, rows, width, blocks);
        constexpr bool kSpecialize = kSame<In, D> && kSame<In, Out>;
        DispatchActivations<kSpecialize>(acts, [&](auto gated_tag, auto act0, auto act1) {
          ActivationBackwardKernel<In, D, Out, decltype(gated_tag)::value>
              <<<blocks, kThreads, 0, stream()>>>(
                  static_cast<const typename D::Storage*>(dy.data()),
                  static_cast<const typename In::Storage*>(x.data()),
                  static_cast<typename Out::Storage*>(dx->data()), act0, act1, width, walk, vec);
        });
      });
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
