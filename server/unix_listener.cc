#include "server/unix_listener.h"

#include <fcntl.h>
#include <grpcpp/server_posix.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace packd {

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(
    const std::string& path) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on unix:", path, ": a socket path has 1 to ",
        sizeof(addr.sun_path) - 1, " characters"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  }
  unlink(path.c_str());  // the caller made sure no server answers there
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      chmod(path.c_str(), 0666) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen on unix:", path, ": ", std::strerror(err)));
  }
  return std::unique_ptr<UnixListener>(new UnixListener(path, fd));
}

UnixListener::~UnixListener() {
  StopAccepting();
  close(fd_);
}

void UnixListener::StopAccepting() {
  shutdown(fd_, SHUT_RDWR);  // accept() returns; the thread ends
  if (thread_.joinable()) thread_.join();
  if (!unlinked_.exchange(true)) unlink(path_.c_str());
}

void UnixListener::Serve(grpc::Server* server) {
  thread_ = std::thread([this, server] { Accept(server); });
}

void UnixListener::Accept(grpc::Server* server) {
  for (;;) {
    const int fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE ||
          errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        if (errno != EINTR && errno != ECONNABORTED) usleep(10000);
        continue;
      }
      return;  // shut down
    }
    ucred cred{};
    socklen_t length = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) {
      close(fd);  // a peer packd cannot name is not served
      continue;
    }
    {
      // Before gRPC reads the connection: its first call finds its uid.
      absl::MutexLock lock(&mu_);
      uids_[fd] = cred.uid;
    }
    grpc::AddInsecureChannelFromFd(server, fd);  // gRPC owns fd from now on
  }
}

std::optional<uid_t> UnixListener::UidOf(const std::string& peer) const {
  absl::string_view number = peer;
  int fd = -1;
  if (!absl::ConsumePrefix(&number, "fd:") || !absl::SimpleAtoi(number, &fd)) {
    return std::nullopt;
  }
  absl::MutexLock lock(&mu_);
  auto it = uids_.find(fd);
  if (it == uids_.end()) return std::nullopt;
  return it->second;
}

}  // namespace packd
