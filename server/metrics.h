// Metrics: what packd counts about its calls, and MetricsServer, which serves
// them as Prometheus text on --metrics_listen.
//
// clang-format off
//   metrics.Record("Pack", absl::StatusCode::kOk, absl::Milliseconds(3), 1 << 20, 4 << 10);
//   auto server = MetricsServer::Start("127.0.0.1:9090", [&] { return metrics.Render(...); });
// clang-format on
#ifndef PACKD_SERVER_METRICS_H_
#define PACKD_SERVER_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace packd {

class Metrics {
 public:
  // Upper bounds of the latency histogram, in seconds.
  static constexpr std::array<double, 14> kBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
      0.025,  0.05,    0.1,    0.25,  0.5,    1.0,   5.0};

  // Counts one finished call of `method`.
  void Record(const std::string& method, absl::StatusCode code,
              absl::Duration latency, uint64_t request_bytes,
              uint64_t response_bytes);

  // A PackMicroBatches call packed a micro-batch (+1) or its message left
  // (-1): the micro-batches the server holds packed, over every call.
  void HoldMicroBatches(int64_t delta) { micro_batches_held_ += delta; }

  // Prometheus text exposition (version 0.0.4) of everything recorded, plus the
  // gauges given.
  std::string Render(int64_t regions, int64_t regions_expired,
                     int64_t calls_in_flight) const;

 private:
  struct PerMethod {
    std::map<absl::StatusCode, uint64_t> calls;
    std::array<uint64_t, kBuckets.size() + 1> buckets{};  // last: +Inf
    double seconds = 0;
    uint64_t request_bytes = 0, response_bytes = 0;
  };
  mutable absl::Mutex mu_;
  std::map<std::string, PerMethod> methods_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> micro_batches_held_{0};
};

// A minimal HTTP/1.0 endpoint: GET /metrics answers with `render()`, anything
// else 404.
class MetricsServer {
 public:
  // Listens on "HOST:PORT" (port 0 picks one). INVALID_ARGUMENT for a malformed
  // address, UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& listen, std::function<std::string()> render);
  ~MetricsServer();

  // "HOST:PORT" actually bound.
  const std::string& address() const { return address_; }

 private:
  MetricsServer() = default;
  void Serve();

  int fd_ = -1;
  std::string address_;
  std::function<std::string()> render_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace packd

#endif  // PACKD_SERVER_METRICS_H_
