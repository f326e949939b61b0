// PackdServer: the packd process's gRPC server — PackService, health,
// reflection — and its lifecycle: start-up self-check before readiness, drain
// on shutdown.
//
//   PACKD_ASSIGN_OR_RETURN(auto server, PackdServer::Start(options));
//   server->Drain();  // from the signal thread; Wait() then returns
//   return ServeUntilSignalled(options);  // all of it, as the binary runs it
#ifndef PACKD_SERVER_SERVER_H_
#define PACKD_SERVER_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "server/metrics_server.h"
#include "server/pack_service.h"
#include "server/unix_listener.h"

namespace packd {

// Transport security of the main listener (PEM text, not paths).
struct TlsOptions {
  std::string cert_chain;  // empty: plaintext
  std::string private_key;
  // When set, clients must present a certificate this CA signed (mutual TLS).
  std::string client_ca;
};

struct ServerOptions {
  // "HOST:PORT" (port 0 picks a free one) or "unix:PATH".
  std::string listen = "127.0.0.1:50051";
  TlsOptions tls;
  // A second, plaintext listener that serves only grpc.health.v1 (for kubelet
  // probes when the main listener speaks TLS); empty: none.
  std::string health_listen;
  ServiceOptions service;
  // Tokens and worker threads; PackdServer sets peer_uid itself.
  RpcOptions rpc;
  // "HOST:PORT" where rollout workers and trainer ranks reach this replica for
  // a streaming step it holds (a pod's own address behind a headless
  // Service); empty: the address it listens on.
  std::string advertise_address;
  absl::Duration drain = absl::Seconds(30);
  // "HOST:PORT" for Prometheus metrics at /metrics; empty: none.
  std::string metrics_listen;
  // Keep memory freed by finished calls mapped for the next ones
  // (KeepFreedMemoryMapped, base/buffer.h) instead of returning it to
  // the system.
  bool keep_freed_memory = true;
};

// The readiness service name for grpc.health.v1.
inline constexpr char kReadinessService[] = "packd.v1.PackService";

// Start and Wait from one thread, Drain once from any (the signal thread);
// address() and the other accessors from any thread once Start has returned.
class PackdServer {
 public:
  // Checks the default device, listens, runs a self-check pack on the default
  // device, then reports SERVING. FAILED_PRECONDITION when the device is not
  // available; UNAVAILABLE when the address cannot be bound; INTERNAL when the
  // self-check fails.
  static absl::StatusOr<std::unique_ptr<PackdServer>> Start(
      const ServerOptions& options);

  // The address actually bound ("127.0.0.1:43123", "unix:/run/packd.sock").
  const std::string& address() const { return address_; }
  // The health-only listener bound, or empty.
  const std::string& health_address() const { return health_address_; }
  // The metrics endpoint bound ("127.0.0.1:9090"), or empty.
  std::string metrics_address() const {
    return metrics_ != nullptr ? metrics_->address() : "";
  }

  // Readiness NOT_SERVING, new calls UNAVAILABLE, calls in flight finish within
  // the drain time, then the server shuts down and Wait() returns. Call it
  // once.
  void Drain();

  // Blocks until the server has shut down.
  void Wait();

 private:
  explicit PackdServer(const ServerOptions& options);
  // Readiness NOT_SERVING for good: the default device is lost.
  void OnDeviceLost(const absl::Status& reason);
  // Readiness on every listener.
  void SetReady(bool ready);

  const ServerOptions options_;
  PackServiceImpl service_;
  std::unique_ptr<grpc::Server> server_;
  // packd's own listener on a plaintext unix socket (its peers' uids name
  // their tenants); after server_: it stops accepting first.
  std::unique_ptr<UnixListener> unix_;
  // What the health-only listener answers, and the listener (which goes
  // first).
  std::unique_ptr<grpc::health::v1::Health::CallbackService> health_service_;
  std::unique_ptr<grpc::Server> health_server_;
  std::unique_ptr<MetricsServer> metrics_;
  std::string address_;
  std::string health_address_;
  std::atomic<bool> ready_{false};
};

// The life of the packd process: blocks SIGTERM and SIGINT in every thread,
// starts the server (logging where it listens), drains on the first signal,
// and returns the exit code: 0 after a drain, 1 when the server cannot start.
int ServeUntilSignalled(const ServerOptions& options);

}  // namespace packd

#endif  // PACKD_SERVER_SERVER_H_
