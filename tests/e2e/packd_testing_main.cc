// packd_testing: the packd server with the hooks tests inject through
// ServiceOptions, for the end-to-end tests that must hold a call in flight.
// It takes every flag of packd, plus:
//
//   packd_testing --call_delay_ms=1500 ...  # each Pack/Scatter waits 1.5 s
//                                           # once its tensors are decoded
//   packd_testing --call_throws ...         # ... or throws there
//   packd_testing --fake_gpu_devices=2 --fake_gpu_physical=1,0 ...
//       # cuda is the fake GPU of tests/fake_gpu (memfd device memory that
//       # other processes export to it), index 0 being physical device 1
//   packd_testing --cpu_impl=torch ...      # cpu calls run on the libtorch
//                                           # backend instead of "span"
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kernels/gpu/gpu_backend.h"
#include "kernels/registry.h"
#include "server/flags.h"
#include "server/log.h"
#include "server/server.h"
#include "tests/fake_gpu/fake_gpu_runtime.h"

ABSL_FLAG(int, call_delay_ms, 0,
          "Each Pack and Scatter call waits this long once its tensors are "
          "decoded");
ABSL_FLAG(std::string, call_delay_methods, "",
          "With --call_delay_ms: the methods that wait (comma-separated, e.g. "
          "PackMicroBatches); empty: every one");
ABSL_FLAG(bool, unblocked_thread, false,
          "Start a thread before the server, with no signal blocked, as "
          "libraries do at load time (OpenBLAS's pool): a SIGTERM may be "
          "delivered to it");
ABSL_FLAG(bool, call_throws, false,
          "Each Pack and Scatter call throws std::runtime_error once its "
          "tensors are decoded");
ABSL_FLAG(int, fake_gpu_devices, 0,
          "Serve cuda on this many fake GPUs (tests/fake_gpu) instead of the "
          "real runtime; 0: no fake");
ABSL_FLAG(std::string, fake_gpu_physical, "",
          "The physical device of each fake GPU index, comma-separated "
          "(default: index i is physical device i), as CUDA_VISIBLE_DEVICES "
          "reorders them");
ABSL_FLAG(int, fake_gpu_memory_mb, 1024, "Memory of each fake GPU");
ABSL_FLAG(std::string, cpu_impl, "",
          "The backend cpu calls run on (\"span\", \"torch\"); empty: the "
          "default");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (const int devices = absl::GetFlag(FLAGS_fake_gpu_devices); devices > 0) {
    fakegpu::testing::Config config;
    config.devices = devices;
    config.memory_bytes = size_t(absl::GetFlag(FLAGS_fake_gpu_memory_mb)) << 20;
    for (absl::string_view p : absl::StrSplit(
             absl::GetFlag(FLAGS_fake_gpu_physical), ',', absl::SkipEmpty())) {
      int physical = 0;
      if (!absl::SimpleAtoi(p, &physical) || physical < 0) {
        packd::Log(absl::StrCat("--fake_gpu_physical: \"", p,
                                "\" is not a device number"));
        return 2;
      }
      config.physical.push_back(physical);
    }
    fakegpu::testing::Configure(config);
    packd::fake_gpu::RegisterGpuBackends(packd::Registry::Global());
  }
  if (const std::string impl = absl::GetFlag(FLAGS_cpu_impl); !impl.empty()) {
    if (absl::Status made = packd::Registry::Global().MakeDefault(
            packd::DeviceKind::kCpu, impl);
        !made.ok()) {
      packd::Log(absl::StrCat("--cpu_impl: ", made.message()));
      return 2;
    }
  }
  absl::StatusOr<packd::ServerOptions> options = packd::OptionsFromFlags();
  if (!options.ok()) {
    packd::Log(options.status().ToString());
    return 2;
  }
  const absl::Duration delay =
      absl::Milliseconds(absl::GetFlag(FLAGS_call_delay_ms));
  const bool throws = absl::GetFlag(FLAGS_call_throws);
  if (delay > absl::ZeroDuration() || throws) {
    // The first call is packd's own start-up self-check: it is let through.
    auto calls = std::make_shared<std::atomic<int>>(0);
    const std::vector<std::string> delayed = absl::StrSplit(
        absl::GetFlag(FLAGS_call_delay_methods), ',', absl::SkipEmpty());
    options->service.TEST_call_hook = [delay, throws, calls,
                                       delayed](absl::string_view method) {
      if (delayed.empty() ||
          std::find(delayed.begin(), delayed.end(), method) != delayed.end()) {
        absl::SleepFor(delay);
      }
      if (throws && (*calls)++ > 0) {
        throw std::runtime_error("injected by --call_throws");
      }
    };
  }
  if (absl::GetFlag(FLAGS_unblocked_thread)) {
    std::thread([] {
      for (;;) pause();  // returns after each signal handler it runs
    }).detach();
  }
  return packd::ServeUntilSignalled(*options);
}
