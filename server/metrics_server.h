// MetricsServer: packd's metrics (service/metrics.h) served at /metrics on
// --metrics_listen (HTTP/1.1, prometheus-cpp's text format).
//
//   auto server = MetricsServer::Start("127.0.0.1:9090",
//   metrics.collectable());
#ifndef PACKD_SERVER_METRICS_SERVER_H_
#define PACKD_SERVER_METRICS_SERVER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"

namespace packd {

// Serves a collectable at /metrics (anything else: 404) over HTTP/1.1, one
// connection at a time on a thread of its own (a scrape is one short request;
// one that stalls is dropped after 2 s). Its own and not civetweb's (which
// prometheus-cpp's Exposer runs on): Debian's civetweb starts its threads
// with a fixed 100 KiB stack, which glibc refuses to create in a process
// whose libraries' static TLS is larger, as libtorch with OpenBLAS makes it.
// Safe to share across threads: its listening thread is its own, and its
// destructor stops and joins it.
class MetricsServer {
 public:
  // Listens on "IPV4_ADDRESS:PORT" (port 0 picks one). INVALID_ARGUMENT for a
  // malformed address, UNAVAILABLE when it cannot be bound. `metrics` must
  // outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& listen,
      std::shared_ptr<prometheus::Collectable> metrics);
  ~MetricsServer();

  // "HOST:PORT" actually bound.
  const std::string& address() const { return address_; }

 private:
  MetricsServer() = default;
  // Accepts and answers connections until the destructor wakes it.
  void Serve();
  // Reads one request from `fd` and answers it.
  void Answer(int fd);

  std::shared_ptr<prometheus::Collectable> metrics_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd the destructor writes to stop Serve
  std::thread thread_;
  std::string address_;
};

}  // namespace packd

#endif  // PACKD_SERVER_METRICS_SERVER_H_
