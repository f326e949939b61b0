// packctl bench: Pack calls at a concurrency for a duration, inline or through
// shared memory, each worker on a connection of its own; latency percentiles
// and throughput.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "client/region_arena.h"
#include "packctl/packctl.h"

namespace packd::packctl {
namespace {

// What the bench workers share.
struct BenchRun {
  const Batch* batch = nullptr;
  const ClientOptions* client = nullptr;
  bool shm = false;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> calls{0};
  std::mutex mu;
  std::vector<double> latencies;  // ms, every call of every worker
  std::string error;              // the first error; it stops the run

  void Fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu);
    if (error.empty()) error = message;
    stop = true;
  }
};

// A shared-memory region registered with the server for the life of the
// object (its name unlinked once the server has mapped it).
absl::StatusOr<std::unique_ptr<RegionArena>> BenchRegion(Connection& connection,
                                                         int64_t bytes) {
  Connection::SegmentName name = connection.NewSegmentName("packctl");
  const std::string region = name.region;
  // On a failed registration the unregister finds nothing, harmlessly.
  absl::StatusOr<std::unique_ptr<RegionArena>> shm =
      RegionArena::Create(std::move(name.key), region,
                          std::max<int64_t>(bytes, 1), [&connection, region] {
                            connection.UnregisterRegion(region).IgnoreError();
                          });
  if (!shm.ok()) return shm.status();
  absl::Status registered =
      connection.RegisterSegment((*shm)->segment(), region);
  if (!registered.ok()) return registered;
  return shm;
}

// The first `bytes` of `region`.
v1::RegionSlice Head(const RegionArena& region, int64_t bytes) {
  v1::RegionSlice slice;
  region.Contains(region.At(0), bytes, &slice);
  return slice;
}

// One connection calling Pack until the run stops. Inline, each call sends x
// from the batch's own memory. With shm, x is written once into one region and
// the results land in another: nothing is copied per call.
void BenchWorker(BenchRun& run) {
  absl::StatusOr<std::unique_ptr<Connection>> connection =
      Connection::Open(*run.client);
  if (!connection.ok()) return run.Fail(connection.status().ToString());
  const Batch& batch = *run.batch;
  const int64_t bytes = static_cast<int64_t>(batch.x.size());
  std::unique_ptr<RegionArena> in, out;
  v1::RegionSlice x_in, results;
  if (run.shm) {
    auto a = BenchRegion(**connection, bytes);
    if (!a.ok()) return run.Fail(a.status().ToString());
    auto b = BenchRegion(**connection, bytes);
    if (!b.ok()) return run.Fail(b.status().ToString());
    in = *std::move(a);
    out = *std::move(b);
    std::memcpy(in->At(0), batch.x.data(), bytes);
    x_in = Head(*in, bytes);
    results = Head(*out, bytes);
  }
  Wire<v1::PackRequest> request;
  PackRequestFor(batch, run.shm ? &x_in : nullptr, run.shm ? &results : nullptr,
                 &request);
  std::vector<double> mine;
  while (!run.stop) {
    Wire<v1::PackResponse> reply;
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status status =
        (*connection)->RawCall(0, kPackMethod, request, &reply);
    mine.push_back(std::chrono::duration<double, std::milli>(
                       std::chrono::steady_clock::now() - t0)
                       .count());
    if (!status.ok()) run.Fail(status.ToString());
    ++run.calls;
  }
  std::lock_guard<std::mutex> lock(run.mu);
  run.latencies.insert(run.latencies.end(), mine.begin(), mine.end());
}

// Waits until `duration` seconds pass or the run stops, with a live progress
// line on a terminal; returns the seconds elapsed.
double WaitWithProgress(BenchRun& run, double duration) {
  const auto start = std::chrono::steady_clock::now();
  const bool tty = isatty(STDERR_FILENO);
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                         start)
        .count();
  };
  while (!run.stop && elapsed() < duration) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    if (tty) {
      const int64_t calls = run.calls.load();
      std::fprintf(stderr, "\r%5.1f / %.0f s  %8lld calls  %8.1f calls/s",
                   elapsed(), duration, static_cast<long long>(calls),
                   calls / elapsed());
    }
  }
  if (tty) std::fprintf(stderr, "\n");
  return elapsed();
}

// Prints (and with --json writes) latency percentiles and throughput.
void ReportBench(std::vector<double> latencies, double seconds,
                 int64_t bytes_per_call, const std::string& transport,
                 int concurrency, const std::string& json) {
  std::sort(latencies.begin(), latencies.end());
  auto pct = [&](double p) {
    return latencies.empty()
               ? 0.0
               : latencies[std::min(latencies.size() - 1,
                                    size_t(p * latencies.size()))];
  };
  const double max = latencies.empty() ? 0.0 : latencies.back();
  const double rate = latencies.size() / seconds;
  const double gbps = rate * bytes_per_call / 1e9;
  std::printf("transport %s, concurrency %d, %zu calls in %.1f s\n",
              transport.c_str(), concurrency, latencies.size(), seconds);
  std::printf("latency ms: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n", pct(0.5),
              pct(0.9), pct(0.99), max);
  std::printf("throughput: %.1f calls/s, %.3f GB/s of input\n", rate, gbps);
  if (json.empty()) return;
  std::ofstream f(json);
  f << absl::StrFormat(
      "{\"transport\": \"%s\", \"concurrency\": %d, \"calls\": %d, "
      "\"seconds\": %.3f, \"p50_ms\": %.4f, \"p90_ms\": %.4f, "
      "\"p99_ms\": %.4f, \"max_ms\": %.4f, \"calls_per_s\": %.2f, "
      "\"gbps\": %.4f}\n",
      transport, concurrency, latencies.size(), seconds, pct(0.5), pct(0.9),
      pct(0.99), max, rate, gbps);
}

}  // namespace

int BenchCommand(const BenchOptions& options) {
  absl::StatusOr<Batch> batch = MakeBatch(options.batch);
  if (!batch.ok()) return Fail(kUsage, std::string(batch.status().message()));
  const std::string& transport = options.transport;
  if (transport != "inline" && transport != "shm") {
    return Fail(kUsage, "--transport must be inline or shm");
  }
  const int concurrency = std::max(1, options.concurrency);
  BenchRun run;
  run.batch = &*batch;
  run.client = &options.client;
  run.shm = transport == "shm";
  std::vector<std::thread> workers;
  for (int w = 0; w < concurrency; ++w) {
    workers.emplace_back([&run] { BenchWorker(run); });
  }
  const double seconds = WaitWithProgress(run, options.duration);
  run.stop = true;
  for (auto& t : workers) t.join();
  if (!run.error.empty()) return Fail(kRpcError, run.error);
  ReportBench(std::move(run.latencies), seconds,
              static_cast<int64_t>(batch->x.size() + batch->mask.size()),
              transport, concurrency, options.json);
  return kOk;
}

}  // namespace packd::packctl
