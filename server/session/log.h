// Server log lines on stderr: one line per event, as key=value fields, with
// the session id on every line that concerns a session:
//   ts=2025-01-31T12:00:00.123Z level=info session=0123... msg="layer-1 initialised" rpc=Forward
// msg and any value with a space, quote, '=' or control character are quoted,
// with \" \\ \n \t and \xHH escapes, so a message can never break the line.
// Thread-safe (lines never interleave).
#ifndef TE_SERVER_SESSION_LOG_H_
#define TE_SERVER_SESSION_LOG_H_

#include <initializer_list>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace te::session {

enum class LogLevel { kInfo, kWarning, kError };

// Lines below `level` are dropped (the server's --log_level); kInfo at start.
void SetMinLogLevel(LogLevel level);
// "info", "warning", "error"; INVALID_ARGUMENT naming `flag` otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view flag, absl::string_view name);

// Extra fields after msg, in order: {"rpc", "Forward"}, {"code", "NOT_FOUND"}.
using LogFields = std::initializer_list<std::pair<absl::string_view, absl::string_view>>;

void Log(LogLevel level, absl::string_view message, LogFields fields = {});
void LogForSession(LogLevel level, absl::string_view session_id, absl::string_view message,
                   LogFields fields = {});

// The line Log writes (without its newline); `session_id` empty: no session field.
std::string FormatLogLine(LogLevel level, absl::Time time, absl::string_view session_id,
                          absl::string_view message, LogFields fields);

}  // namespace te::session

#endif  // TE_SERVER_SESSION_LOG_H_
