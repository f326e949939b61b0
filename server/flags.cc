#include "server/flags.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/thread_pool.h"
#include "proto/address.h"
#include "server/log.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "Address to serve on: HOST:PORT (port 0 picks a free port) or "
          "unix:PATH");
ABSL_FLAG(std::string, device, "cpu",
          "Default device for requests that name none: cpu, cuda:N or hip:N");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{1} << 30,
          "Largest request or response in bytes; larger ones get "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int, threads, 0,
          "Worker threads every call runs on, and CPU threads that split "
          "large copies (0: all hardware threads)");
ABSL_FLAG(int, drain_seconds, 30,
          "On SIGTERM, how long calls in flight may take to finish");
ABSL_FLAG(std::string, shared_memory, "auto",
          "Tensor handles (shared-memory regions): on, off, or auto (on only "
          "for loopback and unix-socket listeners)");
ABSL_FLAG(std::string, shm_key_prefix, "/packd",
          "Every shared-memory key a client registers must start with this "
          "(then, for a named tenant, its name and a dot: GetServerInfo "
          "tells each caller its prefix)");
ABSL_FLAG(int64_t, max_regions_per_tenant, 4096,
          "The most regions one tenant (a token's name, a client "
          "certificate, a unix-socket peer's uid) may hold at once; 0: no "
          "bound");
ABSL_FLAG(
    std::string, advertise_address, "",
    "HOST:PORT where rollout workers and trainer ranks reach this replica "
    "for a streaming step it holds (in Kubernetes: $(POD_IP):50051); "
    "empty: the --listen address");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT to serve Prometheus metrics on at /metrics (port 0 picks "
          "one); empty: no metrics endpoint");
ABSL_FLAG(bool, keep_freed_memory, true,
          "Keep memory freed by finished calls mapped for the next ones "
          "(faster inline calls; the process keeps up to 1 GiB it no longer "
          "uses)");
ABSL_FLAG(int64_t, max_inflight_bytes, -1,
          "Bound on the request and result bytes of inline calls in flight; "
          "calls over it wait until their deadline (-1: half the memory the "
          "process may use, cgroup limit included; 0: no bound)");
ABSL_FLAG(int64_t, max_inflight_bytes_per_tenant, -1,
          "The most of --max_inflight_bytes one tenant's calls may hold; a "
          "call its tenant has no room for waits without holding up other "
          "tenants' calls (-1: the whole budget)");
ABSL_FLAG(std::string, auth_token_file, "",
          "File of bearer tokens, one a line (re-read on SIGHUP): every "
          "PackService call must send \"authorization: Bearer <token>\" "
          "with one of them (health never needs it); empty: no tokens");

ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain: serve TLS on --listen (with --tls_key_file)");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA certificates: with TLS, require client certificates they "
          "signed (mutual TLS)");
ABSL_FLAG(std::string, log_format, "text",
          "Log lines as text, or as json for log collectors (one object a "
          "line: time, level, message, fields)");
ABSL_FLAG(std::string, health_listen, "",
          "A second, plaintext address that serves only grpc.health.v1 (for "
          "kubelet probes when --listen speaks TLS); empty: none");

namespace packd {
namespace {

// The contents of `path`, named by `flag` in errors.
absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot read ", flag, "=", path, ": ", std::strerror(errno)));
  }
  std::string text((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  if (text.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "=", path, ": not a PEM file (no -----BEGIN line)"));
  }
  return text;
}

absl::StatusOr<TlsOptions> TlsFromFlags() {
  TlsOptions tls;
  const std::string cert = absl::GetFlag(FLAGS_tls_cert_file);
  const std::string key = absl::GetFlag(FLAGS_tls_key_file);
  const std::string ca = absl::GetFlag(FLAGS_tls_client_ca_file);
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert_file and --tls_key_file go together");
  }
  if (!ca.empty() && cert.empty()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca_file needs TLS: give --tls_cert_file and "
        "--tls_key_file too");
  }
  if (cert.empty()) return tls;
  PACKD_ASSIGN_OR_RETURN(tls.cert_chain, ReadPem(cert, "--tls_cert_file"));
  PACKD_ASSIGN_OR_RETURN(tls.private_key, ReadPem(key, "--tls_key_file"));
  if (!ca.empty()) {
    PACKD_ASSIGN_OR_RETURN(tls.client_ca, ReadPem(ca, "--tls_client_ca_file"));
  }
  return tls;
}

}  // namespace

absl::StatusOr<ServerOptions> OptionsFromFlags() {
  ServerOptions options;
  // First, so that every later line, an error in the flags below included,
  // is in the format asked for.
  LogFormat log_format = LogFormat::kText;
  PACKD_RETURN_IF_ERROR(
      ParseLogFormat(absl::GetFlag(FLAGS_log_format), &log_format));
  SetLogFormat(log_format);
  options.listen = absl::GetFlag(FLAGS_listen);
  PACKD_ASSIGN_OR_RETURN(options.tls, TlsFromFlags());
  options.health_listen = absl::GetFlag(FLAGS_health_listen);
  PACKD_ASSIGN_OR_RETURN(options.service.default_device,
                         ParseDevice(absl::GetFlag(FLAGS_device), "--device"));
  options.service.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (options.service.max_message_bytes <= 0) {
    return absl::InvalidArgumentError("--max_message_bytes must be positive");
  }
  const std::string shm = absl::GetFlag(FLAGS_shared_memory);
  if (shm == "on" || shm == "auto") {
    options.service.regions.enabled =
        shm == "on" || IsNodeLocal(options.listen);
  } else if (shm != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--shared_memory=", shm, " must be auto, on or off"));
  }
  options.service.regions.key_prefix = absl::GetFlag(FLAGS_shm_key_prefix);
  if (absl::GetFlag(FLAGS_max_regions_per_tenant) < 0) {
    return absl::InvalidArgumentError(
        "--max_regions_per_tenant must be 0 (no bound) or more");
  }
  options.service.regions.max_regions_per_tenant =
      absl::GetFlag(FLAGS_max_regions_per_tenant);
  options.drain = absl::Seconds(absl::GetFlag(FLAGS_drain_seconds));
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  options.keep_freed_memory = absl::GetFlag(FLAGS_keep_freed_memory);
  if (!absl::GetFlag(FLAGS_auth_token_file).empty()) {
    PACKD_ASSIGN_OR_RETURN(
        std::unique_ptr<TokenAuth> auth,
        TokenAuth::FromFile(absl::GetFlag(FLAGS_auth_token_file)));
    options.rpc.auth = std::move(auth);
  }
  const int64_t inflight = absl::GetFlag(FLAGS_max_inflight_bytes);
  if (inflight < -1) {
    return absl::InvalidArgumentError(
        "--max_inflight_bytes must be -1 (automatic), 0 (no bound) or a "
        "number of bytes");
  }
  options.service.max_inflight_bytes =
      inflight == -1 ? MemoryBudget::DefaultLimit() : inflight;
  const int64_t per_tenant = absl::GetFlag(FLAGS_max_inflight_bytes_per_tenant);
  if (per_tenant < -1 || per_tenant == 0) {
    return absl::InvalidArgumentError(
        "--max_inflight_bytes_per_tenant must be -1 (the whole budget) or a "
        "number of bytes");
  }
  options.service.max_inflight_bytes_per_tenant =
      std::max<int64_t>(0, per_tenant);
  if (absl::GetFlag(FLAGS_threads) > 0) {
    ThreadPool::SetGlobalThreads(absl::GetFlag(FLAGS_threads));
  }
  // Not ThreadPool::Global().num_threads(): the pool's threads must start
  // after packd blocks its signals (ServeUntilSignalled).
  options.rpc.worker_threads = std::max(0, absl::GetFlag(FLAGS_threads));
  return options;
}

}  // namespace packd
