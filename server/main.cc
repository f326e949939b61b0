// packd: the PackService gRPC server.
//
//   packd --listen=127.0.0.1:50051 --device=cpu
//   packd --listen=unix:/run/packd/packd.sock --threads=8
#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "server/flags.h"
#include "server/log.h"
#include "server/server.h"

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "packs padded [B, S, *tail] batches into [total_active, *tail] "
      "over gRPC (packd.v1.PackService)\n\n"
      "usage: packd [flags]   (docs/service.md describes every flag)");
  // --help lists the server's flags, under its name rather than the path of
  // the machine that built it.
  absl::FlagsUsageConfig config;
  // absl filters on the normalized name.
  config.normalize_filename = [](absl::string_view file) {
    return absl::EndsWith(file, "server/flags.cc") ? std::string("packd")
                                                   : std::string(file);
  };
  config.contains_help_flags = [](absl::string_view file) {
    return file == "packd";
  };
  absl::SetFlagsUsageConfig(config);
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<packd::ServerOptions> options = packd::OptionsFromFlags();
  if (!options.ok()) {
    packd::Log(packd::LogLevel::kError, options.status().ToString());
    return 2;
  }
  return packd::ServeUntilSignalled(*options);
}
