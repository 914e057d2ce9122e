// Counter-based random numbers shared by every backend, so that dropout with
// one seed drops the same elements on the CPU and on the GPU.
#ifndef TE_KERNELS_RNG_H_
#define TE_KERNELS_RNG_H_

#include <cstdint>

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

// A 64-bit hash of a name's bytes (FNV-1a).
inline uint64_t NameHash(const char* name, uint64_t size) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (uint64_t i = 0; i < size; ++i) {
    h ^= static_cast<unsigned char>(name[i]);
    h *= 0x100000001b3ULL;
  }
  return h;
}

// A graph node's seed (its init key, or its dropout seed) from the layer's
// and the node's name (te.v1.GraphSpec): independent of the order nodes are
// listed or run in. The server and both clients derive node seeds this way,
// and so do chains of modules (a stage's name is its node's).
inline uint64_t NodeSeed(uint64_t seed, const char* name, uint64_t size) {
  return MixBits(seed ^ MixBits(NameHash(name, size)));
}

}  // namespace te

#endif  // TE_KERNELS_RNG_H_
