// Tenant: who a call is for (docs/design.md §15), taken from the call once
// by the call mechanism: its bearer token's name, its client certificate's
// subject, its unix-socket peer's uid, else "anonymous". A region belongs to
// the tenant that registered it; shared-memory keys carry the tenant's
// prefix. Logs and metrics name the tenant, never a token.
//
// clang-format off
//   const Tenant tenant = Tenant::Named("job-a", "job-a");
//   tenant.KeyPrefix("/packd");  // "/packdjob-a."
// clang-format on
#ifndef PACKD_SERVICE_TENANT_H_
#define PACKD_SERVICE_TENANT_H_

#include <sys/types.h>

#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace packd {

// A plain value; safe to share across threads.
struct Tenant {
  // How logs, metrics and errors name it: "anonymous", a token's name,
  // "token-<digest>" for a token without one, "cert:<subject>", "uid:1000".
  std::string name = "anonymous";
  // What its shared-memory keys carry after --shm_key_prefix (letters,
  // digits, '_' and '-' only, so that no tenant's prefix begins another's);
  // empty for the anonymous tenant and a root peer (which may name any
  // segment, as it may open any).
  std::string key_label;
  // A unix-socket peer's uid: the segments it names must be its own.
  std::optional<uid_t> uid;

  bool anonymous() const { return name == "anonymous"; }
  // The prefix its keys must begin with: `base` (--shm_key_prefix), then its
  // label and a dot when it has one.
  std::string KeyPrefix(absl::string_view base) const;

  // A named tenant: `label` is made fit for a key (other characters become
  // '_').
  static Tenant Named(std::string name, absl::string_view label);
  // A tenant named by a short digest of `secret` (a token without a name, a
  // certificate's subject): `prefix` then 12 hex digits of its SHA-256.
  static std::string Digest(absl::string_view prefix, absl::string_view secret);

  friend bool operator==(const Tenant& a, const Tenant& b) {
    return a.name == b.name;
  }
};

}  // namespace packd

#endif  // PACKD_SERVICE_TENANT_H_
