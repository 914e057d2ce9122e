// write_seeds DIR: writes the seed corpus (SeedInputs) into DIR, one file per
// input. tests/fuzz/corpus/ was made with it.
#include <cstdio>
#include <fstream>

#include "tests/fuzz/request_harness.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: write_seeds DIR\n");
    return 2;
  }
  for (const te::fuzz::Seed& seed : te::fuzz::SeedInputs()) {
    std::ofstream(std::string(argv[1]) + "/" + seed.name, std::ios::binary) << seed.bytes;
  }
  return 0;
}
