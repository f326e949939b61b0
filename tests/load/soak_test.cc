// Soak: 8 clients against one packd for PACKD_SOAK_SECONDS (30 by default;
// set it to hours by hand), on a unix socket. Each client mixes Pack and
// Scatter, inline and through shared memory, on random shapes, dtypes and
// masks, checking every answer byte for byte against torch; faults are mixed
// in: malformed requests, deadlines that expire before or during a call,
// shared-memory segments registered and dropped, and two of the eight clients
// are processes killed with SIGKILL (every 1-3 s, then replaced) while they
// hold leased regions and have calls in flight. It asserts that no call gets
// an unexpected status, that health stays SERVING, that the server's memory
// stops growing after warm-up, and that its open files, its mappings and the
// /dev/shm entries return to where they started once the killed clients'
// leases run out; and prints calls/s, latency and the status table.
#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/torch_interop.h"
#include "client/client.h"
#include "gtest/gtest.h"
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

// RssAnon of `pid` in bytes: its own heap and stacks, without the pages of
// clients' shared memory it maps (those come and go with the clients).
int64_t Rss(pid_t pid) { return testing::ProcStatusBytes(pid, "RssAnon:"); }

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

// Lines of /proc/PID/maps naming `needle`: the shared-memory mappings.
int CountMappings(pid_t pid, const std::string& needle) {
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) n += line.find(needle) != std::string::npos;
  return n;
}

// The killed clients' lease: short, so the test sees them end.
constexpr uint32_t kVictimLeaseSeconds = 2;

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
  options.deadline = absl::Milliseconds(2);
  auto cancel_client = std::move(*Client::Connect(options));
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
    const int op = static_cast<int>(rng.Next() % 11);
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
    } else if (op == 10) {  // cancelled mid-flight: 2 MiB with a 2 ms deadline
      const at::Tensor big =
          testing::RandomTensor(rng, DType::kFloat32, {8, 256, 256});
      const at::Tensor big_mask = testing::RandomMask(rng, DType::kBool, 8, 256,
                                                      0.5, MaskPattern::kHoles);
      absl::StatusOr<PackedBatch> r = cancel_client->Pack({big}, big_mask);
      const bool ok = r.ok() && SameBytes(testing::ReferencePack(big, big_mask),
                                          r->packed[0]);
      tally->Add("Pack cancelled mid-flight", r.status(),
                 r.status().code() == absl::StatusCode::kDeadlineExceeded || ok,
                 took());
    } else {  // register and drop a segment
      absl::StatusOr<std::unique_ptr<SharedMemory>> segment =
          inline_client->CreateSharedMemory(int64_t{1} << 20);
      tally->Add("Register/unregister", segment.status(), segment.ok(), took());
    }
  }
}

// A client that runs until it is killed: its own segment (tensors written in
// place) and automatic handles, with a short lease. Started by the soak test
// as a process of this binary with PACKD_SOAK_VICTIM=<address>.
TEST(Soak, Victim) {
  const char* address = std::getenv("PACKD_SOAK_VICTIM");
  if (address == nullptr) GTEST_SKIP() << "run by the soak tests";
  ClientOptions options;
  options.address = address;
  options.shm_key_prefix = "/packd_soak";
  options.shared_memory_threshold_bytes = 1;
  options.lease_seconds = kVictimLeaseSeconds;
  auto client = std::move(*Client::Connect(options));
  auto segment = std::move(*client->CreateSharedMemory(int64_t{8} << 20));
  Rng rng{std::mt19937_64(std::random_device()())};
  for (int64_t i = 0;; ++i) {
    // The first call is the largest, so the automatic segment is made once.
    const int64_t B = i == 0 ? 8 : 1 + rng.Next() % 8;
    const int64_t S = i == 0 ? 256 : 1 + rng.Next() % 256;
    const at::Tensor mask =
        testing::RandomMask(rng, DType::kBool, B, S, 0.5, MaskPattern::kHoles);
    segment->Reset();
    at::Tensor x = segment->Empty({B, S, 64}, at::kFloat);
    x.copy_(testing::RandomTensor(rng, DType::kFloat32, {B, S, 64}));
    PackCallOptions in_place;
    in_place.results_in = segment.get();
    absl::StatusOr<PackedBatch> r = client->Pack({x}, mask, in_place);
    if (!r.ok() || !SameBytes(testing::ReferencePack(x, mask), r->packed[0])) {
      std::fprintf(stderr, "victim: %s\n", r.status().ToString().c_str());
      std::_Exit(3);
    }
    client->Scatter({r->packed[0].clone()}, mask).IgnoreError();
    // Both segments are registered and their names unlinked. (Killed in the
    // moment between creating a name and the server mapping it, a client
    // leaves the name behind: the test kills its victims after this.)
    if (i == 0) std::printf("\nvictim ready\n"), std::fflush(stdout);
  }
}

// Starts this binary as a victim client of `address`; `*out` reads its
// standard output (non-blocking).
pid_t SpawnVictim(const std::string& address, int* out) {
  const std::string env = absl::StrCat("PACKD_SOAK_VICTIM=", address);
  std::string exe = "/proc/self/exe", filter = "--gtest_filter=Soak.Victim";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  envp.push_back(const_cast<char*>(env.c_str()));
  envp.push_back(nullptr);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return -1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  pid_t pid = -1;
  posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  fcntl(fds[0], F_SETFL, O_NONBLOCK);
  *out = fds[0];
  return pid;
}

// The soak against a packd listening on `listen` (TCP loopback, where shared
// memory is allowed as well), or on a unix socket when it is empty.
void Soak(const std::string& listen) {
  const int64_t seconds = SoakSeconds();
  std::vector<std::string> flags = {"--shm_key_prefix=/packd_soak"};
  if (!listen.empty()) flags.push_back("--listen=" + listen);
  auto server = ServerProcess::Start(flags);
  ASSERT_NE(server, nullptr);
  // Held for the whole test: when a process drops its last gRPC object, gRPC
  // shuts itself down, which can take seconds.
  const std::shared_ptr<grpc::Channel> keep_grpc_up = server->Channel();
  const pid_t pid = server->pid();
  const std::string fd_dir = absl::StrCat("/proc/", pid, "/fd");
  auto regions = [&] {
    auto stub = v1::PackService::NewStub(keep_grpc_up);
    grpc::ClientContext context;
    v1::ListRegionsResponse list;
    stub->ListRegions(&context, v1::ListRegionsRequest(), &list);
    return list.regions_size();
  };
  ASSERT_EQ(regions(), 0);  // and the test's own connection is open
  const int fds_before = CountEntries(fd_dir);
  const int shm_before = CountEntries("/dev/shm", "packd_soak");
  const int maps_before = CountMappings(pid, "/packd_soak");

  Tally tally;
  const absl::Time start = absl::Now();
  const absl::Time until = start + absl::Seconds(seconds);
  std::vector<std::thread> clients;
  for (int i = 0; i < 6; ++i) {
    clients.emplace_back(Worker, server->address(), 1000 + i, until, &tally);
  }
  // Two more clients are processes, each killed with SIGKILL 1-3 s after it
  // starts (mid-call, holding its leased segments) and replaced.
  std::mt19937_64 rng(7);
  struct Victim {
    pid_t pid = -1;
    int out = -1;  // its standard output
    absl::Time dies;
    std::string said;
    bool Ready() {
      char buf[4096];
      for (ssize_t n; (n = read(out, buf, sizeof(buf))) > 0;)
        said.append(buf, n);
      return absl::StrContains(said, "victim ready");
    }
    void Kill() {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      close(out);
      pid = -1;
    }
  };
  int victim_count = 2;
  if (const char* env = std::getenv("PACKD_SOAK_VICTIMS")) {
    absl::SimpleAtoi(env, &victim_count);
  }
  std::vector<Victim> victims;
  int killed = 0;
  auto next_victim = [&] {
    Victim v;
    v.pid = SpawnVictim(server->address(), &v.out);
    v.dies = absl::Now() + absl::Milliseconds(1000 + rng() % 2000);
    return v;
  };
  for (int i = 0; i < victim_count; ++i) victims.push_back(next_victim());
  // Health throughout, and memory after warm-up (the first half of the run: the
  // server's buffer caches fill up with the sizes it meets).
  int64_t rss_warm = 0, rss_peak_after = 0;
  bool always_serving = true;
  absl::Time next_check = absl::Now();
  while (absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(50));
    for (Victim& v : victims) {
      int status = 0;
      if (waitpid(v.pid, &status, WNOHANG) == v.pid) {
        ADD_FAILURE() << "a victim client exited by itself, status " << status
                      << "; it said:\n"
                      << v.said;
        close(v.out);
        v = next_victim();
      } else if (v.Ready() && absl::Now() >= v.dies) {
        v.Kill();
        ++killed;
        if (absl::Now() + absl::Seconds(1) < until) v = next_victim();
      }
    }
    victims.erase(std::remove_if(victims.begin(), victims.end(),
                                 [](const Victim& v) { return v.pid < 0; }),
                  victims.end());
    if (absl::Now() < next_check) continue;
    next_check = absl::Now() + absl::Milliseconds(500);
    always_serving &=
        testing::HealthStatus(server->Channel(), "packd.v1.PackService") ==
        "SERVING";
    const int64_t rss = Rss(pid);
    if (absl::Now() - start < absl::Seconds(seconds) / 2) {
      rss_warm = std::max(rss_warm, rss);
    } else {
      rss_peak_after = std::max(rss_peak_after, rss);
    }
  }
  for (std::thread& t : clients) t.join();
  for (Victim& v : victims) {
    const absl::Time limit = absl::Now() + absl::Seconds(20);
    while (!v.Ready() && absl::Now() < limit) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    v.Kill();
    ++killed;
  }
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);

  std::sort(tally.ms.begin(), tally.ms.end());
  const size_t n = tally.ms.size();
  std::printf(
      "soak: %zu calls in %.1f s (%.0f calls/s), p50 %.2f ms, p99 %.2f "
      "ms; server RssAnon %.1f MiB after warm-up, %.1f MiB peak after\n",
      n, elapsed, n / elapsed, n ? tally.ms[n / 2] : 0.0,
      n ? tally.ms[std::min(n - 1, n * 99 / 100)] : 0.0, rss_warm / 1048576.0,
      rss_peak_after / 1048576.0);
  std::printf("  %-40s %8d\n", "client processes killed (SIGKILL)", killed);
  for (const auto& [what, count] : tally.codes) {
    std::printf("  %-40s %8lld\n", what.c_str(), static_cast<long long>(count));
  }
  for (const std::string& f : tally.failures)
    std::printf("  failure: %s\n", f.c_str());

  EXPECT_EQ(tally.unexpected, 0);
  EXPECT_TRUE(always_serving);
  EXPECT_GT(n, 100u);
  // Under AddressSanitizer the server's memory holds ASan's quarantine of
  // freed blocks, which keeps filling, and ThreadSanitizer's history grows
  // too: the figure is printed, not judged.
  // The server keeps freed heap mapped (--keep_freed_memory), so its anonymous
  // memory is a high-water mark of concurrent calls' buffers, which still
  // creeps up after warm-up on a short run as rarer coincidences of large
  // calls occur (seen: +8 to +11% on a 30 s run, flat after ~25 s): 10% and
  // 8 MiB of slack. A leak grows with calls, and fails this within minutes.
  if (std::getenv("ASAN_OPTIONS") == nullptr &&
      std::getenv("TSAN_OPTIONS") == nullptr) {
    EXPECT_LT(rss_peak_after, rss_warm + rss_warm / 10 + (int64_t{8} << 20))
        << "server memory grew by more than 10% after warm-up";
  }
  EXPECT_GE(killed, victim_count);
  // Every client is gone: the live ones unregistered their segments, the
  // killed ones' leases run out; nothing is left mapped, open or linked.
  const absl::Time settle =
      absl::Now() + absl::Seconds(kVictimLeaseSeconds + 10);
  while (absl::Now() < settle &&
         (CountEntries(fd_dir) > fds_before || regions() > 0 ||
          CountMappings(pid, "/packd_soak") != maps_before ||
          CountEntries("/dev/shm", "packd_soak") != shm_before)) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(server->Alive()) << "packd died during the soak";
  EXPECT_EQ(regions(), 0);
  EXPECT_LE(CountEntries(fd_dir), fds_before);
  EXPECT_EQ(CountMappings(pid, "/packd_soak"), maps_before);
  EXPECT_EQ(CountEntries("/dev/shm", "packd_soak"), shm_before);
}

TEST(Soak, EightClientsWithFaultsOverAUnixSocket) { Soak(""); }

TEST(Soak, EightClientsWithFaultsOverTcpLoopback) {
  Soak(absl::StrCat("127.0.0.1:", testing::UnusedPort()));
}

}  // namespace
}  // namespace packd