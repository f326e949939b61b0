// Metrics: what packd counts about its calls, kept in a prometheus-cpp
// registry; server/metrics_server.h serves it at /metrics. docs/service.md
// lists the metrics.
//
// clang-format off
//   Metrics metrics(gauges);  // the values read at each scrape
//   metrics.Record("Pack", absl::StatusCode::kOk, absl::Milliseconds(3), 1 << 20, 4 << 10);
//   metrics.RecordDevice(Device::Cpu(), absl::StatusCode::kOk);
// clang-format on
#ifndef PACKD_SERVICE_METRICS_H_
#define PACKD_SERVICE_METRICS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/tensor_view.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace packd {

// Safe to share across threads.
class Metrics {
 public:
  // Upper bounds of the latency histogram, in seconds.
  static constexpr std::array<double, 14> kBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
      0.025,  0.05,    0.1,    0.25,  0.5,    1.0,   5.0};

  // What the service's parts own, read at each scrape. Any may be empty
  // (then it reads 0).
  struct Gauges {
    std::function<int64_t()> calls_in_flight;
    // --max_inflight_bytes: reserved now, the limit (0: none), and the calls
    // waiting for bytes.
    std::function<int64_t()> budget_bytes_in_use, budget_bytes_limit,
        budget_waiting;
    // Regions registered now, by kind ("system", "device").
    std::function<int64_t(absl::string_view kind)> regions;
    // Regions unregistered because their lease ran out, since start.
    std::function<int64_t()> regions_expired;
  };

  explicit Metrics(Gauges gauges = {});
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Counts one finished call of `method`.
  // `tenant`: whose call it was (Tenant::name, never a token), or
  // "unadmitted" for a call refused before it had one.
  void Record(absl::string_view method, absl::StatusCode code,
              absl::Duration latency, uint64_t request_bytes,
              uint64_t response_bytes, absl::string_view tenant = "anonymous");

  // Counts work run on `device` (a Pack, a Scatter, a micro-batch of a step)
  // that ended with `code`; INTERNAL, UNAVAILABLE, DATA_LOSS and UNKNOWN count
  // as the device's errors (a runtime failure or a lost device), not the
  // caller's.
  void RecordDevice(const Device& device, absl::StatusCode code);
  // RecordDevice of work that ended with `status`; returns it.
  absl::Status OnDevice(const Device& device, absl::Status status) {
    RecordDevice(device, status.code());
    return status;
  }
  // Starts `device`'s series at 0 (so that rates over them begin at once).
  void AddDevice(const Device& device);

  // Adds `took` to phase `phase` of PackMicroBatches calls: "measure" (the
  // batch decoded, brought to the host and measured), "plan", "device" (the
  // device pass of a step on a GPU), "pack" (micro-batches packed or, after a
  // device pass, assembled) and "send" (messages being written; the next
  // micro-batch is packed meanwhile, so "pack" and "send" overlap).
  void RecordStepPhase(absl::string_view phase, absl::Duration took);

  // A PackMicroBatches call packed a micro-batch (+1) or its message left
  // (-1): the micro-batches the server holds packed, over every call.
  void HoldMicroBatches(int64_t delta);

  // The streaming step (docs/design.md §18): a step opened (+1) or ended
  // (-1); rows submitted (+) or sent in a micro-batch (-); a wave committed;
  // one group's rows sent in a micro-batch `waited` after the group arrived.
  void StreamSteps(int64_t delta);
  void StreamRowsPending(int64_t delta);
  void StreamWave();
  void StreamGroupSent(absl::Duration waited);
  // One streaming step's bytes in --max_inflight_bytes, by kind: "groups"
  // (rows submitted and not yet packed) and "micro_batches" (packed and not
  // yet taken by their rank's stream). Its series go with RemoveStepHeld.
  struct StepHeld {
    prometheus::Gauge* groups = nullptr;
    prometheus::Gauge* micro_batches = nullptr;
  };
  StepHeld AddStepHeld(const std::string& tenant, const std::string& step);
  void RemoveStepHeld(const StepHeld& held);

  // What /metrics serves: the registry and the gauges, read when collected.
  std::shared_ptr<prometheus::Collectable> collectable() const {
    return collector_;
  }
  // Prometheus text exposition (version 0.0.4) of collectable().
  std::string Render() const;

 private:
  class Collector;
  struct PerMethod {
    std::array<prometheus::Counter*, 17> calls{};  // by absl::StatusCode
    prometheus::Histogram* latency = nullptr;
    prometheus::Counter* request_bytes = nullptr;
    prometheus::Counter* response_bytes = nullptr;
  };
  struct PerDevice {
    prometheus::Counter* calls = nullptr;
    prometheus::Counter* errors = nullptr;
  };
  PerMethod& MethodLocked(absl::string_view method)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PerDevice DeviceOf(const Device& device) ABSL_LOCKS_EXCLUDED(mu_);

  const std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Counter>& tenant_calls_;
  prometheus::Family<prometheus::Histogram>& latency_;
  prometheus::Family<prometheus::Counter>& request_bytes_;
  prometheus::Family<prometheus::Counter>& response_bytes_;
  prometheus::Family<prometheus::Counter>& device_calls_;
  prometheus::Family<prometheus::Counter>& device_errors_;
  prometheus::Gauge& micro_batches_held_;
  prometheus::Family<prometheus::Counter>& step_phases_;
  prometheus::Gauge& stream_steps_;
  prometheus::Gauge& stream_rows_pending_;
  prometheus::Counter& stream_waves_;
  prometheus::Histogram& stream_group_wait_;
  prometheus::Family<prometheus::Gauge>& stream_step_held_;
  std::shared_ptr<prometheus::Collectable> collector_;  // a Collector

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, PerMethod> methods_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, PerDevice> devices_ ABSL_GUARDED_BY(mu_);
};

}  // namespace packd

#endif  // PACKD_SERVICE_METRICS_H_
