// The command-line flags of packd (--listen, --device, ...) and their reading
// into ServerOptions. Both entry points that serve — packd itself and the
// tests' packd_testing — read them here.
//
//   absl::ParseCommandLine(argc, argv);
//   PACKD_ASSIGN_OR_RETURN(ServerOptions options, OptionsFromFlags());
#ifndef PACKD_SERVER_FLAGS_H_
#define PACKD_SERVER_FLAGS_H_

#include "absl/status/statusor.h"
#include "server/server.h"

namespace packd {

// The options the parsed flags give; INVALID_ARGUMENT naming the flag when one
// has a bad value. Applies --threads to the global thread pool.
absl::StatusOr<ServerOptions> OptionsFromFlags();

}  // namespace packd

#endif  // PACKD_SERVER_FLAGS_H_
