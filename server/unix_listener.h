// UnixListener: packd's own listener on a unix socket (--listen=unix:PATH),
// so that each connection's peer is known (docs/design.md §15). gRPC 1.51
// does not report a unix peer's credentials: packd accepts each connection,
// reads SO_PEERCRED on it, and hands the descriptor to gRPC
// (AddInsecureChannelFromFd), whose calls on it then report peer() "fd:N".
// The socket file is mode 0666: every local user may connect, and each is
// its own tenant, by uid.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto listener, UnixListener::Bind("/run/packd/packd.sock"));
//   listener->Serve(server.get());
//   std::optional<uid_t> uid = listener->UidOf(context->peer());
// clang-format on
#ifndef PACKD_SERVER_UNIX_LISTENER_H_
#define PACKD_SERVER_UNIX_LISTENER_H_

#include <grpcpp/server.h>
#include <sys/types.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace packd {

// Safe to share across threads: UidOf is called from every call.
class UnixListener {
 public:
  // Binds and listens on `path` (a file no server answers on is replaced).
  // UNAVAILABLE when it cannot.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(
      const std::string& path);
  // Stops accepting, and removes the socket file.
  ~UnixListener();
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // Accepts connections for `server` (which must outlive the listener) on a
  // thread of its own from now on.
  void Serve(grpc::Server* server);
  // Accepts no more connections and removes the socket file (a drain); the
  // connections accepted so far keep their uids. Idempotent.
  void StopAccepting();
  // The uid of the peer whose connection gRPC reports as `peer` ("fd:N"),
  // if packd accepted it.
  std::optional<uid_t> UidOf(const std::string& peer) const;

 private:
  UnixListener(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  void Accept(grpc::Server* server);

  const std::string path_;
  const int fd_;
  std::thread thread_;
  std::atomic<bool> unlinked_{false};
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, uid_t> uids_ ABSL_GUARDED_BY(mu_);
};

}  // namespace packd

#endif  // PACKD_SERVER_UNIX_LISTENER_H_
