// Addresses of packd listeners and channels, as both ends read them.
//
//   IsNodeLocal("unix:/run/packd/packd.sock");  // true
//   IsNodeLocal("10.0.0.7:50051");              // false
#ifndef PACKD_PROTO_ADDRESS_H_
#define PACKD_PROTO_ADDRESS_H_

#include "absl/strings/string_view.h"

namespace packd {

// True for addresses only this node can reach, the ones shared memory is for:
// unix sockets ("unix:PATH", "unix-abstract:NAME") and loopback hosts
// (127.0.0.0/8, "localhost", "[::1]"), with or without a gRPC scheme
// ("ipv4:", "ipv6:", "dns:///"). The Python client applies the same rule
// (python/packd/_connection.py, is_node_local).
bool IsNodeLocal(absl::string_view address);

}  // namespace packd

#endif  // PACKD_PROTO_ADDRESS_H_
