#include "server/session/log.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace te::session {
namespace {

absl::Mutex log_mutex;
std::atomic<LogLevel> min_level{LogLevel::kInfo};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "info";
}

bool NeedsQuotes(absl::string_view value) {
  if (value.empty()) return true;
  for (char c : value) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u <= ' ' || u >= 0x7f || c == '"' || c == '=' || c == '\\') return true;
  }
  return false;
}

void AppendValue(absl::string_view value, bool always_quote, std::string* line) {
  if (!always_quote && !NeedsQuotes(value)) {
    absl::StrAppend(line, value);
    return;
  }
  line->push_back('"');
  for (char c : value) {
    const unsigned char u = static_cast<unsigned char>(c);
    switch (c) {
      case '"': line->append("\\\""); break;
      case '\\': line->append("\\\\"); break;
      case '\n': line->append("\\n"); break;
      case '\t': line->append("\\t"); break;
      default:
        if (u < ' ' || u == 0x7f) {
          absl::StrAppend(line, absl::StrFormat("\\x%02x", u));
        } else {
          line->push_back(c);  // UTF-8 passes through
        }
    }
  }
  line->push_back('"');
}

void Write(LogLevel level, absl::string_view session_id, absl::string_view message,
           LogFields fields) {
  if (level < min_level.load(std::memory_order_relaxed)) return;
  const std::string line =
      absl::StrCat(FormatLogLine(level, absl::Now(), session_id, message, fields), "\n");
  absl::MutexLock lock(&log_mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace

std::string FormatLogLine(LogLevel level, absl::Time time, absl::string_view session_id,
                          absl::string_view message, LogFields fields) {
  std::string line = absl::StrCat(
      "ts=", absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", time, absl::UTCTimeZone()),
      " level=", LevelName(level));
  if (!session_id.empty()) {
    line.append(" session=");
    AppendValue(session_id, /*always_quote=*/false, &line);
  }
  line.append(" msg=");
  AppendValue(message, /*always_quote=*/true, &line);
  for (const auto& [key, value] : fields) {
    absl::StrAppend(&line, " ", key, "=");
    AppendValue(value, /*always_quote=*/false, &line);
  }
  return line;
}

void SetMinLogLevel(LogLevel level) { min_level.store(level, std::memory_order_relaxed); }

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view flag, absl::string_view name) {
  for (LogLevel level : {LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError}) {
    if (name == LevelName(level)) return level;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(flag, "=", name, ": want info, warning or error"));
}

void Log(LogLevel level, absl::string_view message, LogFields fields) {
  Write(level, "", message, fields);
}

void LogForSession(LogLevel level, absl::string_view session_id, absl::string_view message,
                   LogFields fields) {
  Write(level, session_id, message, fields);
}

}  // namespace te::session
