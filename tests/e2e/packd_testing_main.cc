// packd_testing: the packd server with the hooks tests inject through
// ServiceOptions, for the end-to-end tests that must hold a call in flight.
// It takes every flag of packd, plus:
//
//   packd_testing --call_delay_ms=1500 ...  # each Pack/Scatter waits 1.5 s
//                                           # once its tensors are decoded
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "server/flags.h"
#include "server/log.h"
#include "server/server.h"

ABSL_FLAG(int, call_delay_ms, 0,
          "Each Pack and Scatter call waits this long once its tensors are "
          "decoded");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<packd::ServerOptions> options = packd::OptionsFromFlags();
  if (!options.ok()) {
    packd::Log(options.status().ToString());
    return 2;
  }
  const absl::Duration delay =
      absl::Milliseconds(absl::GetFlag(FLAGS_call_delay_ms));
  if (delay > absl::ZeroDuration()) {
    options->service.testing_call_hook = [delay](absl::string_view) {
      absl::SleepFor(delay);
    };
  }
  return packd::ServeUntilSignalled(*options);
}
