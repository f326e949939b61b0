// Log lines: the text format as before, and JSON one object a line that a
// collector can parse (time, level, message, fields; escaping of quotes,
// backslashes and control characters); --log_format's values.
#include "server/log.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <regex>
#include <string>

namespace packd {
namespace {

TEST(Log, TextIsOneTimestampedLine) {
  const std::string line =
      LogLine(LogFormat::kText, LogLevel::kInfo, "listening on x", {});
  EXPECT_TRUE(std::regex_match(
      line, std::regex(R"(packd \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z )"
                       R"(listening on x\n)")))
      << line;
  EXPECT_NE(LogLine(LogFormat::kText, LogLevel::kError, "cannot start",
                    {{"code", "5"}})
                .find(" error: cannot start code=5\n"),
            std::string::npos);
}

TEST(Log, JsonIsOneObjectALineWithEverythingEscaped) {
  const std::string line =
      LogLine(LogFormat::kJson, LogLevel::kWarning, "a \"quoted\"\\ path\n",
              {{"device", "cuda:0"}, {"why", std::string("\x01tab\t", 5)}});
  EXPECT_TRUE(std::regex_match(
      line, std::regex(
                R"(\{"time":"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z",)"
                R"("level":"warning","message":"a \\"quoted\\"\\\\ path\\n",)"
                R"("fields":\{"device":"cuda:0","why":"\\u0001tab\\t"\}\}\n)")))
      << line;
  EXPECT_EQ(std::count(line.begin(), line.end(), '\n'), 1);
  const std::string bare =
      LogLine(LogFormat::kJson, LogLevel::kInfo, "stopped", {});
  EXPECT_NE(bare.find(R"("level":"info","message":"stopped","fields":{}})"),
            std::string::npos)
      << bare;
}

TEST(Log, TheFormatFlagTakesTextOrJson) {
  LogFormat format = LogFormat::kText;
  EXPECT_TRUE(ParseLogFormat("json", &format).ok());
  EXPECT_EQ(format, LogFormat::kJson);
  EXPECT_TRUE(ParseLogFormat("text", &format).ok());
  EXPECT_EQ(format, LogFormat::kText);
  const absl::Status bad = ParseLogFormat("yaml", &format);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("--log_format"), std::string::npos);
}

}  // namespace
}  // namespace packd
