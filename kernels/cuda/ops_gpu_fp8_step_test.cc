// The ops that keep an FP8 step's launches few (kernels/ops.h), against the
// CPU reference on random data: DelayedScalingUpdates (a step's scaling
// updates in one launch), QuantizeTransposeKept and QuantizeTransposeKeptMany
// (FP8 weight copies kept across steps), ActivationForwardTransposed (the activation's FP8 output
// in both layouts) and RotaryQkQuantizeTranspose (a packed qkv's gradient,
// rotated and quantized in one pass); and every FP8 output with its amax
// left unrecorded.
// Tolerances: ops_gpu_test.h.
#include <cstring>
#include <functional>
#include <tuple>

#include "kernels/cuda/ops_gpu_test.h"

namespace te {
namespace gpu_test {
namespace {

class Fp8StepOpsTest : public GpuTest {
 protected:
  Pair Zeros(DType dtype, const Shape& shape) {
    Tensor cpu = NewCpu(dtype, shape);
    std::memset(cpu.data(), 0, cpu.nbytes());
    return Mirror(cpu);
  }
  Pair FromValues(DType dtype, const Shape& shape, const std::vector<float>& values) {
    Tensor cpu = NewCpu(dtype, shape);
    FromFloatVector(values, &cpu);
    return Mirror(cpu);
  }
  // y_t is y transposed, code for code (both written from one tile).
  void ExpectTransposed(const Tensor& y, const Tensor& y_t, int64_t rows, int64_t cols) {
    const Tensor a = Fetch(y), b = Fetch(y_t);
    const uint8_t* pa = a.data_as<const uint8_t>();
    const uint8_t* pb = b.data_as<const uint8_t>();
    int64_t wrong = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) wrong += pa[r * cols + c] != pb[c * rows + r];
    }
    EXPECT_EQ(wrong, 0);
  }
};

// 60 quantizers (more than one launch's 48) with histories of different
// lengths, a zero window (scale kept) and infinite or NaN amaxes (scale kept,
// counted), both algorithms: every history and scale as the CPU's
// per-quantizer update, and the same count of inf / NaN amaxes.
TEST_F(Fp8StepOpsTest, DelayedScalingUpdatesMatchOneByOne) {
  std::vector<Ops::DelayedScalingItem> cpu_items, gpu_items;
  std::vector<Pair> histories, scales;
  for (int q = 0; q < 60; ++q) {
    const int64_t length = 1 + (q * 37) % 1024;
    Pair h = Random(DType::kF32, {length}, 100 + q, 0.0f, 8.0f);
    if (q == 3) h = Zeros(DType::kF32, {length});
    if (q == 5 || q == 50 || q == 53) {  // 53: most_recent, inf past history[0]
      std::vector<float> v(static_cast<size_t>(length), 1.0f);
      v[q == 53 ? length - 1 : 0] = q == 50 ? NAN : INFINITY;
      h = FromValues(DType::kF32, {length}, v);
    }
    if (q == 9) {  // most_recent and history[0] is NaN
      std::vector<float> v(static_cast<size_t>(length), 1.0f);
      v[0] = NAN;
      h = FromValues(DType::kF32, {length}, v);
    }
    Pair s = FromValues(DType::kF32, {1}, {0.5f + q});
    Ops::DelayedScalingItem item;
    item.args.fp8_max = q % 2 == 0 ? 448.0f : 57344.0f;
    item.args.margin = static_cast<float>(q % 3);
    item.args.most_recent = q % 4 == 1;
    item.amax_history = h.cpu;
    item.scale = s.cpu;
    cpu_items.push_back(item);
    item.amax_history = h.gpu;
    item.scale = s.gpu;
    gpu_items.push_back(item);
    histories.push_back(h);
    scales.push_back(s);
  }
  Pair non_finite = FromValues(DType::kF32, {1}, {1.0f});
  ASSERT_TRUE(cpu_->DelayedScalingUpdates(cpu_items, &non_finite.cpu).ok());
  ASSERT_TRUE(gpu_->DelayedScalingUpdates(gpu_items, &non_finite.gpu).ok());
  // q 5, 50 (any window) and 9 (history[0]); not 53 (most_recent, inf later).
  EXPECT_EQ(LoadAsFloat(non_finite.cpu, 0), 1.0f + 3.0f);
  EXPECT_EQ(LoadAsFloat(Fetch(non_finite.gpu), 0), 1.0f + 3.0f);
  for (size_t q = 0; q < histories.size(); ++q) {
    const Tensor got = Fetch(histories[q].gpu);
    EXPECT_EQ(0, std::memcmp(got.data(), histories[q].cpu.data(), got.nbytes())) << "history " << q;
    ExpectScalarMatches(scales[q], "scale " + std::to_string(q));
  }
  // A bad entry is refused before anything moves.
  Pair bad = Zeros(DType::kBF16, {4});
  gpu_items[7].amax_history = bad.gpu;
  const Tensor before = Fetch(histories[0].gpu);
  EXPECT_EQ(gpu_->DelayedScalingUpdates(gpu_items, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(0, std::memcmp(Fetch(histories[0].gpu).data(), before.data(), before.nbytes()));
}

// A kept weight copy: made at the first call, left untouched (not even read)
// while the scale stays, re-made when it moves; amax and scale_inv as a plain
// QuantizeTranspose gives them, every call.
// Both cast-transpose kernels: 192 x 320 is ragged for the wide kernel's
// 128 x 64 tiles (the 64 x 64 kernel), 256 x 320 whole (the wide one).
TEST_F(Fp8StepOpsTest, QuantizeTransposeKeptSkipsOnlyAnUnchangedScale) {
  for (const auto& [in, rows] : std::vector<std::pair<DType, int64_t>>{
           {DType::kF32, 192}, {DType::kBF16, 192}, {DType::kF32, 256}, {DType::kBF16, 256}}) {
    const int64_t cols = 320;
    SCOPED_TRACE(std::string(DTypeName(in)) + " rows " + std::to_string(rows));
    Pair x = Random(in, {rows, cols}, 7);
    Pair y = Zeros(DType::kE4M3, {rows, cols}), y_t = Zeros(DType::kE4M3, {cols, rows});
    Pair scale = FromValues(DType::kF32, {1}, {2.0f});
    Pair amax = Zeros(DType::kF32, {1}), scale_inv = Zeros(DType::kF32, {1});
    Pair kept_scale = FromValues(DType::kF32, {1}, {NAN}), kept_amax = Zeros(DType::kF32, {1});
    const Fp8Output cpu_fp8{scale.cpu, amax.cpu, scale_inv.cpu};
    const Fp8Output gpu_fp8{scale.gpu, amax.gpu, scale_inv.gpu};
    const Ops::KeptQuantization cpu_kept{kept_scale.cpu, kept_amax.cpu};
    const Ops::KeptQuantization gpu_kept{kept_scale.gpu, kept_amax.gpu};

    // First call: quantizes, as QuantizeTranspose.
    ASSERT_TRUE(cpu_->QuantizeTransposeKept(x.cpu, cpu_fp8, cpu_kept, &y.cpu, &y_t.cpu).ok());
    ASSERT_TRUE(gpu_->QuantizeTransposeKept(x.gpu, gpu_fp8, gpu_kept, &y.gpu, &y_t.gpu).ok());
    ExpectMatches(y, "y");
    ExpectMatches(y_t, "y_t");
    ExpectTransposed(y.gpu, y_t.gpu, rows, cols);
    ExpectScalarMatches(amax, "amax");
    ExpectScalarMatches(scale_inv, "scale_inv");
    ExpectScalarMatches(kept_scale, "kept.scale");
    ExpectScalarMatches(kept_amax, "kept.amax");

    // Same scale: the copies are not rewritten (poisoned here to show it) and
    // the amax comes back from the record after being zeroed.
    const Tensor made = Fetch(y.gpu);
    ASSERT_TRUE(gpu_->Fill(0.0f, &amax.gpu).ok());
    std::vector<uint8_t> poison(static_cast<size_t>(y.gpu.nbytes()), 0x5a);
    ASSERT_TRUE(gpu_->Upload(poison.data(), &y.gpu).ok());
    ASSERT_TRUE(gpu_->QuantizeTransposeKept(x.gpu, gpu_fp8, gpu_kept, &y.gpu, &y_t.gpu).ok());
    EXPECT_EQ(0, std::memcmp(Fetch(y.gpu).data(), poison.data(), poison.size()));
    ExpectScalarMatches(amax, "amax from the record");

    // A new scale: made again, as the CPU makes it.
    ASSERT_TRUE(cpu_->Fill(0.25f, &scale.cpu).ok());
    ASSERT_TRUE(gpu_->Fill(0.25f, &scale.gpu).ok());
    ASSERT_TRUE(cpu_->QuantizeTransposeKept(x.cpu, cpu_fp8, cpu_kept, &y.cpu, &y_t.cpu).ok());
    ASSERT_TRUE(gpu_->QuantizeTransposeKept(x.gpu, gpu_fp8, gpu_kept, &y.gpu, &y_t.gpu).ok());
    ExpectMatches(y, "y after the scale moved");
    ExpectMatches(y_t, "y_t after the scale moved");
    EXPECT_NE(0, std::memcmp(Fetch(y.gpu).data(), made.data(), made.nbytes()));
    ExpectScalarMatches(scale_inv, "scale_inv after the scale moved");
    ExpectScalarMatches(kept_scale, "kept.scale after the scale moved");
    ExpectScalarMatches(amax, "amax after the scale moved");
    ExpectScalarMatches(kept_amax, "kept.amax after the scale moved");
  }
}

// A forward's weight checks in one QuantizeTransposeKeptMany: 90 items
// (more than one launch's 40 of one dtype pair), float32 and bf16 weights
// into E4M3 and E5M2, wide tiles (several blocks an item, past the grid's
// share of some) and shapes only the 64 x 64 kernel takes (checked one by
// one); copies never made (NaN), current (their codes poisoned: left as
// they are, the kept amax copied out) and made with another scale. Every
// output and record as the CPU's per-item calls leave them; then again, all
// current, which changes no code.
TEST_F(Fp8StepOpsTest, QuantizeTransposeKeptManyMatchesOneByOne) {
  struct Item {
    Pair x, y, y_t, scale, amax, scale_inv, kept_scale, kept_amax;
    bool current;
  };
  std::vector<Item> items;
  for (int i = 0; i < 90; ++i) {
    const DType in = i % 3 == 0 ? DType::kBF16 : DType::kF32;
    const DType out = i % 4 == 1 ? DType::kE5M2 : DType::kE4M3;
    const int64_t rows = i % 9 == 4 ? 192 : 128 * (1 + i % 5);  // 192: ragged
    const int64_t cols = 64 * (1 + i % 7) + (i % 11 == 3 ? 4 : 0);
    const int state = i % 3;  // 0: never made, 1: current, 2: another scale
    const float scale = 0.5f + static_cast<float>(i % 6);
    Item item;
    item.x = Random(in, {rows, cols}, 300 + i, -4.0f, 4.0f);
    item.y = Random(DType::kE4M3, {rows, cols}, 500 + i);
    item.y_t = Random(DType::kE4M3, {cols, rows}, 700 + i);
    if (out == DType::kE5M2) {
      item.y = Random(DType::kE5M2, {rows, cols}, 500 + i);
      item.y_t = Random(DType::kE5M2, {cols, rows}, 700 + i);
    }
    item.scale = FromValues(DType::kF32, {1}, {scale});
    item.amax = FromValues(DType::kF32, {1}, {-1.0f});
    item.scale_inv = FromValues(DType::kF32, {1}, {-1.0f});
    item.kept_scale =
        FromValues(DType::kF32, {1}, {state == 0 ? NAN : state == 1 ? scale : scale * 2.0f});
    item.kept_amax = FromValues(DType::kF32, {1}, {0.75f + i});
    item.current = state == 1;
    items.push_back(std::move(item));
  }
  auto batch = [&](bool gpu) {
    std::vector<Ops::KeptQuantizeItem> out;
    for (Item& item : items) {
      auto side = [&](Pair& p) { return gpu ? p.gpu : p.cpu; };
      out.push_back({side(item.x),
                     Fp8Output{side(item.scale), side(item.amax), side(item.scale_inv)},
                     Ops::KeptQuantization{side(item.kept_scale), side(item.kept_amax)},
                     side(item.y), side(item.y_t)});
    }
    return out;
  };
  std::vector<Tensor> poisoned;
  for (const Item& item : items) poisoned.push_back(Fetch(item.y.gpu));
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round == 0 ? "mixed states" : "all current");
    ASSERT_TRUE(cpu_->QuantizeTransposeKeptMany(batch(false)).ok());
    const absl::Status s = gpu_->QuantizeTransposeKeptMany(batch(true));
    ASSERT_TRUE(s.ok()) << s;
    for (size_t i = 0; i < items.size(); ++i) {
      SCOPED_TRACE("item " + std::to_string(i));
      Item& item = items[i];
      ExpectMatches(item.y, "y");
      ExpectMatches(item.y_t, "y_t");
      ExpectScalarMatches(item.amax, "amax");
      ExpectScalarMatches(item.scale_inv, "scale_inv");
      ExpectScalarMatches(item.kept_scale, "kept.scale");
      ExpectScalarMatches(item.kept_amax, "kept.amax");
      const Tensor y = Fetch(item.y.gpu);
      const bool untouched = std::memcmp(y.data(), poisoned[i].data(), y.nbytes()) == 0;
      EXPECT_EQ(untouched, round == 0 ? item.current : true);
      if (round == 0 && !item.current) {
        ExpectTransposed(item.y.gpu, item.y_t.gpu, item.x.gpu.dim(0), item.x.gpu.dim(1));
      }
      poisoned[i] = y;
    }
  }
}

// Each activation TE's MLP takes, from float32 and bf16, into E4M3 and E5M2,
// whole tiles, ragged ones and shapes the tile kernel declines (the
// fallback): y, y_t, amax and scale_inv.
TEST_F(Fp8StepOpsTest, ActivationForwardTransposedMatchesTheCpu) {
  const std::vector<std::vector<Activation>> all = {
      {Activation::kGelu}, {Activation::kRelu}, {Activation::kSilu},
      {Activation::kQuickGelu}, {Activation::kSquaredRelu}, {Activation::kGelu, Activation::kLinear}};
  for (const auto& acts : all) {
    for (DType in : {DType::kF32, DType::kBF16}) {
      for (DType out : {DType::kE4M3, DType::kE5M2}) {
        // Whole 128 x 64 tiles (the wide kernel; the last of them, 1105
        // tiles, more than the grid's blocks), ragged (the 64 x 64 kernel; the
        // last, 1190 tiles) and declined.
        for (const Shape& shape :
             {Shape{2, 64, 256}, Shape{2, 4160, 1088}, Shape{4, 36, 520}, Shape{3, 7, 36},
              Shape{2, 1058, 2180}}) {
          const bool gated = acts.size() == 2;
          const int64_t rows = shape[0] * shape[1];
          const int64_t width = gated ? shape[2] / 2 : shape[2];
          SCOPED_TRACE(std::to_string(static_cast<int>(acts[0])) + (gated ? " gated " : " ") +
                       DTypeName(in) + "->" + DTypeName(out) + " rows " + std::to_string(rows));
          Pair x = Random(in, shape, 11);
          Pair y = Zeros(out, {shape[0], shape[1], width}), y_t = Zeros(out, {width, rows});
          Pair scale = FromValues(DType::kF32, {1}, {3.0f});
          Pair amax = Zeros(DType::kF32, {1}), scale_inv = Zeros(DType::kF32, {1});
          ASSERT_TRUE(cpu_->ActivationForwardTransposed(
                              acts, x.cpu, {scale.cpu, amax.cpu, scale_inv.cpu}, &y.cpu, &y_t.cpu)
                          .ok());
          ASSERT_TRUE(gpu_->ActivationForwardTransposed(
                              acts, x.gpu, {scale.gpu, amax.gpu, scale_inv.gpu}, &y.gpu, &y_t.gpu)
                          .ok());
          ExpectMatches(y, "y");
          ExpectMatches(y_t, "y_t");
          ExpectTransposed(y.gpu, y_t.gpu, rows, width);
          ExpectScalarMatches(amax, "amax");
          ExpectScalarMatches(scale_inv, "scale_inv");
        }
      }
    }
  }
}

// Dact-cast-transpose-dbias (the MLP's wi output gradient under FP8): each
// activation TE's MLP takes, from float32 and bf16, into E5M2 and E4M3, with
// and without dbias, on whole 128 x 64 tiles (the fused kernel; the last,
// 1105 tiles, more than the grid's blocks) and shapes it declines (ragged,
// odd, gated: the default's dx, then cast-transpose): y, y_t, amax,
// scale_inv and dbias against the CPU's.
TEST_F(Fp8StepOpsTest, ActivationBackwardQuantizeTransposeMatchesTheCpu) {
  const std::vector<std::vector<Activation>> all = {
      {Activation::kGelu}, {Activation::kRelu}, {Activation::kSilu},
      {Activation::kSquaredRelu}, {Activation::kGelu, Activation::kLinear}};
  for (const auto& acts : all) {
    for (DType in : {DType::kF32, DType::kBF16}) {
      for (DType out : {DType::kE5M2, DType::kE4M3}) {
        for (const Shape& shape : {Shape{128, 256}, Shape{8320, 1088}, Shape{100, 36},
                                   Shape{516, 1028}, Shape{37, 24}}) {
          for (bool with_dbias : {true, false}) {
            const bool gated = acts.size() == 2;
            const int64_t rows = shape[0], cols = shape[1];
            const int64_t width = gated ? cols / 2 : cols;
            SCOPED_TRACE(std::to_string(static_cast<int>(acts[0])) + (gated ? " gated " : " ") +
                         DTypeName(in) + "->" + DTypeName(out) + " " + ShapeName(shape) +
                         (with_dbias ? " dbias" : ""));
            const Pair x = Random(in, shape, 71, -3.0f, 3.0f);
            Pair dy = Random(in, {rows, width}, 72);
            Pair y = Zeros(out, shape), y_t = Zeros(out, {cols, rows});
            // dbias in x's dtype, so its tolerance is that of dx's values,
            // which may round apart on the two backends (the derivative's
            // last float bits).
            Pair dbias = Zeros(in, {cols});
            Pair scale = FromValues(DType::kF32, {1}, {SaturatingScale(out) * 0.05f});
            Pair amax = Zeros(DType::kF32, {1}), scale_inv = Zeros(DType::kF32, {1});
            ASSERT_TRUE(cpu_->ActivationBackwardQuantizeTranspose(
                                acts, &dy.cpu, x.cpu, {scale.cpu, amax.cpu, scale_inv.cpu},
                                &y.cpu, &y_t.cpu, with_dbias ? &dbias.cpu : nullptr)
                            .ok());
            const absl::Status s = gpu_->ActivationBackwardQuantizeTranspose(
                acts, &dy.gpu, x.gpu, {scale.gpu, amax.gpu, scale_inv.gpu}, &y.gpu, &y_t.gpu,
                with_dbias ? &dbias.gpu : nullptr);
            ASSERT_TRUE(s.ok()) << s;
            ExpectMatches(y, "y");
            ExpectMatches(y_t, "y_t");
            ExpectTransposed(y.gpu, y_t.gpu, rows, cols);
            ExpectScalarMatches(amax, "amax");
            ExpectScalarMatches(scale_inv, "scale_inv");
            EXPECT_GT(Fetch(amax.gpu).data_as<float>()[0], 0.0f);
            if (with_dbias) ExpectMatches(dbias, "dbias");
          }
        }
      }
    }
  }
}

// A step whose amaxes nobody reads (a generation's) leaves Fp8Output::amax
// undefined: every op with an FP8 output then writes the codes and scale_inv
// it writes with an amax, bit for bit, and records none. Each op, on the
// paths its kernels take by shape (vector and scalar, tile and fallback, the
// norms' few-row, fast and general kernels).
TEST_F(Fp8StepOpsTest, AnUnrecordedAmaxChangesNoCodeOrScaleInv) {
  const float scale = SaturatingScale(DType::kE4M3) * 0.5f;
  // Runs `op` with an amax and without, each into fresh outputs (codes
  // zeroed, scale_inv and amax -1), and compares what both wrote.
  auto compare = [&](const std::string& what, const std::vector<Shape>& shapes,
                     const std::function<absl::Status(const Fp8Output&,
                                                      std::vector<Tensor>*)>& op) {
    SCOPED_TRACE(what);
    std::vector<Tensor> recorded, unrecorded;
    for (const Shape& shape : shapes) {
      recorded.push_back(Zeros(DType::kE4M3, shape).gpu);
      unrecorded.push_back(Zeros(DType::kE4M3, shape).gpu);
    }
    Fp8Pair with = Fp8Side(scale), without = Fp8Side(scale);
    Fp8Output bare = without.gpu();
    bare.amax = Tensor();
    ASSERT_TRUE(op(with.gpu(), &recorded).ok());
    const absl::Status s = op(bare, &unrecorded);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE(gpu_->Synchronize().ok());
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Tensor a = Fetch(recorded[i]), b = Fetch(unrecorded[i]);
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << "output " << i;
    }
    EXPECT_GT(Fetch(with.amax.gpu).data_as<float>()[0], 0.0f) << "the recorded run's amax";
    EXPECT_EQ(Fetch(without.amax.gpu).data_as<float>()[0], -1.0f) << "an amax was written";
    EXPECT_EQ(Fetch(without.scale_inv.gpu).data_as<float>()[0], 1.0f / scale) << "scale_inv";
  };
  for (const Shape& shape : {Shape{77, 200}, Shape{33, 101}}) {
    const Pair x = Random(DType::kBF16, shape, 61, -4.0f, 4.0f);
    compare("Quantize " + ShapeName(shape), {shape},
            [&](const Fp8Output& f, std::vector<Tensor>* y) { return gpu_->Quantize(x.gpu, f, &(*y)[0]); });
  }
  for (const Shape& shape : {Shape{128, 256}, Shape{132, 256}, Shape{37, 24}}) {
    const Pair x = Random(DType::kBF16, shape, 62, -4.0f, 4.0f);
    compare("QuantizeTranspose " + ShapeName(shape), {shape, {shape[1], shape[0]}},
            [&](const Fp8Output& f, std::vector<Tensor>* y) {
              return gpu_->QuantizeTranspose(x.gpu, f, &(*y)[0], &(*y)[1]);
            });
  }
  for (const Shape& shape : {Shape{8, 1024}, Shape{300, 1024}, Shape{6, 20000}}) {
    const int64_t cols = shape[1];
    const Pair x = Random(DType::kBF16, shape, 63, -3.0f, 5.0f);
    const Pair gamma = Random(DType::kF32, {cols}, 64, 0.5f, 1.5f);
    const Pair beta = Random(DType::kF32, {cols}, 65);
    compare("NormForward " + ShapeName(shape), {shape},
            [&](const Fp8Output& f, std::vector<Tensor>* y) {
              return gpu_->NormForward(NormArgs(), x.gpu, gamma.gpu, beta.gpu, &(*y)[0], nullptr,
                                       nullptr, &f);
            });
    if (cols > 4096) continue;
    compare("NormForwardTransposed " + ShapeName(shape), {shape, {cols, shape[0]}},
            [&](const Fp8Output& f, std::vector<Tensor>* y) {
              return gpu_->NormForwardTransposed(NormArgs(), x.gpu, gamma.gpu, beta.gpu, f,
                                                 &(*y)[0], &(*y)[1], nullptr, nullptr);
            });
  }
  for (const Shape& shape : {Shape{2, 64, 256}, Shape{3, 7, 36}}) {
    const Pair x = Random(DType::kBF16, shape, 66);
    const int64_t rows = shape[0] * shape[1], width = shape[2];
    compare("ActivationForward " + ShapeName(shape), {shape},
            [&](const Fp8Output& f, std::vector<Tensor>* y) {
              return gpu_->ActivationForward({Activation::kGelu}, x.gpu, &(*y)[0], &f);
            });
    compare("ActivationForwardTransposed " + ShapeName(shape), {shape, {width, rows}},
            [&](const Fp8Output& f, std::vector<Tensor>* y) {
              return gpu_->ActivationForwardTransposed({Activation::kGelu}, x.gpu, f, &(*y)[0],
                                                       &(*y)[1]);
            });
  }
  // A kept copy's record needs the amax it was made with.
  const Pair w = Random(DType::kBF16, {64, 64}, 67);
  Pair kept_scale = FromValues(DType::kF32, {1}, {NAN}), kept_amax = Zeros(DType::kF32, {1});
  Tensor y = Zeros(DType::kE4M3, {64, 64}).gpu, y_t = Zeros(DType::kE4M3, {64, 64}).gpu;
  Fp8Pair side = Fp8Side(scale);
  Fp8Output bare = side.gpu();
  bare.amax = Tensor();
  const absl::Status kept =
      gpu_->QuantizeTransposeKept(w.gpu, bare, {kept_scale.gpu, kept_amax.gpu}, &y, &y_t);
  EXPECT_EQ(kept.code(), absl::StatusCode::kInvalidArgument) << kept;
  EXPECT_NE(kept.message().find("fp8.amax"), std::string::npos) << kept;
}

// The packed qkv's gradient under FP8 with rotary embedding: the inverse
// rotation and the codes in both layouts (with and without dbias) from one
// pass where the CUDA backend takes the shape (bf16 adjacent pairs, S 64 and
// 256, whole 128 x 64 tiles), rotation then quantization elsewhere (float32;
// alternate pairs; 74 rows and 288 columns; S 8): y, y_t, amax, scale_inv and
// dbias against the CPU's, and the GPU's codes, amax and dbias bit for bit
// against its own RotaryQkInPlace then QuantizeTranspose(Dbias), whose
// rotated values the one pass rounds to qkv's dtype as they are stored.
TEST_F(Fp8StepOpsTest, RotaryQkQuantizeTransposeMatchesTheCpuAndTheTwoPasses) {
  for (const Shape& shape : {Shape{2, 64, 3, 4, 32}, Shape{1, 256, 3, 2, 64},
                             Shape{2, 37, 3, 4, 24}, Shape{16, 8, 3, 2, 64}}) {
    for (DType in : {DType::kBF16, DType::kF32}) {
      for (const bool consecutive : {true, false}) {
        for (DType out : {DType::kE5M2, DType::kE4M3}) {
          for (const bool with_dbias : {true, false}) {
            const int64_t rows = shape[0] * shape[1], cols = shape[2] * shape[3] * shape[4];
            SCOPED_TRACE(ShapeName(shape) + " " + DTypeName(in) + "->" + DTypeName(out) +
                         (consecutive ? " consecutive" : " alternate") +
                         (with_dbias ? " dbias" : ""));
            RotaryArgs args;
            args.consecutive = consecutive;
            args.inverse = true;
            const Pair qkv = Random(in, shape, 19);
            const float scale_value = SaturatingScale(out) * 0.05f;
            struct Run {
              Pair y, y_t, dbias, scale, amax, scale_inv;
            };
            auto run = [&] {
              return Run{Zeros(out, {rows, cols}),      Zeros(out, {cols, rows}),
                         Zeros(in, {cols}),             FromValues(DType::kF32, {1}, {scale_value}),
                         Zeros(DType::kF32, {1}),       Zeros(DType::kF32, {1})};
            };
            Run one = run();
            Pair consumed = Clone(qkv.cpu);
            ASSERT_TRUE(cpu_->RotaryQkQuantizeTranspose(
                                args, &consumed.cpu, {one.scale.cpu, one.amax.cpu,
                                                      one.scale_inv.cpu},
                                &one.y.cpu, &one.y_t.cpu, with_dbias ? &one.dbias.cpu : nullptr)
                            .ok());
            const absl::Status s = gpu_->RotaryQkQuantizeTranspose(
                args, &consumed.gpu, {one.scale.gpu, one.amax.gpu, one.scale_inv.gpu},
                &one.y.gpu, &one.y_t.gpu, with_dbias ? &one.dbias.gpu : nullptr);
            ASSERT_TRUE(s.ok()) << s;
            ExpectMatches(one.y, "y");
            ExpectMatches(one.y_t, "y_t");
            ExpectTransposed(one.y.gpu, one.y_t.gpu, rows, cols);
            ExpectScalarMatches(one.amax, "amax");
            ExpectScalarMatches(one.scale_inv, "scale_inv");
            EXPECT_GT(Fetch(one.amax.gpu).data_as<float>()[0], 0.0f);
            if (with_dbias) ExpectMatches(one.dbias, "dbias");

            Run two = run();
            Pair apart = Clone(qkv.cpu);
            ASSERT_TRUE(gpu_->RotaryQkInPlace(args, &apart.gpu).ok());
            const Tensor apart_rows = apart.gpu.Reshaped({rows, cols});
            const Fp8Output fp8{two.scale.gpu, two.amax.gpu, two.scale_inv.gpu};
            ASSERT_TRUE((with_dbias ? gpu_->QuantizeTransposeDbias(apart_rows, fp8, &two.y.gpu,
                                                                   &two.y_t.gpu, &two.dbias.gpu)
                                    : gpu_->QuantizeTranspose(apart_rows, fp8, &two.y.gpu,
                                                              &two.y_t.gpu))
                            .ok());
            for (auto [a, b, what] : {std::tuple{&one.y, &two.y, "y"},
                                      std::tuple{&one.y_t, &two.y_t, "y_t"},
                                      std::tuple{&one.amax, &two.amax, "amax"},
                                      std::tuple{&one.dbias, &two.dbias, "dbias"}}) {
              const Tensor fa = Fetch(a->gpu), fb = Fetch(b->gpu);
              EXPECT_EQ(0, std::memcmp(fa.data(), fb.data(), fa.nbytes()))
                  << what << " differs from the two passes'";
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace gpu_test
}  // namespace te
