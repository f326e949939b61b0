// PACKD_RETURN_IF_ERROR and PACKD_ASSIGN_OR_RETURN: early returns for
// absl::Status and absl::StatusOr, which Abseil 20220623 does not ship.
//
//   PACKD_RETURN_IF_ERROR(ValidateMask(mask));
//   PACKD_ASSIGN_OR_RETURN(int64_t n, NumElements(shape, "mask"));
#ifndef PACKD_BASE_STATUS_MACROS_H_
#define PACKD_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PACKD_STATUS_CONCAT_INNER_(a, b) a##b
#define PACKD_STATUS_CONCAT_(a, b) PACKD_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function
// if it is not OK.
#define PACKD_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status packd_status_ = (expr);         \
    if (!packd_status_.ok()) return packd_status_; \
  } while (false)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status,
// otherwise moves the value into `lhs`, which may be a declaration (`auto x`)
// or an existing variable.
#define PACKD_ASSIGN_OR_RETURN(lhs, rexpr) \
  PACKD_ASSIGN_OR_RETURN_IMPL_(            \
      PACKD_STATUS_CONCAT_(packd_statusor_, __LINE__), lhs, rexpr)

#define PACKD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // PACKD_BASE_STATUS_MACROS_H_
