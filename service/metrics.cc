#include "service/metrics.h"

#include "absl/strings/str_cat.h"
#include "kernels/device_counters.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace packd {
namespace {

// Lower-case gRPC code names, as Prometheus labels conventionally are.
std::string CodeLabel(absl::StatusCode code) {
  std::string name = absl::StatusCodeToString(code);
  for (char& c : name)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

bool IsDeviceError(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kUnknown:
      return true;
    default:
      return false;
  }
}

int64_t Read(const std::function<int64_t()>& gauge) {
  return gauge ? gauge() : 0;
}

// Values read now, each with the labels that name its series.
using Series = std::vector<
    std::pair<std::vector<prometheus::ClientMetric::Label>, int64_t>>;

// One family of values read now.
prometheus::MetricFamily Sampled(std::string name, std::string help,
                                 prometheus::MetricType type,
                                 const Series& values) {
  prometheus::MetricFamily family{std::move(name), std::move(help), type, {}};
  for (const auto& [labels, value] : values) {
    prometheus::ClientMetric metric;
    metric.label = labels;
    const double v = static_cast<double>(value);
    if (type == prometheus::MetricType::Counter) {
      metric.counter.value = v;
    } else {
      metric.gauge.value = v;
    }
    family.metric.push_back(std::move(metric));
  }
  return family;
}

}  // namespace

// The registry's families, then the gauges read now.
class Metrics::Collector final : public prometheus::Collectable {
 public:
  Collector(std::shared_ptr<prometheus::Registry> registry, Gauges gauges)
      : registry_(std::move(registry)), gauges_(std::move(gauges)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> families = registry_->Collect();
    using prometheus::MetricType;
    const auto one = [](const std::function<int64_t()>& gauge) {
      return Series{{{}, Read(gauge)}};
    };
    families.push_back(
        Sampled("packd_calls_in_flight", "Calls admitted and not yet answered.",
                MetricType::Gauge, one(gauges_.calls_in_flight)));
    families.push_back(
        Sampled("packd_budget_bytes_in_use",
                "Bytes of inline calls reserved in --max_inflight_bytes.",
                MetricType::Gauge, one(gauges_.budget_bytes_in_use)));
    families.push_back(Sampled(
        "packd_budget_bytes_limit", "--max_inflight_bytes (0: no limit).",
        MetricType::Gauge, one(gauges_.budget_bytes_limit)));
    families.push_back(Sampled(
        "packd_budget_waiting",
        "Calls waiting for bytes of --max_inflight_bytes to be released.",
        MetricType::Gauge, one(gauges_.budget_waiting)));
    Series regions;
    for (const char* kind : {"device", "system"}) {
      regions.push_back(
          {{{"kind", kind}}, gauges_.regions ? gauges_.regions(kind) : 0});
    }
    families.push_back(Sampled("packd_regions",
                               "Registered tensor-handle regions, by kind.",
                               MetricType::Gauge, regions));
    families.push_back(
        Sampled("packd_regions_expired_total",
                "Regions unregistered because no call named them for their "
                "lease.",
                MetricType::Counter, one(gauges_.regions_expired)));
    AddDeviceCounters(&families);
    return families;
  }

 private:
  // What packd asked of each GPU kind (kernels/device_counters.h).
  static void AddDeviceCounters(std::vector<prometheus::MetricFamily>* out) {
    using prometheus::MetricType;
    Series syncs, operations, bytes, acquisitions, misses;
    for (DeviceKind kind : {DeviceKind::kCuda, DeviceKind::kHip}) {
      const std::string device = kind == DeviceKind::kCuda ? "cuda" : "hip";
      const DeviceCounts c = DeviceCounters::Of(kind).Read();
      syncs.push_back({{{"device", device}}, c.synchronizations});
      for (int i = 0; i < kDeviceOps; ++i) {
        const auto op = static_cast<DeviceOp>(i);
        operations.push_back(
            {{{"device", device}, {"kind", DeviceOpName(op)}}, c.ops(op)});
      }
      for (const auto& [op, direction] :
           {std::pair<DeviceOp, const char*>{DeviceOp::kCopyHostToDevice,
                                             "h2d"},
            {DeviceOp::kCopyDeviceToHost, "d2h"},
            {DeviceOp::kCopyDeviceToDevice, "d2d"}}) {
        bytes.push_back(
            {{{"device", device}, {"direction", direction}}, c.bytes(op)});
      }
      acquisitions.push_back({{{"device", device}}, c.pool_acquisitions});
      misses.push_back({{{"device", device}}, c.pool_misses});
    }
    out->push_back(Sampled("packd_device_synchronizations_total",
                           "Times packd waited on the host for a device's "
                           "stream.",
                           MetricType::Counter, syncs));
    out->push_back(Sampled("packd_device_operations_total",
                           "Stream operations queued on a device, by kind "
                           "(kernel, memset, copy_h2d, copy_d2h, copy_d2d).",
                           MetricType::Counter, operations));
    out->push_back(Sampled("packd_device_copy_bytes_total",
                           "Bytes copied to, from and within a device, by "
                           "direction.",
                           MetricType::Counter, bytes));
    out->push_back(Sampled("packd_device_pool_acquisitions_total",
                           "Blocks of device memory asked of packd's pool.",
                           MetricType::Counter, acquisitions));
    out->push_back(Sampled("packd_device_pool_misses_total",
                           "Blocks of device memory the pool had to allocate.",
                           MetricType::Counter, misses));
  }

  const std::shared_ptr<prometheus::Registry> registry_;
  const Gauges gauges_;
};

Metrics::Metrics(Gauges gauges)
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(prometheus::BuildCounter()
                    .Name("packd_requests_total")
                    .Help("Calls finished, by method and status code.")
                    .Register(*registry_)),
      tenant_calls_(prometheus::BuildCounter()
                        .Name("packd_tenant_calls_total")
                        .Help("Calls finished, by tenant (a token's name, a "
                              "certificate, a uid; never a token) and status "
                              "code.")
                        .Register(*registry_)),
      latency_(prometheus::BuildHistogram()
                   .Name("packd_request_duration_seconds")
                   .Help("Time from a call's arrival in the service to its "
                         "answer.")
                   .Register(*registry_)),
      request_bytes_(prometheus::BuildCounter()
                         .Name("packd_request_bytes_total")
                         .Help("Bytes of request messages.")
                         .Register(*registry_)),
      response_bytes_(prometheus::BuildCounter()
                          .Name("packd_response_bytes_total")
                          .Help("Bytes of response messages.")
                          .Register(*registry_)),
      device_calls_(prometheus::BuildCounter()
                        .Name("packd_device_calls_total")
                        .Help("Packs, scatters and step micro-batches run on "
                              "each device.")
                        .Register(*registry_)),
      device_errors_(
          prometheus::BuildCounter()
              .Name("packd_device_errors_total")
              .Help("Work on each device that failed in the device or its "
                    "runtime (INTERNAL, UNAVAILABLE, DATA_LOSS, UNKNOWN).")
              .Register(*registry_)),
      micro_batches_held_(prometheus::BuildGauge()
                              .Name("packd_step_micro_batches_held")
                              .Help("Micro-batches PackMicroBatches calls hold "
                                    "packed, not yet sent (at most two per "
                                    "call).")
                              .Register(*registry_)
                              .Add({})),
      step_phases_(prometheus::BuildCounter()
                       .Name("packd_step_phase_seconds_total")
                       .Help("Time PackMicroBatches calls spent in each phase: "
                             "measure, plan, device, pack, send (pack and send "
                             "overlap).")
                       .Register(*registry_)),
      stream_steps_(prometheus::BuildGauge()
                        .Name("packd_stream_steps_open")
                        .Help("Streaming steps open on this replica.")
                        .Register(*registry_)
                        .Add({})),
      stream_rows_pending_(
          prometheus::BuildGauge()
              .Name("packd_stream_rows_pending")
              .Help("Rows submitted to streaming steps and not "
                    "yet sent in a micro-batch.")
              .Register(*registry_)
              .Add({})),
      stream_waves_(prometheus::BuildCounter()
                        .Name("packd_stream_waves_total")
                        .Help("Waves streaming steps committed (one "
                              "micro-batch per rank each), the close's "
                              "included.")
                        .Register(*registry_)
                        .Add({})),
      stream_group_wait_(
          prometheus::BuildHistogram()
              .Name("packd_stream_group_wait_seconds")
              .Help("Time from a group's arrival in a streaming step to a "
                    "micro-batch with its rows being sent.")
              .Register(*registry_)
              .Add({},
                   prometheus::Histogram::BucketBoundaries{
                       0.001, 0.01, 0.1, 0.5, 1, 5, 15, 60, 300, 1800})),
      stream_step_held_(
          prometheus::BuildGauge()
              .Name("packd_stream_step_held_bytes")
              .Help("Bytes each open streaming step holds of "
                    "--max_inflight_bytes: kind=groups, rows submitted and "
                    "not yet packed; kind=micro_batches, packed and not yet "
                    "taken by their rank's stream.")
              .Register(*registry_)),
      collector_(std::make_shared<Collector>(registry_, std::move(gauges))) {}

void Metrics::StreamSteps(int64_t delta) {
  stream_steps_.Increment(static_cast<double>(delta));
}

void Metrics::StreamRowsPending(int64_t delta) {
  stream_rows_pending_.Increment(static_cast<double>(delta));
}

Metrics::StepHeld Metrics::AddStepHeld(const std::string& tenant,
                                       const std::string& step) {
  StepHeld held;
  held.groups = &stream_step_held_.Add(
      {{"tenant", tenant}, {"step", step}, {"kind", "groups"}});
  held.micro_batches = &stream_step_held_.Add(
      {{"tenant", tenant}, {"step", step}, {"kind", "micro_batches"}});
  return held;
}

void Metrics::RemoveStepHeld(const StepHeld& held) {
  if (held.groups != nullptr) stream_step_held_.Remove(held.groups);
  if (held.micro_batches != nullptr) {
    stream_step_held_.Remove(held.micro_batches);
  }
}

void Metrics::StreamWave() { stream_waves_.Increment(); }

void Metrics::StreamGroupSent(absl::Duration waited) {
  stream_group_wait_.Observe(absl::ToDoubleSeconds(waited));
}

Metrics::~Metrics() = default;

Metrics::PerMethod& Metrics::MethodLocked(absl::string_view method) {
  auto it = methods_.find(method);
  if (it != methods_.end()) return it->second;
  PerMethod& m = methods_[method];
  const std::string name(method);
  m.latency =
      &latency_.Add({{"method", name}}, prometheus::Histogram::BucketBoundaries(
                                            kBuckets.begin(), kBuckets.end()));
  m.request_bytes = &request_bytes_.Add({{"method", name}});
  m.response_bytes = &response_bytes_.Add({{"method", name}});
  return m;
}

void Metrics::Record(absl::string_view method, absl::StatusCode code,
                     absl::Duration latency, uint64_t request_bytes,
                     uint64_t response_bytes, absl::string_view tenant) {
  // Safe from any thread: the family finds or makes the labels' counter.
  tenant_calls_
      .Add({{"tenant", std::string(tenant)}, {"code", CodeLabel(code)}})
      .Increment();
  const size_t index = static_cast<size_t>(code);
  // Copied under the lock: the map moves its values when it grows, the
  // metrics they point to stay.
  PerMethod m;
  prometheus::Counter* calls;
  {
    absl::MutexLock lock(&mu_);
    PerMethod& slot = MethodLocked(method);
    // absl::StatusCode has 17 values; anything else counts as UNKNOWN.
    const size_t at = index < slot.calls.size()
                          ? index
                          : static_cast<size_t>(absl::StatusCode::kUnknown);
    if (slot.calls[at] == nullptr) {
      slot.calls[at] = &requests_.Add(
          {{"method", std::string(method)},
           {"code", CodeLabel(static_cast<absl::StatusCode>(at))}});
    }
    calls = slot.calls[at];
    m.latency = slot.latency;
    m.request_bytes = slot.request_bytes;
    m.response_bytes = slot.response_bytes;
  }
  // prometheus-cpp's metrics are safe to update concurrently, and live as
  // long as their family.
  calls->Increment();
  m.latency->Observe(absl::ToDoubleSeconds(latency));
  m.request_bytes->Increment(static_cast<double>(request_bytes));
  m.response_bytes->Increment(static_cast<double>(response_bytes));
}

Metrics::PerDevice Metrics::DeviceOf(const Device& device) {
  const std::string name = device.ToString();
  absl::MutexLock lock(&mu_);
  PerDevice& slot = devices_[name];
  if (slot.calls == nullptr) {
    slot.calls = &device_calls_.Add({{"device", name}});
    slot.errors = &device_errors_.Add({{"device", name}});
  }
  return slot;
}

void Metrics::AddDevice(const Device& device) { DeviceOf(device); }

void Metrics::RecordDevice(const Device& device, absl::StatusCode code) {
  const PerDevice d = DeviceOf(device);
  d.calls->Increment();
  if (IsDeviceError(code)) d.errors->Increment();
}

void Metrics::RecordStepPhase(absl::string_view phase, absl::Duration took) {
  step_phases_.Add({{"phase", std::string(phase)}})
      .Increment(absl::ToDoubleSeconds(took));
}

void Metrics::HoldMicroBatches(int64_t delta) {
  micro_batches_held_.Increment(static_cast<double>(delta));
}

std::string Metrics::Render() const {
  return prometheus::TextSerializer().Serialize(collector_->Collect());
}

}  // namespace packd
