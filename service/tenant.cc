#include "service/tenant.h"

#include <openssl/sha.h>

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace packd {

std::string Tenant::KeyPrefix(absl::string_view base) const {
  if (key_label.empty()) return std::string(base);
  return absl::StrCat(base, key_label, ".");
}

Tenant Tenant::Named(std::string name, absl::string_view label) {
  Tenant tenant;
  tenant.name = std::move(name);
  tenant.key_label = std::string(label);
  for (char& c : tenant.key_label) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) c = '_';
  }
  return tenant;
}

std::string Tenant::Digest(absl::string_view prefix, absl::string_view secret) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(secret.data()), secret.size(),
         digest);
  return absl::StrCat(prefix, absl::BytesToHexString(absl::string_view(
                                  reinterpret_cast<const char*>(digest), 6)));
}

}  // namespace packd
