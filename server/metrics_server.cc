#include "server/metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "prometheus/text_serializer.h"

namespace packd {
namespace {

// How long a scrape's connection may take to send its request or to take
// the reply: a client that stalls cannot hold the endpoint longer.
constexpr int kScrapeTimeoutSeconds = 2;
// The most a scrape's request head may have (a GET with its headers).
constexpr size_t kMaxRequestHead = 16 << 10;

std::string ErrnoText(const char* what) {
  return absl::StrCat(what, ": ", std::strerror(errno));
}

// Writes all of `bytes` to `fd`; false when the peer went away or stalled.
bool SendAll(int fd, absl::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t sent = send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    bytes.remove_prefix(static_cast<size_t>(sent));
  }
  return true;
}

std::string HttpReply(absl::string_view status, absl::string_view type,
                      absl::string_view body, bool with_body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n",
                      with_body ? body : absl::string_view());
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& listen,
    std::shared_ptr<prometheus::Collectable> metrics) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  in_addr host{};
  const std::string host_text =
      colon == std::string::npos ? "" : listen.substr(0, colon);
  const std::string numeric =
      host_text == "localhost" ? "127.0.0.1" : host_text;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535 || inet_pton(AF_INET, numeric.c_str(), &host) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen=", listen,
                     " is not IPV4_ADDRESS:PORT (e.g. 0.0.0.0:9090)"));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer);
  server->metrics_ = std::move(metrics);
  auto fail = [&](const char* what) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen,
                     " (--metrics_listen): ", ErrnoText(what)));
  };
  server->listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (server->listen_fd_ < 0) return fail("socket");
  const int on = 1;
  setsockopt(server->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr = host;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(server->listen_fd_, reinterpret_cast<const sockaddr*>(&addr),
           sizeof(addr)) != 0) {
    return fail("bind");
  }
  if (::listen(server->listen_fd_, 64) != 0) return fail("listen");
  socklen_t length = sizeof(addr);
  if (getsockname(server->listen_fd_, reinterpret_cast<sockaddr*>(&addr),
                  &length) != 0) {
    return fail("getsockname");
  }
  server->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (server->wake_fd_ < 0) return fail("eventfd");
  server->address_ = absl::StrCat(host_text, ":", ntohs(addr.sin_port));
  // A thread of the default stack size: whatever static TLS the process's
  // libraries carry fits in it (a fixed small stack would not; design.md).
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

MetricsServer::~MetricsServer() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    while (write(wake_fd_, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
    thread_.join();
  }
  if (wake_fd_ >= 0) close(wake_fd_);
  if (listen_fd_ >= 0) close(listen_fd_);
}

void MetricsServer::Serve() {
  // Signals go to the thread that waits for them (packd's SIGTERM handling).
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;  // stopping
    if (fds[0].revents == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;  // the peer gave up, or no descriptor left: next
    Answer(fd);
    close(fd);
  }
}

void MetricsServer::Answer(int fd) {
  const timeval timeout{kScrapeTimeoutSeconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  std::string head;
  char buffer[4096];
  while (head.find("\r\n\r\n") == std::string::npos &&
         head.size() < kMaxRequestHead) {
    const ssize_t got = recv(fd, buffer, sizeof(buffer), 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;  // closed, or stalled past the timeout
    head.append(buffer, static_cast<size_t>(got));
  }
  constexpr absl::string_view kText = "text/plain; charset=utf-8";
  // "GET /metrics HTTP/1.1": the method, the target (less any query), the
  // version.
  const std::vector<absl::string_view> line =
      absl::StrSplit(absl::string_view(head).substr(0, head.find("\r\n")), ' ');
  if (head.find("\r\n\r\n") == std::string::npos || line.size() != 3 ||
      !absl::StartsWith(line[2], "HTTP/1.")) {
    SendAll(fd, HttpReply("400 Bad Request", kText,
                          "bad request: packd serves GET /metrics", true));
    return;
  }
  const bool head_only = line[0] == "HEAD";
  if (line[0] != "GET" && !head_only) {
    SendAll(fd, HttpReply("405 Method Not Allowed", kText,
                          "packd serves GET /metrics", true));
    return;
  }
  const absl::string_view path = line[1].substr(0, line[1].find('?'));
  if (path != "/metrics") {
    SendAll(fd, HttpReply("404 Not Found", kText,
                          "not found: packd serves /metrics", !head_only));
    return;
  }
  const std::string body =
      prometheus::TextSerializer().Serialize(metrics_->Collect());
  SendAll(fd, HttpReply("200 OK", "text/plain; version=0.0.4; charset=utf-8",
                        body, !head_only));
}

}  // namespace packd
