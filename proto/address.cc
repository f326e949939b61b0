#include "proto/address.h"

#include "absl/strings/match.h"
#include "absl/strings/strip.h"

namespace packd {

bool IsNodeLocal(absl::string_view address) {
  if (absl::StartsWith(address, "unix:") ||
      absl::StartsWith(address, "unix-abstract:")) {
    return true;
  }
  for (absl::string_view scheme : {"dns:///", "ipv4:", "ipv6:"}) {
    if (absl::ConsumePrefix(&address, scheme)) break;
  }
  const size_t colon = address.rfind(':');
  const absl::string_view host =
      colon == absl::string_view::npos ? address : address.substr(0, colon);
  return absl::StartsWith(host, "127.") || host == "localhost" ||
         host == "[::1]";
}

}  // namespace packd
