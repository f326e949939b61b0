#include "server/auth.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace packd {

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::FromFile(
    std::string path) {
  std::unique_ptr<TokenAuth> auth(new TokenAuth(std::move(path)));
  absl::Status status = auth->Reload();
  if (!status.ok()) return status;
  return auth;
}

absl::Status TokenAuth::Reload() {
  std::ifstream file(path_);
  if (!file) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot read the token file ", path_, " (--auth_token_file)"));
  }
  std::stringstream text;
  text << file.rdbuf();
  std::vector<std::string> tokens;
  for (absl::string_view line : absl::StrSplit(text.str(), '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (!line.empty()) tokens.emplace_back(line);
  }
  if (tokens.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the token file ", path_, " (--auth_token_file) holds no token"));
  }
  absl::MutexLock lock(&mu_);
  tokens_ = std::move(tokens);
  return absl::OkStatus();
}

bool TokenAuth::ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Every byte of the longer one is looked at, whatever matches.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

absl::Status TokenAuth::Check(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        "this server requires a bearer token: send metadata "
        "\"authorization: Bearer <token>\"");
  }
  const absl::string_view value(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWith(value, kBearer)) {
    return absl::UnauthenticatedError(
        "the authorization metadata is not \"Bearer <token>\"");
  }
  const absl::string_view token = value.substr(kBearer.size());
  bool valid = false;
  absl::MutexLock lock(&mu_);
  for (const std::string& known : tokens_) {
    valid |= ConstantTimeEquals(token, known);  // no early exit
  }
  if (!valid)
    return absl::UnauthenticatedError("the bearer token is not valid");
  return absl::OkStatus();
}

}  // namespace packd
