#include "server/session/log.h"

#include <string>

#include "gtest/gtest.h"

namespace te::session {
namespace {

const absl::Time kTime = absl::FromUnixMillis(1738324800123);  // 2025-01-31 12:00:00.123 UTC

TEST(LogLineTest, KeyValueFieldsWithTheSession) {
  EXPECT_EQ(FormatLogLine(LogLevel::kInfo, kTime, "0123abcd", "layer-1 initialised",
                          {{"rpc", "InitLayer"}, {"code", "OK"}}),
            "ts=2025-01-31T12:00:00.123Z level=info session=0123abcd "
            "msg=\"layer-1 initialised\" rpc=InitLayer code=OK");
}

TEST(LogLineTest, NoSessionFieldWhenNoneConcerned) {
  EXPECT_EQ(FormatLogLine(LogLevel::kWarning, kTime, "", "listening", {}),
            "ts=2025-01-31T12:00:00.123Z level=warning msg=\"listening\"");
}

TEST(LogLineTest, EscapesKeepOneLine) {
  const std::string line =
      FormatLogLine(LogLevel::kError, kTime, "s", "a \"quoted\"\nsecond\\line\x01",
                    {{"path", "with space"}, {"empty", ""}});
  EXPECT_EQ(line.find('\n'), std::string::npos);
  EXPECT_EQ(line,
            "ts=2025-01-31T12:00:00.123Z level=error session=s "
            "msg=\"a \\\"quoted\\\"\\nsecond\\\\line\\x01\" path=\"with space\" empty=\"\"");
}

TEST(LogLineTest, HostileSessionIdIsQuoted) {
  // Ids come from requests in failure lines: one must not forge a field.
  EXPECT_EQ(FormatLogLine(LogLevel::kInfo, kTime, "x level=error", "m", {}),
            "ts=2025-01-31T12:00:00.123Z level=info session=\"x level=error\" msg=\"m\"");
}

TEST(LogLevelTest, ParsesTheThreeNamesAndNamesTheFlagOtherwise) {
  EXPECT_EQ(*ParseLogLevel("--log_level", "warning"), LogLevel::kWarning);
  EXPECT_EQ(*ParseLogLevel("--log_level", "error"), LogLevel::kError);
  const absl::StatusOr<LogLevel> bad = ParseLogLevel("--log_level", "debug");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--log_level=debug"), std::string::npos);
}

TEST(LogLevelTest, LinesBelowTheMinimumAreDropped) {
  SetMinLogLevel(LogLevel::kWarning);
  testing::internal::CaptureStderr();
  Log(LogLevel::kInfo, "dropped");
  Log(LogLevel::kWarning, "kept warning");
  LogForSession(LogLevel::kError, "s", "kept error");
  const std::string written = testing::internal::GetCapturedStderr();
  SetMinLogLevel(LogLevel::kInfo);
  EXPECT_EQ(written.find("dropped"), std::string::npos);
  EXPECT_NE(written.find("kept warning"), std::string::npos);
  EXPECT_NE(written.find("kept error"), std::string::npos);
}

}  // namespace
}  // namespace te::session
