#include "server/log.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace packd {
namespace {

std::atomic<LogFormat> g_format{LogFormat::kText};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kWarning:
      return "warning";
    case LogLevel::kError:
      return "error";
    default:
      return "info";
  }
}

// A JSON string literal: quotes, backslashes and control characters
// escaped; other bytes (UTF-8) as they are.
void AppendJsonString(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (c == '\n') {
      out->append("\\n");
    } else if (c == '\t') {
      out->append("\\t");
    } else if (c == '\r') {
      out->append("\\r");
    } else if (u < 0x20) {
      absl::StrAppendFormat(out, "\\u%04x", u);
    } else {
      out->push_back(c);
    }
  }
  out->push_back('"');
}

}  // namespace

void SetLogFormat(LogFormat format) { g_format.store(format); }

absl::Status ParseLogFormat(absl::string_view text, LogFormat* format) {
  if (text == "text") {
    *format = LogFormat::kText;
  } else if (text == "json") {
    *format = LogFormat::kJson;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_format must be text or json, not \"", text, "\""));
  }
  return absl::OkStatus();
}

std::string LogLine(LogFormat format, LogLevel level, absl::string_view message,
                    const LogFields& fields) {
  const std::string time = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(),
                                            absl::UTCTimeZone());
  std::string line;
  if (format == LogFormat::kJson) {
    absl::StrAppend(&line, "{\"time\":\"", time, "\",\"level\":\"",
                    LevelName(level), "\",\"message\":");
    AppendJsonString(message, &line);
    line.append(",\"fields\":{");
    for (size_t i = 0; i < fields.size(); ++i) {
      if (i > 0) line.push_back(',');
      AppendJsonString(fields[i].first, &line);
      line.push_back(':');
      AppendJsonString(fields[i].second, &line);
    }
    line.append("}}\n");
    return line;
  }
  absl::StrAppend(&line, "packd ", time, " ");
  if (level != LogLevel::kInfo) absl::StrAppend(&line, LevelName(level), ": ");
  line.append(message.data(), message.size());
  for (const auto& [key, value] : fields) {
    absl::StrAppend(&line, " ", key, "=", value);
  }
  line.push_back('\n');
  return line;
}

void Log(LogLevel level, absl::string_view message, const LogFields& fields) {
  const std::string line = LogLine(g_format.load(), level, message, fields);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace packd
