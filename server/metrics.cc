#include "server/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace packd {
namespace {

// Lower-case gRPC code names, as Prometheus labels conventionally are.
std::string CodeLabel(absl::StatusCode code) {
  std::string name = absl::StatusCodeToString(code);
  for (char& c : name)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

}  // namespace

void Metrics::Record(const std::string& method, absl::StatusCode code,
                     absl::Duration latency, uint64_t request_bytes,
                     uint64_t response_bytes) {
  const double seconds = absl::ToDoubleSeconds(latency);
  absl::MutexLock lock(&mu_);
  PerMethod& m = methods_[method];
  ++m.calls[code];
  size_t bucket = 0;
  while (bucket < kBuckets.size() && seconds > kBuckets[bucket]) ++bucket;
  ++m.buckets[bucket];
  m.seconds += seconds;
  m.request_bytes += request_bytes;
  m.response_bytes += response_bytes;
}

std::string Metrics::Render(int64_t regions, int64_t regions_expired,
                            int64_t calls_in_flight) const {
  std::string out;
  absl::StrAppend(
      &out,
      "# HELP packd_requests_total Calls finished, by method and status code.\n"
      "# TYPE packd_requests_total counter\n");
  absl::MutexLock lock(&mu_);
  for (const auto& [method, m] : methods_) {
    for (const auto& [code, n] : m.calls) {
      absl::StrAppend(&out, "packd_requests_total{method=\"", method,
                      "\",code=\"", CodeLabel(code), "\"} ", n, "\n");
    }
  }
  absl::StrAppend(
      &out,
      "# HELP packd_request_duration_seconds Time from a call's arrival in the "
      "service to its answer.\n"
      "# TYPE packd_request_duration_seconds histogram\n");
  for (const auto& [method, m] : methods_) {
    uint64_t cumulative = 0;
    for (size_t i = 0; i <= kBuckets.size(); ++i) {
      cumulative += m.buckets[i];
      const std::string le =
          i < kBuckets.size() ? absl::StrFormat("%g", kBuckets[i]) : "+Inf";
      absl::StrAppend(&out, "packd_request_duration_seconds_bucket{method=\"",
                      method, "\",le=\"", le, "\"} ", cumulative, "\n");
    }
    absl::StrAppend(&out, "packd_request_duration_seconds_sum{method=\"",
                    method, "\"} ", absl::StrFormat("%.6f", m.seconds), "\n",
                    "packd_request_duration_seconds_count{method=\"", method,
                    "\"} ", cumulative, "\n");
  }
  absl::StrAppend(
      &out,
      "# HELP packd_request_bytes_total Bytes of request messages.\n"
      "# TYPE packd_request_bytes_total counter\n");
  for (const auto& [method, m] : methods_) {
    absl::StrAppend(&out, "packd_request_bytes_total{method=\"", method, "\"} ",
                    m.request_bytes, "\n");
  }
  absl::StrAppend(
      &out,
      "# HELP packd_response_bytes_total Bytes of response messages.\n"
      "# TYPE packd_response_bytes_total counter\n");
  for (const auto& [method, m] : methods_) {
    absl::StrAppend(&out, "packd_response_bytes_total{method=\"", method,
                    "\"} ", m.response_bytes, "\n");
  }
  absl::StrAppend(
      &out,
      "# HELP packd_regions Registered tensor-handle regions.\n"
      "# TYPE packd_regions gauge\npackd_regions ",
      regions, "\n",
      "# HELP packd_regions_expired_total Regions unregistered because no call "
      "named them for their lease.\n"
      "# TYPE packd_regions_expired_total "
      "counter\npackd_regions_expired_total ",
      regions_expired, "\n",
      "# HELP packd_calls_in_flight Pack and Scatter calls running.\n"
      "# TYPE packd_calls_in_flight gauge\npackd_calls_in_flight ",
      calls_in_flight, "\n",
      "# HELP packd_step_micro_batches_held Micro-batches PackMicroBatches "
      "calls hold packed, not yet sent (at most two per call).\n"
      "# TYPE packd_step_micro_batches_held gauge\n"
      "packd_step_micro_batches_held ",
      micro_batches_held_.load(), "\n");
  return out;
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& listen, std::function<std::string()> render) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  in_addr host{};
  const std::string host_text =
      colon == std::string::npos ? "" : listen.substr(0, colon);
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535 ||
      inet_pton(AF_INET,
                host_text == "localhost" ? "127.0.0.1" : host_text.c_str(),
                &host) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen=", listen,
                     " is not IPV4_ADDRESS:PORT (e.g. 0.0.0.0:9090)"));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer);
  server->fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(server->fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr = host;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(server->fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) !=
          0 ||
      ::listen(server->fd_, 16) != 0) {
    const int err = errno;
    close(server->fd_);
    server->fd_ = -1;
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", listen,
                     " (--metrics_listen): ", std::strerror(err)));
  }
  socklen_t len = sizeof(addr);
  getsockname(server->fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  server->address_ = absl::StrCat(host_text, ":", ntohs(addr.sin_port));
  server->render_ = std::move(render);
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

MetricsServer::~MetricsServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) close(fd_);
}

void MetricsServer::Serve() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const int client = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    // One short request per connection; give a slow client 1 s.
    timeval timeout{1, 0};
    setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    char buf[2048];
    const ssize_t n = recv(client, buf, sizeof(buf) - 1, 0);
    std::string response;
    if (n > 0 && absl::StartsWith(absl::string_view(buf, n), "GET /metrics")) {
      const std::string body = render_();
      response = absl::StrCat(
          "HTTP/1.0 200 OK\r\nContent-Type: text/plain; "
          "version=0.0.4\r\nContent-Length: ",
          body.size(), "\r\n\r\n", body);
    } else {
      response = "HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n";
    }
    for (size_t sent = 0; sent < response.size();) {
      const ssize_t k = send(client, response.data() + sent,
                             response.size() - sent, MSG_NOSIGNAL);
      if (k <= 0) break;
      sent += k;
    }
    close(client);
  }
}

}  // namespace packd
