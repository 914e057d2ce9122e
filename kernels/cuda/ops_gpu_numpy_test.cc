// jax.numpy's ops (Binary, Unary, Where and their backward, Reduce,
// Softmax, Slice) on the GPU against the CPU reference on random data: every
// op x float dtype, broadcast shapes with odd sizes, both work splits of the
// reductions (a thread per output, a block per output) and both of softmax.
// The matrix and tolerances: ops_gpu_test.h.
#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops_gpu_test.h"

namespace te {
namespace gpu_test {
namespace {

class NumpyOpsTest : public GpuTest, public ::testing::WithParamInterface<DType> {
 protected:
  // Runs `op` on both backends and compares `out`.
  template <typename F>
  void Both(Pair* out, const std::string& what, F op) {
    const absl::Status c = op(*cpu_, out->cpu, false);
    const absl::Status g = op(*gpu_, out->gpu, true);
    ASSERT_TRUE(c.ok()) << what << ": " << c;
    ASSERT_TRUE(g.ok()) << what << ": " << g;
    ExpectMatches(*out, what);
  }
};

const BinaryOp kArithmetic[] = {BinaryOp::kAdd,    BinaryOp::kSubtract, BinaryOp::kMultiply,
                                BinaryOp::kDivide, BinaryOp::kMaximum,  BinaryOp::kMinimum,
                                BinaryOp::kPower};
const BinaryOp kComparisons[] = {BinaryOp::kGreater, BinaryOp::kGreaterEqual,
                                 BinaryOp::kLess,    BinaryOp::kLessEqual,
                                 BinaryOp::kEqual,   BinaryOp::kNotEqual};

// (a, b, y) shapes: both broadcast, one broadcast, leading dims added, none.
const std::vector<std::vector<Shape>> kBroadcasts = {
    {{7, 33, 5}, {33, 1}, {7, 33, 5}},
    {{1, 5}, {7, 3, 5}, {7, 3, 5}},
    {{130, 1, 3}, {1, 67, 3}, {130, 67, 3}},
    {{2, 3, 4, 5, 6}, {2, 1, 4, 1, 6}, {2, 3, 4, 5, 6}},
    {{1000}, {1000}, {1000}},
};

TEST_P(NumpyOpsTest, BinaryForwardAndBackward) {
  const DType dtype = GetParam();
  for (const std::vector<Shape>& s : kBroadcasts) {
    // Positive operands, so divide and power stay finite.
    const Pair a = Random(dtype, s[0], 1, 0.25f, 2.0f), b = Random(dtype, s[1], 2, 0.25f, 2.0f);
    const Pair dy = Random(dtype, s[2], 3);
    for (BinaryOp op : kArithmetic) {
      const std::string what = absl::StrCat("Binary ", static_cast<int>(op), " ", ShapeName(s[2]));
      BinaryArgs args;
      args.op = op;
      Pair y = Output(dtype, s[2]);
      Both(&y, what, [&](Ops& ops, Tensor& out, bool gpu) {
        return ops.Binary(args, gpu ? a.gpu : a.cpu, gpu ? b.gpu : b.cpu, &out);
      });
      Pair da = Output(DType::kF32, s[2]), db = Output(dtype, s[2]);
      for (Ops* ops : {cpu_, gpu_}) {
        const bool gpu = ops == gpu_;
        ASSERT_TRUE(ops->BinaryBackward(args, gpu ? dy.gpu : dy.cpu, gpu ? a.gpu : a.cpu,
                                        gpu ? b.gpu : b.cpu, gpu ? &da.gpu : &da.cpu,
                                        gpu ? &db.gpu : &db.cpu)
                        .ok());
      }
      ExpectMatches(da, what + " da");
      ExpectMatches(db, what + " db");
      // The scalar forms.
      for (bool first : {false, true}) {
        args.has_scalar = true;
        args.scalar = 0.75f;
        args.scalar_first = first;
        Pair ys = Output(dtype, s[0]);
        Both(&ys, what + " scalar", [&](Ops& ops, Tensor& out, bool gpu) {
          return ops.Binary(args, gpu ? a.gpu : a.cpu, Tensor(), &out);
        });
        const Pair dys = Random(dtype, s[0], 4);
        Pair das = Output(dtype, s[0]);
        Both(&das, what + " scalar backward", [&](Ops& ops, Tensor& out, bool gpu) {
          return ops.BinaryBackward(args, gpu ? dys.gpu : dys.cpu, gpu ? a.gpu : a.cpu, Tensor(),
                                    &out, nullptr);
        });
        args = BinaryArgs{op};
      }
    }
    for (BinaryOp op : kComparisons) {
      Pair y = Output(DType::kBool, s[2]);
      Both(&y, absl::StrCat("comparison ", static_cast<int>(op)),
           [&](Ops& ops, Tensor& out, bool gpu) {
             return ops.Binary(BinaryArgs{op}, gpu ? a.gpu : a.cpu, gpu ? b.gpu : b.cpu, &out);
           });
    }
  }
}

TEST_P(NumpyOpsTest, UnaryForwardAndBackward) {
  const DType dtype = GetParam();
  const Shape shape = {37, 129};
  const Pair x = Random(dtype, shape, 5, -3.0f, 3.0f);
  const Pair positive = Random(dtype, shape, 6, 0.1f, 3.0f);
  const Pair dy = Random(dtype, shape, 7);
  for (UnaryOp op :
       {UnaryOp::kNegative, UnaryOp::kExp, UnaryOp::kLog, UnaryOp::kTanh, UnaryOp::kSqrt,
        UnaryOp::kRsqrt, UnaryOp::kAbs, UnaryOp::kSquare, UnaryOp::kSigmoid, UnaryOp::kRelu,
        UnaryOp::kSilu, UnaryOp::kGelu, UnaryOp::kGeluExact}) {
    const bool needs_positive =
        op == UnaryOp::kLog || op == UnaryOp::kSqrt || op == UnaryOp::kRsqrt;
    const Pair& in = needs_positive ? positive : x;
    const std::string what = absl::StrCat("Unary ", static_cast<int>(op));
    Pair y = Output(dtype, shape);
    Both(&y, what, [&](Ops& ops, Tensor& out, bool gpu) {
      return ops.Unary(op, gpu ? in.gpu : in.cpu, &out);
    });
    Pair dx = Output(DType::kF32, shape);
    Both(&dx, what + " backward", [&](Ops& ops, Tensor& out, bool gpu) {
      return ops.UnaryBackward(op, gpu ? dy.gpu : dy.cpu, gpu ? in.gpu : in.cpu, &out);
    });
  }
  // logical_not of a comparison: bool to bool.
  Pair cond = Output(DType::kBool, shape);
  ASSERT_TRUE(
      cpu_->Binary(BinaryArgs{BinaryOp::kGreater, true, 0.0f}, x.cpu, Tensor(), &cond.cpu).ok());
  const Pair c = Mirror(cond.cpu);
  Pair n = Output(DType::kBool, shape);
  Both(&n, "logical_not", [&](Ops& ops, Tensor& out, bool gpu) {
    return ops.Unary(UnaryOp::kLogicalNot, gpu ? c.gpu : c.cpu, &out);
  });
}

TEST_P(NumpyOpsTest, WhereBroadcastingAndConstants) {
  const DType dtype = GetParam();
  const Shape out_shape = {5, 67, 9};
  const Pair v = Random(dtype, {67, 1}, 8);
  Pair cond_cpu = Output(DType::kBool, {67, 1});
  ASSERT_TRUE(
      cpu_->Binary(BinaryArgs{BinaryOp::kGreater, true, 0.0f}, v.cpu, Tensor(), &cond_cpu.cpu)
          .ok());
  const Pair cond = Mirror(cond_cpu.cpu);
  const Pair x = Random(dtype, out_shape, 9), y = Random(DType::kF32, {9}, 10);
  for (int constants = 0; constants < 3; ++constants) {
    WhereArgs args;
    args.has_x_scalar = constants == 1;
    args.x_scalar = 0.5f;
    args.has_y_scalar = constants == 2;
    args.y_scalar = -2.0f;
    Pair out = Output(dtype, out_shape);
    Both(&out, absl::StrCat("Where constants ", constants), [&](Ops& ops, Tensor& o, bool gpu) {
      return ops.Where(args, gpu ? cond.gpu : cond.cpu, gpu ? x.gpu : x.cpu, gpu ? y.gpu : y.cpu,
                       &o);
    });
  }
}

TEST_P(NumpyOpsTest, ReductionsBothSplits) {
  const DType dtype = GetParam();
  const Shape shape = {5, 130, 7};
  const Pair x = Random(dtype, shape, 11);
  // Kept dims per case: the output's shape (x's with the reduced dims 1).
  const std::vector<Shape> outputs = {
      {5, 1, 7},    // 130 terms each: a block per output
      {1, 130, 1},  // 35 terms: a thread per output
      {1, 1, 1},    // everything
      {5, 130, 1},  // the last axis alone
      {5, 130, 7},  // nothing reduced
  };
  for (const Shape& keep : outputs) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin}) {
      Pair y = Output(DType::kF32, keep);
      Both(&y, absl::StrCat("Reduce ", static_cast<int>(op), " to ", ShapeName(keep)),
           [&](Ops& ops, Tensor& out, bool gpu) {
             return ops.Reduce(op, gpu ? x.gpu : x.cpu, &out);
           });
    }
  }
}

TEST_P(NumpyOpsTest, SoftmaxBothSplits) {
  const DType dtype = GetParam();
  const Shape shape = {3, 100, 5};
  const Pair x = Random(dtype, shape, 12, -8.0f, 8.0f);
  const Pair dy = Random(dtype, shape, 13);
  for (bool log : {false, true}) {
    for (int axis : {0, 1, 2}) {  // n = 3 and 5: a thread per row; 100: a block
      const std::string what = absl::StrCat(log ? "log_softmax" : "softmax", " axis ", axis);
      Pair y = Output(dtype, shape);
      Both(&y, what, [&](Ops& ops, Tensor& out, bool gpu) {
        return ops.Softmax(log, axis, gpu ? x.gpu : x.cpu, &out);
      });
      const Pair ys = Mirror(y.cpu);  // the backward reads the same y on both
      Pair dx = Output(dtype, shape);
      Both(&dx, what + " backward", [&](Ops& ops, Tensor& out, bool gpu) {
        return ops.SoftmaxBackward(log, axis, gpu ? dy.gpu : dy.cpu, gpu ? ys.gpu : ys.cpu, &out);
      });
    }
  }
}

TEST_P(NumpyOpsTest, SlicesAreExact) {
  const DType dtype = GetParam();
  const Pair x = Random(dtype, {9, 17, 6}, 14);
  const std::vector<int64_t> start = {1, 2, 0}, stride = {2, 3, 1};
  const Shape y_shape = {4, 5, 6};
  Pair y = Output(dtype, y_shape);
  Both(&y, "Slice", [&](Ops& ops, Tensor& out, bool gpu) {
    return ops.Slice(gpu ? x.gpu : x.cpu, start, stride, &out);
  });
  const Tensor got = Fetch(y.gpu);
  EXPECT_EQ(0, std::memcmp(got.data(), y.cpu.data(), got.nbytes()));
  const Pair dy = Random(dtype, y_shape, 15);
  Pair dx = Output(dtype, {9, 17, 6});
  Both(&dx, "SliceBackward", [&](Ops& ops, Tensor& out, bool gpu) {
    return ops.SliceBackward(gpu ? dy.gpu : dy.cpu, start, stride, &out);
  });
  const Tensor got_dx = Fetch(dx.gpu);
  EXPECT_EQ(0, std::memcmp(got_dx.data(), dx.cpu.data(), got_dx.nbytes()));
}

TEST_F(GpuTest, SlicesOfIdsAndMasks) {
  for (DType dtype : {DType::kI32, DType::kBool}) {
    Tensor host = NewCpu(dtype, {6, 11});
    for (int64_t i = 0; i < host.numel(); ++i) StoreFromFloat(&host, i, static_cast<float>(i % 3));
    const Pair x = Mirror(host);
    Pair y = Output(dtype, {3, 3});
    ASSERT_TRUE(cpu_->Slice(x.cpu, {1, 2}, {2, 4}, &y.cpu).ok());
    ASSERT_TRUE(gpu_->Slice(x.gpu, {1, 2}, {2, 4}, &y.gpu).ok());
    ExpectMatches(y, absl::StrCat("Slice ", Short(dtype)));
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, NumpyOpsTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(Short(info.param));
                         });

}  // namespace
}  // namespace gpu_test
}  // namespace te
