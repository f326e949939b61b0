#include "server/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace packd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(Metrics, CountsCallsByMethodAndCodeWithTheirLatencyAndBytes) {
  Metrics metrics;
  metrics.Record("Pack", absl::StatusCode::kOk, absl::Microseconds(300), 100,
                 40);
  metrics.Record("Pack", absl::StatusCode::kOk, absl::Seconds(7), 1, 2);
  metrics.Record("Pack", absl::StatusCode::kInvalidArgument,
                 absl::Microseconds(50), 10, 0);
  metrics.Record("Scatter", absl::StatusCode::kOk, absl::Milliseconds(2), 5, 6);
  const std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("# TYPE packd_requests_total counter\n"));
  EXPECT_THAT(
      text, HasSubstr("packd_requests_total{code=\"ok\",method=\"Pack\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("packd_requests_total{code=\"invalid_argument\","
                              "method=\"Pack\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("packd_requests_total{code=\"ok\",method="
                              "\"Scatter\"} 1\n"));
  // Buckets are cumulative: 50 us and 300 us under 0.0005, 7 s only in +Inf.
  EXPECT_THAT(text, HasSubstr("packd_request_duration_seconds_bucket{method="
                              "\"Pack\",le=\"0.0001\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("packd_request_duration_seconds_bucket{method="
                              "\"Pack\",le=\"0.0005\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("packd_request_duration_seconds_bucket{method="
                              "\"Pack\",le=\"5\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("packd_request_duration_seconds_bucket{method="
                              "\"Pack\",le=\"+Inf\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("packd_request_duration_seconds_count{method="
                              "\"Pack\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("packd_request_bytes_total{method=\"Pack\"} "
                              "111\n"));
  EXPECT_THAT(text, HasSubstr("packd_response_bytes_total{method=\"Scatter\"} "
                              "6\n"));
}

TEST(Metrics, CountsDeviceWorkAndOnlyTheDevicesOwnFailuresAsErrors) {
  Metrics metrics;
  const Device cpu = Device::Cpu();
  const Device gpu{DeviceKind::kCuda, 1};
  metrics.AddDevice(gpu);
  std::string text = metrics.Render();
  EXPECT_THAT(text,
              HasSubstr("packd_device_calls_total{device=\"cuda:1\"} 0\n"));
  EXPECT_THAT(text,
              HasSubstr("packd_device_errors_total{device=\"cuda:1\"} 0\n"));
  EXPECT_THAT(text, Not(HasSubstr("device=\"cpu\"")));

  metrics.RecordDevice(cpu, absl::StatusCode::kOk);
  metrics.RecordDevice(cpu, absl::StatusCode::kInvalidArgument);  // caller's
  metrics.RecordDevice(cpu, absl::StatusCode::kResourceExhausted);
  for (absl::StatusCode code :
       {absl::StatusCode::kInternal, absl::StatusCode::kUnavailable,
        absl::StatusCode::kDataLoss, absl::StatusCode::kUnknown}) {
    metrics.RecordDevice(gpu, code);
  }
  text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("packd_device_calls_total{device=\"cpu\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("packd_device_errors_total{device=\"cpu\"} 0\n"));
  EXPECT_THAT(text,
              HasSubstr("packd_device_calls_total{device=\"cuda:1\"} 4\n"));
  EXPECT_THAT(text,
              HasSubstr("packd_device_errors_total{device=\"cuda:1\"} 4\n"));
}

TEST(Metrics, ReadsTheGaugesAtEachScrape) {
  int64_t in_flight = 2, regions = 0;
  Metrics metrics(Metrics::Gauges{
      [&] { return in_flight; }, [] { return int64_t{4096}; },
      [] { return int64_t{1} << 30; }, [] { return int64_t{3}; },
      [&](absl::string_view kind) { return kind == "system" ? regions : 7; },
      [] { return int64_t{5}; }});
  metrics.HoldMicroBatches(2);
  metrics.HoldMicroBatches(-1);
  std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("packd_calls_in_flight 2\n"));
  EXPECT_THAT(text, HasSubstr("packd_budget_bytes_in_use 4096\n"));
  EXPECT_THAT(text, HasSubstr("packd_budget_bytes_limit 1073741824\n"));
  EXPECT_THAT(text, HasSubstr("packd_budget_waiting 3\n"));
  EXPECT_THAT(text, HasSubstr("packd_regions{kind=\"system\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("packd_regions{kind=\"device\"} 7\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE packd_regions_expired_total counter\n"
                              "packd_regions_expired_total 5\n"));
  EXPECT_THAT(text, HasSubstr("packd_step_micro_batches_held 1\n"));
  in_flight = 0;
  regions = 9;
  text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("packd_calls_in_flight 0\n"));
  EXPECT_THAT(text, HasSubstr("packd_regions{kind=\"system\"} 9\n"));
}

TEST(Metrics, GaugesNotGivenReadZero) {
  const std::string text = Metrics().Render();
  EXPECT_THAT(text, HasSubstr("packd_calls_in_flight 0\n"));
  EXPECT_THAT(text, HasSubstr("packd_regions{kind=\"system\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("packd_budget_waiting 0\n"));
}

// Calls finish on many threads while /metrics is read: every one is counted.
TEST(Metrics, CountsEveryCallOfManyThreadsWhileScraped) {
  Metrics metrics;
  constexpr int kThreads = 4, kCalls = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string method = t % 2 == 0 ? "Pack" : "Scatter";
      for (int i = 0; i < kCalls; ++i) {
        metrics.Record(
            method,
            i % 4 == 0 ? absl::StatusCode::kInternal : absl::StatusCode::kOk,
            absl::Microseconds(i), 1, 1);
        metrics.RecordDevice(Device{DeviceKind::kCuda, t},
                             absl::StatusCode::kOk);
      }
    });
  }
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(metrics.Render().empty());
  for (std::thread& t : threads) t.join();
  const std::string text = metrics.Render();
  EXPECT_THAT(
      text,
      HasSubstr("packd_requests_total{code=\"ok\",method=\"Pack\"} 3000\n"));
  EXPECT_THAT(text, HasSubstr("packd_requests_total{code=\"internal\",method="
                              "\"Scatter\"} 1000\n"));
  EXPECT_THAT(text, HasSubstr("packd_request_duration_seconds_count{method="
                              "\"Scatter\"} 4000\n"));
  EXPECT_THAT(text,
              HasSubstr("packd_device_calls_total{device=\"cuda:3\"} 2000\n"));
}

TEST(MetricsServer, RefusesMalformedAddressesAndPortsInUse) {
  Metrics metrics;
  for (const char* bad : {"9090", "host:9090", "127.0.0.1:x", "127.0.0.1:-1",
                          "127.0.0.1:65536", "[::1]:9090", ""}) {
    auto server = MetricsServer::Start(bad, metrics.collectable());
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
    EXPECT_THAT(std::string(server.status().message()),
                HasSubstr("IPV4_ADDRESS:PORT"));
  }
  auto first = MetricsServer::Start("127.0.0.1:0", metrics.collectable());
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = (*first)->address();
  EXPECT_THAT(address, HasSubstr("127.0.0.1:"));
  EXPECT_NE(address, "127.0.0.1:0");
  auto second = MetricsServer::Start(address, metrics.collectable());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("--metrics_listen"));
  auto local = MetricsServer::Start("localhost:0", metrics.collectable());
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_THAT((*local)->address(), HasSubstr("localhost:"));
}

}  // namespace
}  // namespace packd
