// Log: one line on stderr per event, the server's only log sink, as text or
// as JSON for log collectors (--log_format).
//
//   Log(absl::StrCat("listening on ", address));
//   Log(LogLevel::kError, "cannot start", {{"error", status.ToString()}});
//
// text: packd 2026-12-01T10:00:00.000Z cannot start error=...
// json: {"time":"2026-12-01T10:00:00.000Z","level":"error",
//        "message":"cannot start","fields":{"error":"..."}}
#ifndef PACKD_SERVER_LOG_H_
#define PACKD_SERVER_LOG_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace packd {

enum class LogLevel { kInfo, kWarning, kError };
enum class LogFormat { kText, kJson };

using LogFields = std::vector<std::pair<std::string, std::string>>;

// The format of every later line (start-up sets it once, from --log_format).
void SetLogFormat(LogFormat format);
// "text" or "json"; INVALID_ARGUMENT naming the flag otherwise.
absl::Status ParseLogFormat(absl::string_view text, LogFormat* format);

// Writes one line (see above) to stderr and flushes it.
void Log(LogLevel level, absl::string_view message,
         const LogFields& fields = {});
inline void Log(absl::string_view message) { Log(LogLevel::kInfo, message); }

// The line Log writes, without writing it (tests).
std::string LogLine(LogFormat format, LogLevel level, absl::string_view message,
                    const LogFields& fields);

}  // namespace packd

#endif  // PACKD_SERVER_LOG_H_
