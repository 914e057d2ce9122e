// Server log lines on stderr, one per event, with the session id on lines that
// concern one:  "2025-01-31 12:00:00.123 I session=0123...: layer-1 initialised".
// Thread-safe (lines never interleave).
#ifndef TE_SERVER_SESSION_LOG_H_
#define TE_SERVER_SESSION_LOG_H_

#include "absl/strings/string_view.h"

namespace te::session {

enum class LogLevel { kInfo, kWarning, kError };

void Log(LogLevel level, absl::string_view message);
void LogForSession(LogLevel level, absl::string_view session_id, absl::string_view message);

}  // namespace te::session

#endif  // TE_SERVER_SESSION_LOG_H_
