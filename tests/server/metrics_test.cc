#include "service/metrics.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/device_counters.h"
#include "server/metrics_server.h"

// Static TLS as large as libtorch with OpenBLAS gives packd on a fresh Debian
// machine (112 KiB there), and more: in the executable, so every thread of
// this test carries it. A thread started with a fixed 100 KiB stack (as
// Debian's civetweb starts its own) cannot be created in this process.
__attribute__((tls_model("initial-exec"),
               used)) thread_local char large_static_tls[256 << 10];

namespace packd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// Connects to "HOST:PORT" (HOST numeric, or localhost); -1 when it cannot.
int Connect(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon);
  if (host == "localhost") host = "127.0.0.1";
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port)) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) return -1;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Sends `request` to the server at `address` and returns all it answers
// until it closes the connection.
std::string Exchange(const std::string& address, const std::string& request) {
  const int fd = Connect(address);
  if (fd < 0) return "(cannot connect)";
  send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string reply;
  char buffer[4096];
  ssize_t got;
  while ((got = recv(fd, buffer, sizeof(buffer), 0)) > 0) {
    reply.append(buffer, static_cast<size_t>(got));
  }
  close(fd);
  return reply;
}

std::string Get(const std::string& address, const std::string& path) {
  return Exchange(address, absl::StrCat("GET ", path,
                                        " HTTP/1.1\r\nHost: packd\r\n"
                                        "Accept: */*\r\n\r\n"));
}

TEST(Metrics, CountsCallsByMethodAndCodeWithTheirLatencyAndBytes) {
  Metrics metrics;
  metrics.Record("Pack", absl::StatusCode::kOk, absl::Microseconds(300), 100,
                 40);
  metrics.Record("Pack", absl::StatusCode::kOk, absl::Seconds(7), 1, 2);
  metrics.Record("Pack", absl::StatusCode::kInvalidArgument,
                 absl::Microseconds(50), 10, 0);
  metrics.Record("Scatter", absl::StatusCode::kOk, absl::Milliseconds(2), 5, 6,
                 "job-a");
  const std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("packd_tenant_calls_total{code=\"ok\",tenant="
                              "\"anonymous\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("packd_tenant_calls_total{code=\"ok\",tenant="
                              "\"job-a\"} 1\n"));
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

TEST(Metrics, ExportsWhatEachGpuKindWasAskedSinceStart) {
  Metrics metrics;
  DeviceCounters& hip = DeviceCounters::Of(DeviceKind::kHip);
  const DeviceCounts before = hip.Read();
  hip.Synchronized();
  hip.Operation(DeviceOp::kKernel);
  hip.Operation(DeviceOp::kKernel);
  hip.Operation(DeviceOp::kCopyHostToDevice, 1000);
  hip.Operation(DeviceOp::kCopyDeviceToHost, 24);
  hip.PoolAcquired();
  hip.PoolMissed();
  const DeviceCounts cost = hip.Read() - before;
  EXPECT_EQ(cost.synchronizations, 1);
  EXPECT_EQ(cost.ops(DeviceOp::kKernel), 2);
  EXPECT_EQ(cost.total_operations(), 4);
  EXPECT_EQ(cost.bytes(DeviceOp::kCopyHostToDevice), 1000);
  EXPECT_EQ(cost.pool_misses, 1);

  // Nothing else in this process uses the hip kind: the totals are these.
  const std::string text = metrics.Render();
  for (const char* line :
       {"packd_device_synchronizations_total{device=\"hip\"} 1\n",
        "packd_device_operations_total{device=\"hip\",kind=\"kernel\"} 2\n",
        "packd_device_operations_total{device=\"hip\",kind=\"memset\"} 0\n",
        "packd_device_operations_total{device=\"hip\",kind=\"copy_h2d\"} 1\n",
        "packd_device_copy_bytes_total{device=\"hip\",direction=\"h2d\"} "
        "1000\n",
        "packd_device_copy_bytes_total{device=\"hip\",direction=\"d2h\"} 24\n",
        "packd_device_pool_acquisitions_total{device=\"hip\"} 1\n",
        "packd_device_pool_misses_total{device=\"hip\"} 1\n",
        "packd_device_synchronizations_total{device=\"cuda\"} 0\n"}) {
    EXPECT_THAT(text, HasSubstr(line));
  }
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
  for (const char* line :
       {"packd_calls_in_flight 2\n", "packd_budget_bytes_in_use 4096\n",
        "packd_budget_bytes_limit 1073741824\n", "packd_budget_waiting 3\n",
        "packd_regions{kind=\"system\"} 0\n",
        "packd_regions{kind=\"device\"} 7\n",
        "# TYPE packd_regions_expired_total counter\n"
        "packd_regions_expired_total 5\n",
        "packd_step_micro_batches_held 1\n"}) {
    EXPECT_THAT(text, HasSubstr(line));
  }
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
  // The system's own reason, not a guess.
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("(--metrics_listen): bind: Address already in use"));
  auto local = MetricsServer::Start("localhost:0", metrics.collectable());
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_THAT((*local)->address(), HasSubstr("localhost:"));
}

TEST(MetricsServer, ServesTheMetricsAndNothingElse) {
  Metrics metrics;
  metrics.Record("Pack", absl::StatusCode::kOk, absl::Milliseconds(2), 10, 20);
  auto server = MetricsServer::Start("127.0.0.1:0", metrics.collectable());
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->address();

  const std::string ok = Get(address, "/metrics");
  EXPECT_THAT(ok, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(ok, HasSubstr("Content-Type: text/plain; version=0.0.4"));
  const size_t body = ok.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos);
  EXPECT_THAT(ok, HasSubstr(absl::StrCat(
                      "Content-Length: ", ok.size() - body - 4, "\r\n")));
  EXPECT_THAT(ok.substr(body + 4),
              HasSubstr("packd_requests_total{code=\"ok\",method=\"Pack\"} "
                        "1\n"));
  // The families read at each scrape: a call recorded since shows.
  metrics.Record("Pack", absl::StatusCode::kOk, absl::Milliseconds(2), 10, 20);
  EXPECT_THAT(Get(address, "/metrics?x=1"),
              HasSubstr("packd_requests_total{code=\"ok\",method=\"Pack\"} "
                        "2\n"));

  EXPECT_THAT(Get(address, "/"), StartsWith("HTTP/1.1 404 Not Found\r\n"));
  EXPECT_THAT(Get(address, "/metricsx"), HasSubstr("packd serves /metrics"));
  EXPECT_THAT(Exchange(address, "POST /metrics HTTP/1.1\r\n\r\n"),
              StartsWith("HTTP/1.1 405 "));
  EXPECT_THAT(Exchange(address, "hello\r\n\r\n"), StartsWith("HTTP/1.1 400 "));
  const std::string head = Exchange(address, "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_THAT(head, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_EQ(head.find("packd_requests_total"), std::string::npos);
}

TEST(MetricsServer, AClientThatSendsNothingHoldsItAtMostTwoSeconds) {
  Metrics metrics;
  auto server = MetricsServer::Start("127.0.0.1:0", metrics.collectable());
  ASSERT_TRUE(server.ok()) << server.status();
  const int idle = Connect((*server)->address());
  ASSERT_GE(idle, 0);
  // Answered once the idle connection times out (2 s): served, not stuck.
  EXPECT_THAT(Get((*server)->address(), "/metrics"),
              StartsWith("HTTP/1.1 200 OK\r\n"));
  close(idle);
}

// The fresh-machine failure: with this binary's large static TLS, a server
// whose threads had a small fixed stack could not start.
TEST(MetricsServer, StartsAndStopsInAProcessWithLargeStaticTls) {
  large_static_tls[0] = 1;  // this thread's copy exists
  Metrics metrics;
  for (int i = 0; i < 3; ++i) {
    auto server = MetricsServer::Start("127.0.0.1:0", metrics.collectable());
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_THAT(Get((*server)->address(), "/metrics"),
                StartsWith("HTTP/1.1 200 OK\r\n"));
    server->reset();  // stops: wakes its thread and joins it
  }
}

}  // namespace
}  // namespace packd
