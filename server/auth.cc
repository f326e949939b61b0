#include "server/auth.h"

#include <algorithm>
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
  std::vector<Token> tokens;
  for (absl::string_view line : absl::StrSplit(text.str(), '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    // "name:token" when what comes before the first ':' is a name; else the
    // whole line is a token, its tenant named by its digest.
    const size_t colon = line.find(':');
    const absl::string_view name =
        colon == absl::string_view::npos ? "" : line.substr(0, colon);
    const bool named = !name.empty() && name.size() <= 64 &&
                       colon + 1 < line.size() &&
                       std::all_of(name.begin(), name.end(), [](char c) {
                         return absl::ascii_isalnum(c) || c == '_' || c == '-';
                       });
    if (named) {
      tokens.push_back({std::string(line.substr(colon + 1)),
                        Tenant::Named(std::string(name), name)});
    } else {
      const std::string digest = Tenant::Digest("token-", line);
      tokens.push_back({std::string(line), Tenant::Named(digest, digest)});
    }
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

absl::StatusOr<Tenant> TokenAuth::Check(
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
  const Token* valid = nullptr;
  absl::MutexLock lock(&mu_);
  for (const Token& known : tokens_) {
    // No early exit: every token is compared.
    if (ConstantTimeEquals(token, known.secret)) valid = &known;
  }
  if (valid == nullptr) {
    return absl::UnauthenticatedError("the bearer token is not valid");
  }
  return valid->tenant;
}

}  // namespace packd
