// packd: the PackService gRPC server.
//
//   packd --listen=127.0.0.1:50051 --device=cpu
//   packd --listen=unix:/run/packd/packd.sock --threads=8
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "server/flags.h"
#include "server/log.h"
#include "server/server.h"

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "packd: packs padded [B, S, *tail] batches into [total_active, *tail] "
      "over gRPC (packd.v1.PackService)");
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<packd::ServerOptions> options = packd::OptionsFromFlags();
  if (!options.ok()) {
    packd::Log(options.status().ToString());
    return 2;
  }
  return packd::ServeUntilSignalled(*options);
}
