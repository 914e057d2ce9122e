#include "server/session/log.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace te::session {
namespace {

absl::Mutex log_mutex;

char Letter(LogLevel level) {
  switch (level) {
    case LogLevel::kWarning: return 'W';
    case LogLevel::kError: return 'E';
    default: return 'I';
  }
}

void Write(LogLevel level, absl::string_view prefix, absl::string_view message) {
  const std::string line =
      absl::StrCat(absl::FormatTime("%Y-%m-%d %H:%M:%E3S", absl::Now(), absl::UTCTimeZone()),
                   " ", std::string(1, Letter(level)), " ", prefix, message, "\n");
  absl::MutexLock lock(&log_mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace

void Log(LogLevel level, absl::string_view message) { Write(level, "", message); }

void LogForSession(LogLevel level, absl::string_view session_id, absl::string_view message) {
  Write(level, absl::StrCat("session=", session_id, ": "), message);
}

}  // namespace te::session
