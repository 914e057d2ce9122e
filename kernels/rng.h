// Counter-based random numbers shared by every backend, so that dropout with
// one seed drops the same elements on the CPU and on the GPU.
#ifndef TE_KERNELS_RNG_H_
#define TE_KERNELS_RNG_H_

#include <cstdint>
#include <string_view>

#if defined(__CUDACC__)
#define TE_HOST_DEVICE __host__ __device__
#else
#define TE_HOST_DEVICE
#endif

namespace te {

// splitmix64's finaliser: a bijective mix with full avalanche.
TE_HOST_DEVICE inline uint64_t MixBits(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Uniform in [0, 1) with 24 random bits, a pure function of (seed, index).
TE_HOST_DEVICE inline float DropoutUniform(uint64_t seed, uint64_t index) {
  const uint64_t bits = MixBits(MixBits(seed + 0x9e3779b97f4a7c15ULL) ^ index);
  return static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
}

// Uniform in (0, 1) with 53 random bits, a pure function of (stream, index):
// what the host's initialisers draw from (never 0 or 1, so an inverse CDF
// stays finite).
inline double UniformOpen01(uint64_t stream, uint64_t index) {
  const uint64_t bits = MixBits(MixBits(stream + 0x9e3779b97f4a7c15ULL * (index + 1)) ^ index);
  return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// A 64-bit hash of a name's bytes (FNV-1a).
inline uint64_t NameHash(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

// The one way a seed is made from another: the seed named `name` under
// `seed`. A graph node's init key and dropout seed come from the layer's
// under the node's name (te.v1.GraphSpec), so they do not depend on the order
// nodes are listed or run in; a dropout site's from the step's under the
// site's scope ("mlp/intermediate_dropout"), so sites never share a mask; a
// variable's initial values from its module's key under the variable's path;
// a timed step's dropout seed from the run's under "step/<i>". The clients
// derive seeds with the same function (te_client.graph.derive_seed), so a
// module run alone with DeriveSeed(seed, "DenseGeneral_0") draws the numbers
// a graph's node of that name does.
inline uint64_t DeriveSeed(uint64_t seed, std::string_view name) {
  return MixBits(seed ^ MixBits(NameHash(name)));
}

}  // namespace te

#endif  // TE_KERNELS_RNG_H_
