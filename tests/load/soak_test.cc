// Soak: 8 clients against one packd for PACKD_SOAK_SECONDS (30 by default;
// set it to hours by hand), on a unix socket. Each client mixes Pack and
// Scatter, inline and through shared memory, on random shapes, dtypes and
// masks, checking every answer byte for byte against torch; faults are mixed
// in: malformed requests, deadlines that expire, and shared-memory segments
// registered and dropped. It asserts that no call gets an unexpected status,
// that health stays SERVING, that the server's memory stops growing after
// warm-up, and that its open files and /dev/shm entries return to where they
// started; and prints calls/s, latency and the status table.
#include <ATen/ATen.h>
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "kernels/torch/torch_interop.h"
#include "tests/e2e/server_process.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using testing::Rng;
using testing::SameBytes;
using testing::ServerProcess;

int64_t SoakSeconds() {
  int64_t seconds = 30;
  if (const char* env = std::getenv("PACKD_SOAK_SECONDS")) {
    absl::SimpleAtoi(env, &seconds);
  }
  return seconds;
}

// VmRSS of `pid` in bytes.
int64_t Rss(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      return std::atoll(line.c_str() + 6) * 1024;
    }
  }
  return 0;
}

int CountEntries(const std::string& dir, const std::string& prefix = "") {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != ".." && absl::StartsWith(name, prefix)) ++n;
    }
    closedir(d);
  }
  return n;
}

struct Tally {
  std::mutex mu;
  std::map<std::string, int64_t> codes;  // "Pack inline: OK", ...
  std::vector<double> ms;
  int64_t unexpected = 0;
  std::vector<std::string> failures;

  void Add(const std::string& what, const absl::Status& status, bool expected,
           double ms_taken) {
    std::lock_guard<std::mutex> lock(mu);
    ++codes[absl::StrCat(what, ": ", absl::StatusCodeToString(status.code()))];
    ms.push_back(ms_taken);
    if (!expected) {
      ++unexpected;
      if (failures.size() < 10) {
        failures.push_back(absl::StrCat(what, ": ", status.ToString()));
      }
    }
  }
};

// One client's loop until `until`.
void Worker(const std::string& address, uint64_t seed, absl::Time until,
            Tally* tally) {
  Rng rng{std::mt19937_64(seed)};
  ClientOptions options;
  options.address = address;
  options.shm_key_prefix = "/packd_soak";
  options.shared_memory_threshold_bytes = 0;
  options.split_threshold_bytes = 1 << 20;
  auto inline_client = std::move(*Client::Connect(options));
  options.shared_memory_threshold_bytes = 1;  // every call through handles
  auto shm_client = std::move(*Client::Connect(options));
  options.shared_memory_threshold_bytes = 0;
  options.deadline = absl::Microseconds(1);
  options.max_attempts = 1;
  auto hasty_client = std::move(*Client::Connect(options));
  const DType dtypes[] = {DType::kBool,    DType::kUInt8,    DType::kInt8,
                          DType::kInt16,   DType::kInt32,    DType::kInt64,
                          DType::kFloat16, DType::kBFloat16, DType::kFloat32,
                          DType::kFloat64};
  while (absl::Now() < until) {
    const int64_t B = 1 + rng.Next() % 12, S = 1 + rng.Next() % 300;
    const int64_t H = 1 + rng.Next() % 96;
    const DType dtype = dtypes[rng.Next() % 10];
    const at::Tensor mask = testing::RandomMask(
        rng, dtypes[rng.Next() % 10], B, S, rng.Uniform(),
        rng.Next() % 2 ? MaskPattern::kPrefix : MaskPattern::kHoles);
    const at::Tensor x = testing::RandomTensor(rng, dtype, {B, S, H});
    const int op = static_cast<int>(rng.Next() % 10);
    const absl::Time start = absl::Now();
    auto took = [&] { return absl::ToDoubleMilliseconds(absl::Now() - start); };
    if (op < 4) {  // Pack, inline or through handles
      Client* client = op < 2 ? inline_client.get() : shm_client.get();
      absl::StatusOr<PackedBatch> r = client->Pack({x}, mask);
      const bool ok =
          r.ok() && SameBytes(testing::ReferencePack(x, mask), r->packed[0]);
      tally->Add(
          op < 2 ? "Pack inline" : "Pack handles",
          r.ok() ? (ok ? absl::OkStatus() : absl::DataLossError("wrong bytes"))
                 : r.status(),
          ok, took());
    } else if (op < 7) {  // Scatter
      const at::Tensor packed = testing::ReferencePack(x, mask);
      Client* client = op < 6 ? inline_client.get() : shm_client.get();
      absl::StatusOr<std::vector<at::Tensor>> d =
          client->Scatter({packed}, mask);
      const bool ok = d.ok() && SameBytes(testing::ReferenceScatter(
                                              packed, mask, {B, S, H}),
                                          (*d)[0]);
      tally->Add(
          op < 6 ? "Scatter inline" : "Scatter handles",
          d.ok() ? (ok ? absl::OkStatus() : absl::DataLossError("wrong bytes"))
                 : d.status(),
          ok, took());
    } else if (op == 7) {  // malformed: the input's S is off by one
      absl::StatusOr<PackedBatch> r = inline_client->Pack(
          {testing::RandomTensor(rng, dtype, {B, S + 1, H})}, mask);
      tally->Add("Pack malformed", r.status(),
                 r.status().code() == absl::StatusCode::kInvalidArgument,
                 took());
    } else if (op == 8) {  // a deadline that expires
      absl::StatusOr<PackedBatch> r = hasty_client->Pack({x}, mask);
      tally->Add(
          "Pack expired", r.status(),
          r.status().code() == absl::StatusCode::kDeadlineExceeded || r.ok(),
          took());
    } else {  // register and drop a segment
      absl::StatusOr<std::unique_ptr<SharedMemory>> segment =
          inline_client->CreateSharedMemory(int64_t{1} << 20);
      tally->Add("Register/unregister", segment.status(), segment.ok(), took());
    }
  }
}

TEST(Soak, EightClientsWithFaults) {
  const int64_t seconds = SoakSeconds();
  auto server = ServerProcess::Start({"--shm_key_prefix=/packd_soak"});
  ASSERT_NE(server, nullptr);
  // Held for the whole test: when a process drops its last gRPC object, gRPC
  // shuts itself down, which can take seconds.
  const std::shared_ptr<grpc::Channel> keep_grpc_up = server->Channel();
  const pid_t pid = server->pid();
  const std::string fd_dir = absl::StrCat("/proc/", pid, "/fd");
  const int fds_before = CountEntries(fd_dir);
  const int shm_before = CountEntries("/dev/shm", "packd_soak");

  Tally tally;
  const absl::Time start = absl::Now();
  const absl::Time until = start + absl::Seconds(seconds);
  std::vector<std::thread> clients;
  for (int i = 0; i < 8; ++i) {
    clients.emplace_back(Worker, server->address(), 1000 + i, until, &tally);
  }
  // Health throughout, and memory after warm-up (a third of the run).
  int64_t rss_warm = 0, rss_peak_after = 0;
  bool always_serving = true;
  while (absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(500));
    always_serving &=
        testing::HealthStatus(server->Channel(), "packd.v1.PackService") ==
        "SERVING";
    const int64_t rss = Rss(pid);
    if (absl::Now() - start < absl::Seconds(seconds) / 3) {
      rss_warm = std::max(rss_warm, rss);
    } else {
      rss_peak_after = std::max(rss_peak_after, rss);
    }
  }
  for (std::thread& t : clients) t.join();
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);

  std::sort(tally.ms.begin(), tally.ms.end());
  const size_t n = tally.ms.size();
  std::printf(
      "soak: %zu calls in %.1f s (%.0f calls/s), p50 %.2f ms, p99 %.2f "
      "ms; server RSS %.1f MiB after warm-up, %.1f MiB peak after\n",
      n, elapsed, n / elapsed, n ? tally.ms[n / 2] : 0.0,
      n ? tally.ms[std::min(n - 1, n * 99 / 100)] : 0.0, rss_warm / 1048576.0,
      rss_peak_after / 1048576.0);
  for (const auto& [what, count] : tally.codes) {
    std::printf("  %-40s %8lld\n", what.c_str(), static_cast<long long>(count));
  }
  for (const std::string& f : tally.failures)
    std::printf("  failure: %s\n", f.c_str());

  EXPECT_EQ(tally.unexpected, 0);
  EXPECT_TRUE(always_serving);
  EXPECT_GT(n, 100u);
  // Under AddressSanitizer the server's memory holds ASan's quarantine of
  // freed blocks, which keeps filling: the figure is printed, not judged.
  if (std::getenv("ASAN_OPTIONS") == nullptr) {
    EXPECT_LT(rss_peak_after, rss_warm + rss_warm / 10)
        << "server memory grew by more than 10% after warm-up";
  }
  // Every client is gone: its segments are unregistered and unlinked.
  absl::Time settle = absl::Now() + absl::Seconds(10);
  while (absl::Now() < settle &&
         (CountEntries(fd_dir) > fds_before ||
          CountEntries("/dev/shm", "packd_soak") != shm_before)) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_LE(CountEntries(fd_dir), fds_before);
  EXPECT_EQ(CountEntries("/dev/shm", "packd_soak"), shm_before);
}

}  // namespace
}  // namespace packd
