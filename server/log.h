// Log: one timestamped line on stderr, the server's only log sink.
//
//   Log(absl::StrCat("listening on ", address));
#ifndef PACKD_SERVER_LOG_H_
#define PACKD_SERVER_LOG_H_

#include "absl/strings/string_view.h"

namespace packd {

// Writes "packd <UTC time> <message>\n" to stderr and flushes it.
void Log(absl::string_view message);

}  // namespace packd

#endif  // PACKD_SERVER_LOG_H_
