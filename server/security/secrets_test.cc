#include "server/security/secrets.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace te::security {
namespace {

std::string TempFile(const std::string& name, const std::string& content) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

TEST(ConstantTimeEqualsTest, ComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "ab"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0c", 3), std::string("a\0d", 3)));
}

TEST(Sha256Test, KnownVector) {
  // FIPS 180-2 example: SHA-256("abc").
  const std::string digest = Sha256("abc");
  ASSERT_EQ(digest.size(), 32u);
  EXPECT_EQ(static_cast<unsigned char>(digest[0]), 0xba);
  EXPECT_EQ(static_cast<unsigned char>(digest[31]), 0xad);
}

TEST(AccessKeyTest, AcceptsOnlyTheKey) {
  absl::StatusOr<AccessKey> key = AccessKey::FromString("correct horse battery staple");
  ASSERT_TRUE(key.ok()) << key.status();
  EXPECT_TRUE(key->Accepts("correct horse battery staple"));
  EXPECT_FALSE(key->Accepts("correct horse battery stapl"));
  EXPECT_FALSE(key->Accepts("correct horse battery staple "));
  EXPECT_FALSE(key->Accepts(""));
}

TEST(AccessKeyTest, ShortKeyIsRefused) {
  EXPECT_EQ(AccessKey::FromString("short").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AccessKeyTest, FileContentIsTrimmed) {
  const std::string path = TempFile("key.txt", "  0123456789abcdef0123\n");
  absl::StatusOr<AccessKey> key = AccessKey::FromFile(path);
  ASSERT_TRUE(key.ok()) << key.status();
  EXPECT_TRUE(key->Accepts("0123456789abcdef0123"));
  EXPECT_FALSE(key->Accepts("  0123456789abcdef0123\n"));
}

TEST(AccessKeyTest, FileErrorsNameTheFlag) {
  absl::StatusOr<AccessKey> missing = AccessKey::FromFile("/no/such/key");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(missing.status().message().find("--access_key_file=/no/such/key"), std::string::npos);
  absl::StatusOr<AccessKey> empty = AccessKey::FromFile(TempFile("empty.txt", "\n"));
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(AccessKeyTest, CheckAccessKeyCodes) {
  absl::StatusOr<AccessKey> key = AccessKey::FromString("0123456789abcdef");
  ASSERT_TRUE(key.ok());
  EXPECT_TRUE(CheckAccessKey(nullptr, "").ok());
  EXPECT_TRUE(CheckAccessKey(&*key, "0123456789abcdef").ok());
  EXPECT_EQ(CheckAccessKey(&*key, "").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(CheckAccessKey(&*key, "0123456789abcdeF").code(), absl::StatusCode::kUnauthenticated);
}

TEST(TokenDigestTest, MatchesItsTokenOnly) {
  absl::StatusOr<TokenDigest> digest = TokenDigest::Of("8f14e45fceea167a5a36dedd4bea2543");
  ASSERT_TRUE(digest.ok()) << digest.status();
  EXPECT_TRUE(digest->WellFormed());
  EXPECT_TRUE(digest->Matches("8f14e45fceea167a5a36dedd4bea2543"));
  EXPECT_FALSE(digest->Matches("8f14e45fceea167a5a36dedd4bea2544"));
  EXPECT_FALSE(digest->Matches(""));
  // The token itself is nowhere in the digest.
  EXPECT_EQ(digest->sha256.find("8f14e45f"), std::string::npos);
}

TEST(TokenDigestTest, SaltsDiffer) {
  absl::StatusOr<TokenDigest> a = TokenDigest::Of("same token");
  absl::StatusOr<TokenDigest> b = TokenDigest::Of("same token");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->salt, b->salt);
  EXPECT_NE(a->sha256, b->sha256);
  EXPECT_TRUE(b->Matches("same token"));
}

TEST(TokenDigestTest, MalformedDigestIsSeen) {
  TokenDigest digest;
  digest.salt = "short";
  digest.sha256 = std::string(32, 'x');
  EXPECT_FALSE(digest.WellFormed());
}

}  // namespace
}  // namespace te::security
