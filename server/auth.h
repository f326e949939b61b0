// TokenAuth: bearer tokens for every PackService call (--auth_token_file,
// docs/design.md §5, §15). The file holds one token a line (blank lines and
// surrounding spaces ignored), each `name:token` (the name of its tenant:
// letters, digits, '_' and '-', at most 64) or a bare token (a tenant of its
// own, named by a short digest of it), and is read again on SIGHUP. A call
// must carry `authorization: Bearer <token>` metadata with one of them;
// tokens are compared in constant time. Health is never behind it.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto auth, TokenAuth::FromFile("/etc/packd/tokens"));
//   PACKD_ASSIGN_OR_RETURN(Tenant tenant, auth->Check(context->client_metadata()));
// clang-format on
#ifndef PACKD_SERVER_AUTH_H_
#define PACKD_SERVER_AUTH_H_

#include <grpcpp/support/string_ref.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "service/tenant.h"

namespace packd {

// Safe to share across threads: Check is called from every call while Reload
// (SIGHUP) swaps the tokens under a lock.
class TokenAuth {
 public:
  // Reads the tokens in `path`. FAILED_PRECONDITION when it cannot be read or
  // holds no token.
  static absl::StatusOr<std::unique_ptr<TokenAuth>> FromFile(std::string path);

  // Reads the file again (SIGHUP). On failure the tokens stay as they were
  // and the error says why.
  absl::Status Reload();

  // The tenant of the current token that `metadata` has as "authorization:
  // Bearer <token>"; UNAUTHENTICATED (saying which: missing, not a bearer
  // token, not valid) otherwise.
  absl::StatusOr<Tenant> Check(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;

  // a == b, in time that depends on their lengths only.
  static bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

  const std::string& path() const { return path_; }

 private:
  explicit TokenAuth(std::string path) : path_(std::move(path)) {}

  const std::string path_;
  mutable absl::Mutex mu_;
  struct Token {
    std::string secret;
    Tenant tenant;
  };
  std::vector<Token> tokens_ ABSL_GUARDED_BY(mu_);
};

}  // namespace packd

#endif  // PACKD_SERVER_AUTH_H_
