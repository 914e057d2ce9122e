// Replays the seed corpus (tests/fuzz/corpus) and every crash the fuzzer
// found (tests/fuzz/regressions) through the harness, so CI runs them on each
// build, with or without sanitizers; and checks the checked-in corpus is what
// SeedInputs makes now. The harness's own invariant (request_harness.h: a
// failed call leaves the session as it was) traps inside RunOne, so a
// regression that breaks it fails here too.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/fuzz/request_harness.h"
#include "tests/runfiles.h"

namespace te::fuzz {
namespace {

namespace fs = std::filesystem;

std::string Dir(const std::string& name) { return te::testing::RunfilePath("tests/fuzz/" + name); }

// The inputs in `dir` by file name; hidden files (.keep) are not inputs. A
// folder that cannot be read fails the test rather than reading as empty.
std::map<std::string, std::string> ReadAll(const std::string& dir) {
  std::map<std::string, std::string> files;
  std::error_code error;
  fs::directory_iterator it(dir, error);
  EXPECT_FALSE(error) << dir << ": " << error.message();
  for (; !error && it != fs::directory_iterator(); it.increment(error)) {
    const fs::directory_entry& entry = *it;
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name.empty() || name[0] == '.') continue;
    std::ifstream in(entry.path(), std::ios::binary);
    std::stringstream content;
    content << in.rdbuf();
    files[name] = content.str();
  }
  EXPECT_FALSE(error) << dir << ": " << error.message();
  return files;
}

absl::Status RunInput(const std::string& bytes) {
  return RunOne(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

std::string Codes(const std::vector<absl::StatusCode>& codes) {
  std::string out;
  for (absl::StatusCode code : codes) {
    if (!out.empty()) out += " or ";
    out += absl::StatusCodeToString(code);
  }
  return out;
}

TEST(CorpusTest, SeedsAreCheckedInAndRunClean) {
  const std::map<std::string, std::string> corpus = ReadAll(Dir("corpus"));
  const std::vector<Seed> seeds = SeedInputs();
  ASSERT_FALSE(seeds.empty());
  ASSERT_GE(corpus.size(), 1u) << Dir("corpus") << " holds no seeds";
  // Every seed is checked in as it is made now, and nothing else is there.
  EXPECT_EQ(corpus.size(), seeds.size()) << "run tests/fuzz/run_fuzz.sh --seeds";
  for (const Seed& seed : seeds) {
    ASSERT_GT(corpus.count(seed.name), 0u)
        << seed.name << " is missing: run tests/fuzz/run_fuzz.sh --seeds";
    EXPECT_EQ(corpus.at(seed.name), seed.bytes)
        << seed.name << " is stale: run tests/fuzz/run_fuzz.sh --seeds";
  }
  int replayed = 0;
  for (const Seed& seed : seeds) {
    SCOPED_TRACE(seed.name);
    const absl::Status status = RunInput(corpus.at(seed.name));
    ++replayed;
    EXPECT_NE(std::find(seed.allowed.begin(), seed.allowed.end(), status.code()),
              seed.allowed.end())
        << seed.name << ": " << status << "; want " << Codes(seed.allowed);
  }
  EXPECT_EQ(replayed, static_cast<int>(seeds.size()));
}

TEST(CorpusTest, SeedNamesAreUnique) {
  std::map<std::string, int> names;
  for (const Seed& seed : SeedInputs()) EXPECT_EQ(++names[seed.name], 1) << seed.name;
}

TEST(CorpusTest, EveryRpcAndLayerKindHasASeed) {
  std::map<int, int> per_rpc, per_kind;
  for (const Seed& seed : SeedInputs()) {
    ASSERT_GE(seed.bytes.size(), 2u) << seed.name;
    ++per_rpc[static_cast<uint8_t>(seed.bytes[0])];
    ++per_kind[(static_cast<uint8_t>(seed.bytes[1]) >> 3) & 7];
  }
  for (int rpc = 0; rpc < kRpcCount; ++rpc) EXPECT_GT(per_rpc[rpc], 0) << "rpc " << rpc;
  for (int kind = 0; kind < kLayerKindCount; ++kind) {
    EXPECT_GT(per_kind[kind], 0) << "layer kind " << kind;
  }
}

// Each file is an input the fuzzer once crashed the server (or broke the
// invariant) with; replaying it must neither crash nor trap. There must be
// some: an empty or unreadable folder (a wrong runfiles path, a glob that
// matched nothing) would pass vacuously.
TEST(CorpusTest, RegressionsRunClean) {
  const std::map<std::string, std::string> regressions = ReadAll(Dir("regressions"));
  ASSERT_GE(regressions.size(), 1u) << Dir("regressions") << " holds no regression inputs";
  int replayed = 0;
  for (const auto& [name, bytes] : regressions) {
    SCOPED_TRACE(name);
    RunInput(bytes).IgnoreError();
    ++replayed;
  }
  EXPECT_EQ(replayed, static_cast<int>(regressions.size()));
}

TEST(CorpusTest, ShortAndEmptyInputsAreHarmless) {
  EXPECT_FALSE(RunInput("").ok());
  EXPECT_FALSE(RunInput(std::string(1, '\x03')).ok());
  for (int rpc = 0; rpc < kRpcCount; ++rpc) {
    for (int kind = 0; kind < kLayerKindCount; ++kind) {
      const char flags = static_cast<char>(KindFlags(static_cast<LayerKind>(kind)));
      RunInput(std::string{static_cast<char>(rpc), flags}).IgnoreError();
      RunInput(
          std::string{static_cast<char>(rpc), static_cast<char>(flags | 7), '\xff', '\xff', '\xff'})
          .IgnoreError();
    }
  }
}

}  // namespace
}  // namespace te::fuzz
