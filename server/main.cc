// packd: the PackService gRPC server.
//
//   packd --listen=127.0.0.1:50051 --device=cpu
//   packd --listen=unix:/run/packd/packd.sock --threads=8
#include <pthread.h>
#include <signal.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kernels/thread_pool.h"
#include "server/log.h"
#include "server/server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "Address to serve on: HOST:PORT (port 0 picks a free port) or "
          "unix:PATH");
ABSL_FLAG(std::string, device, "cpu",
          "Default device for requests that name none: cpu, cuda:N or hip:N");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{1} << 30,
          "Largest request or response in bytes; larger ones get "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int, threads, 0,
          "CPU threads that split large copies (0: all hardware threads)");
ABSL_FLAG(int, drain_seconds, 30,
          "On SIGTERM, how long calls in flight may take to finish");
ABSL_FLAG(std::string, shared_memory, "auto",
          "Tensor handles (shared-memory regions): on, off, or auto (on only "
          "for loopback and unix-socket listeners)");
ABSL_FLAG(std::string, shm_key_prefix, "/packd",
          "Every shared-memory key a client registers must start with this");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT to serve Prometheus metrics on at /metrics (port 0 picks "
          "one); empty: no metrics endpoint");
ABSL_FLAG(int, testonly_call_delay_ms, 0,
          "For tests only: delay every Pack and Scatter call by this long");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "packd: packs padded [B, S, *tail] batches into [total_active, *tail] "
      "over gRPC (packd.v1.PackService)");
  absl::ParseCommandLine(argc, argv);

  // Block the shutdown signals in every thread (gRPC's included); one thread
  // waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  packd::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  absl::StatusOr<packd::Device> device =
      packd::ParseDevice(absl::GetFlag(FLAGS_device), "--device");
  if (!device.ok()) {
    packd::Log(device.status().ToString());
    return 2;
  }
  options.service.default_device = *device;
  options.service.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (options.service.max_message_bytes <= 0) {
    packd::Log("--max_message_bytes must be positive");
    return 2;
  }
  const std::string shm = absl::GetFlag(FLAGS_shared_memory);
  if (shm == "on") {
    options.service.regions.enabled = true;
  } else if (shm == "auto") {
    options.service.regions.enabled = packd::IsNodeLocal(options.listen);
  } else if (shm != "off") {
    packd::Log(
        absl::StrCat("--shared_memory=", shm, " must be auto, on or off"));
    return 2;
  }
  options.service.regions.key_prefix = absl::GetFlag(FLAGS_shm_key_prefix);
  options.service.testonly_call_delay =
      absl::Milliseconds(absl::GetFlag(FLAGS_testonly_call_delay_ms));
  options.drain = absl::Seconds(absl::GetFlag(FLAGS_drain_seconds));
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (absl::GetFlag(FLAGS_threads) > 0) {
    packd::ThreadPool::SetGlobalThreads(absl::GetFlag(FLAGS_threads));
  }

  auto server = packd::PackdServer::Start(options);
  if (!server.ok()) {
    packd::Log(absl::StrCat("cannot start: ", server.status().ToString()));
    return 1;
  }
  packd::Log(absl::StrCat(
      "listening on ", (*server)->address(), ", device ", device->ToString(),
      ", ", packd::ThreadPool::Global().num_threads(),
      " threads, messages up to ", options.service.max_message_bytes,
      " bytes, shared memory ",
      options.service.regions.enabled
          ? absl::StrCat("on (keys under ", options.service.regions.key_prefix,
                         ")")
          : "off",
      (*server)->metrics_address().empty()
          ? ""
          : absl::StrCat(", metrics on http://", (*server)->metrics_address(),
                         "/metrics")));

  std::thread signal_thread([&] {
    int signal = 0;
    sigwait(&signals, &signal);
    packd::Log(absl::StrCat("received ", strsignal(signal)));
    (*server)->Drain();
  });
  (*server)->Wait();
  signal_thread.join();
  packd::Log("stopped");
  return 0;
}
