// packd_testing: the packd server with the hooks tests inject through
// ServiceOptions, for the end-to-end tests that must hold a call in flight.
// It takes every flag of packd, plus:
//
//   packd_testing --call_delay_ms=1500 ...  # each Pack/Scatter waits 1.5 s
//                                           # once its tensors are decoded
//   packd_testing --call_throws ...         # ... or throws there
#include <atomic>
#include <memory>
#include <stdexcept>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "server/flags.h"
#include "server/log.h"
#include "server/server.h"

ABSL_FLAG(int, call_delay_ms, 0,
          "Each Pack and Scatter call waits this long once its tensors are "
          "decoded");
ABSL_FLAG(bool, call_throws, false,
          "Each Pack and Scatter call throws std::runtime_error once its "
          "tensors are decoded");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
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
    options->service.testing_call_hook = [delay, throws,
                                          calls](absl::string_view) {
      absl::SleepFor(delay);
      if (throws && (*calls)++ > 0) {
        throw std::runtime_error("injected by --call_throws");
      }
    };
  }
  return packd::ServeUntilSignalled(*options);
}
