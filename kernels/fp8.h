// Number formats shared by both backends: bf16, fp16, FP8 E4M3 and E5M2.
//
// Every cast rounds to nearest, ties to even. FP8 casts saturate: a finite or
// infinite value beyond the format's max becomes +-max (TE's casts do this);
// NaN stays NaN. bf16 and fp16 casts overflow to inf like IEEE casts.
// These are __host__ __device__ so the CUDA kernels compute bit-identical
// values to the CPU reference.
#ifndef TE_KERNELS_FP8_H_
#define TE_KERNELS_FP8_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/rng.h"  // TE_HOST_DEVICE
#include "kernels/tensor.h"

namespace te {

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr float kFp16Max = 65504.0f;
constexpr float kE2M1Max = 6.0f;  // NVFP4 values

inline float Fp8Max(DType dtype) { return dtype == DType::kE5M2 ? kE5M2Max : kE4M3Max; }

TE_HOST_DEVICE inline uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
TE_HOST_DEVICE inline float BitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ---- bf16: the top 16 bits of a float32 -------------------------------------
TE_HOST_DEVICE inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
TE_HOST_DEVICE inline float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// ---- a small float format with `mbits` mantissa bits and exponent bias `bias`.
// Rounds |x| to the format's grid (nearest even), without saturation.
TE_HOST_DEVICE inline float RoundToGrid(float a, int mbits, int bias) {
  int e;
  frexpf(a, &e);  // a = f * 2^e, f in [0.5, 1): the leading bit is 2^(e-1)
  int exp = e - 1;
  if (exp < 1 - bias) exp = 1 - bias;  // subnormal: fixed quantum
  const float quantum = ldexpf(1.0f, exp - mbits);
  return rintf(a / quantum) * quantum;  // exact division; rintf ties to even
}

// Powers of two built from their exponent field: exact, and the same on the
// host and the device.
TE_HOST_DEVICE inline float PowerOfTwo(int exp) {
  return BitsFloat(static_cast<uint32_t>(exp + 127) << 23);
}

// The code of a magnitude `a` (finite, >= 0) in a format of `mbits` mantissa
// bits and exponent bias `bias`, rounded to nearest, ties to even, from the
// float's bits: the grid RoundToGrid defines. A value that rounds past the
// largest finite code gives the code after it (callers saturate or overflow).
// Below 2^(1 - bias) the codes count quanta of 2^(1 - bias - mbits): a times
// the inverse quantum is exact, and a count of 2^mbits is the first normal
// code. Above, adding half an ulp of the target (less one, plus the kept
// bits' lowest: ties to even) carries into the exponent where it must.
TE_HOST_DEVICE inline uint32_t EncodeMagnitude(float a, int mbits, int bias) {
  if (a < PowerOfTwo(1 - bias)) {
    return static_cast<uint32_t>(rintf(a * PowerOfTwo(bias - 1 + mbits)));
  }
  const int shift = 23 - mbits;
  const uint32_t u = FloatBits(a);
  const uint32_t rounded = u + (1u << (shift - 1)) - 1u + ((u >> shift) & 1u);
  return (rounded >> shift) - (static_cast<uint32_t>(127 - bias) << mbits);
}

TE_HOST_DEVICE inline float DecodeBits(uint32_t bits, int mbits, int bias) {
  const uint32_t exp = bits >> mbits;
  const uint32_t mant = bits & ((1u << mbits) - 1);
  if (exp == 0) return static_cast<float>(mant) * PowerOfTwo(1 - bias - mbits);
  return BitsFloat(((exp + 127 - bias) << 23) | (mant << (23 - mbits)));
}

// An FP8 code of x (both formats: sign bit 7, NaN 0x7f), saturating at
// +-max_value (inf included).
TE_HOST_DEVICE inline uint8_t FloatToFp8(float x, float max_value, int mbits, int bias) {
  if (x != x) return 0x7f;
  const uint32_t sign = FloatBits(x) >> 31 << 7;
  const float a = fabsf(x);
  const uint32_t max_code = EncodeMagnitude(max_value, mbits, bias);
  const uint32_t code = a >= max_value ? max_code : EncodeMagnitude(a, mbits, bias);
  return static_cast<uint8_t>(sign | (code > max_code ? max_code : code));
}

// The value of an IEEE-like code (E5M2, fp16) whose sign is bit `sign_bit`:
// magnitude inf_code is inf, above it NaN.
TE_HOST_DEVICE inline float DecodeWithInf(uint32_t code, int sign_bit, uint32_t inf_code,
                                          int mbits, int bias) {
  const uint32_t mag = code & ((1u << sign_bit) - 1u);
  float v;
  if (mag == inf_code) v = INFINITY;
  else if (mag > inf_code) v = NAN;
  else v = DecodeBits(mag, mbits, bias);
  return (code >> sign_bit & 1u) ? -v : v;
}

// ---- FP8 E4M3 (bias 7, no inf; 0x7f / 0xff are NaN; max 448) ----------------
TE_HOST_DEVICE inline uint8_t FloatToE4M3(float x) { return FloatToFp8(x, kE4M3Max, 3, 7); }
TE_HOST_DEVICE inline float E4M3ToFloat(uint8_t b) {
  const uint32_t mag = b & 0x7fu;
  if (mag == 0x7fu) return NAN;
  const float v = DecodeBits(mag, 3, 7);
  return (b & 0x80u) ? -v : v;
}

// ---- FP8 E5M2 (bias 15, IEEE-like: 0x7c inf, 0x7d-0x7f NaN; max 57344) -------
TE_HOST_DEVICE inline uint8_t FloatToE5M2(float x) { return FloatToFp8(x, kE5M2Max, 2, 15); }
TE_HOST_DEVICE inline float E5M2ToFloat(uint8_t b) { return DecodeWithInf(b, 7, 0x7cu, 2, 15); }

// ---- fp16 (IEEE binary16: overflow to inf) ------------------------------------
TE_HOST_DEVICE inline uint16_t FloatToFp16(float x) {
  if (x != x) return 0x7e00;
  const uint32_t sign = FloatBits(x) >> 31 << 15;
  const float a = fabsf(x);
  // Values at or above 65520 round up past the max: inf.
  if (a >= 65520.0f) return static_cast<uint16_t>(sign | 0x7c00u);
  return static_cast<uint16_t>(sign | EncodeMagnitude(a, 10, 15));
}
TE_HOST_DEVICE inline float Fp16ToFloat(uint16_t h) {
  return DecodeWithInf(h, 15, 0x7c00u, 10, 15);
}

// ---- E2M1 (NVFP4 values: 0, 0.5, 1, 1.5, 2, 3, 4, 6), saturating; as float.
TE_HOST_DEVICE inline float RoundToE2M1(float x) {
  if (x != x) return x;
  const float a = fabsf(x);
  const float r = a >= kE2M1Max ? kE2M1Max : RoundToGrid(a, 1, 1);
  return copysignf(r > kE2M1Max ? kE2M1Max : r, x);
}

// Round-trips a float through `dtype`'s format (float dtypes).
TE_HOST_DEVICE inline float RoundTo(DType dtype, float x) {
  switch (dtype) {
    case DType::kBF16: return Bf16ToFloat(FloatToBf16(x));
    case DType::kF16: return Fp16ToFloat(FloatToFp16(x));
    case DType::kE4M3: return E4M3ToFloat(FloatToE4M3(x));
    case DType::kE5M2: return E5M2ToFloat(FloatToE5M2(x));
    default: return x;
  }
}

}  // namespace te

#endif  // TE_KERNELS_FP8_H_
