// packd::Connection: the part of the C++ client that has no tensors in it —
// the channels to packd (address, TLS, bearer token, load-balancing policy),
// per-call deadlines with retry on UNAVAILABLE, the raw Pack and Scatter calls
// whose inline bytes are sent and received in place (proto/wire.h), and the
// small RPCs (info, health, plans, region registration). packd::Client
// (client.h) puts libtorch tensors on top of it; packctl uses it directly, so
// the tool runs where libtorch is not installed (the server image).
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto connection, Connection::Open({.address = "127.0.0.1:50051"}));
//   PACKD_ASSIGN_OR_RETURN(std::string status, connection->Health());
// clang-format on
#ifndef PACKD_CLIENT_CONNECTION_H_
#define PACKD_CLIENT_CONNECTION_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/client_interceptor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/shm_mapping.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "proto/wire.h"

namespace packd {

class DeviceMemory;  // client/device_memory.h

struct ClientOptions {
  // "HOST:PORT", "unix:PATH", or "dns:///NAME:PORT" for a headless Kubernetes
  // Service (every pod's address; calls spread over them).
  std::string address = "127.0.0.1:50051";
  // gRPC's load-balancing policy; empty: round_robin for dns:/// addresses
  // (one connection to each address the name resolves to, calls spread over
  // them), gRPC's pick_first otherwise.
  std::string load_balancing_policy;
  // Largest message this client sends or receives (match the server's
  // --max_message_bytes).
  int64_t max_message_bytes = int64_t{1} << 30;
  // Deadline of each call: all of its attempts together end by then.
  absl::Duration deadline = absl::Seconds(60);
  // Attempts per call while the server answers UNAVAILABLE (draining,
  // restarting) or a server going away cancels the call, with exponential
  // backoff from initial_backoff up to max_backoff between them (the
  // channels reconnect on the same schedule): about 5 s in all by default,
  // what a restarted packd needs to answer again. No attempt starts past the
  // call's deadline.
  int max_attempts = 8;
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  // Calls whose tensors hold at least this many bytes go through shared memory
  // when the server allows it (GetServerInfo.shared_memory_enabled); 0 disables
  // the automatic path.
  int64_t shared_memory_threshold_bytes = int64_t{4} << 20;
  // The server's --shm_key_prefix: segments this client creates are named under
  // it.
  std::string shm_key_prefix = "/packd";
  // Regions this client registers (its segments, device memory) are leased:
  // the server unregisters one no call has named for this long, so a killed
  // process leaks nothing for longer. The client registers a region again,
  // transparently, when a call finds it gone (an idle spell, a restarted
  // server). 0: no lease.
  uint32_t lease_seconds = 30;
  // Inline calls whose tensors hold at least this many bytes are split by rows
  // into one part per connection, the parts running at once (a single
  // connection leaves the wire idle while the server works); 0 never splits.
  int64_t split_threshold_bytes = int64_t{16} << 20;
  // Connections to the server (at least 1): the parts of a split call run on
  // them at once.
  int connections = 2;
  // Shared-memory segments kept for later calls once idle: each call in
  // flight has its own, so a client shared by threads holds one per call at
  // once and keeps this many after.
  int idle_scratch_segments = 4;
  // Keep memory freed by finished calls mapped for the next ones: tunes this
  // process's malloc (KeepFreedMemoryMapped, base/buffer.h), which
  // makes large inline calls several times faster; the process then keeps up
  // to 1 GiB of freed heap.
  bool keep_freed_memory = true;
  // A bearer token for servers started with --auth_token_file, sent as
  // "authorization: Bearer <token>" on every call: the first line of
  // `token_file` when set, else the environment variable `token_env` when set
  // (never a command-line value, which `ps` would show).
  std::string token_file;
  std::string token_env = "PACKD_TOKEN";
  // TLS (for a server with --tls_cert_file): the PEM CA certificates that
  // signed the server's certificate; empty: plaintext. With mutual TLS, the
  // client's PEM certificate chain and key too.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // The name the server's certificate must carry, when it is not the
  // address's host (for unix sockets: "localhost").
  std::string tls_server_name;
  // gRPC client interceptors for every connection (tracing, fault injection
  // in tests): called once per connection for its factories.
  std::function<std::vector<
      std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>()>
      interceptors;
  // Where GPU tensors live (client/device_memory.h): calls whose tensors are
  // on one GPU keep them there. Null: MakeCudaDeviceMemory(), libtorch's CUDA
  // tensors when the client is built with CUDA.
  std::shared_ptr<DeviceMemory> device_memory;
};

// The methods RawCall serves.
inline constexpr char kPackMethod[] = "/packd.v1.PackService/Pack";
inline constexpr char kScatterMethod[] = "/packd.v1.PackService/Scatter";
// The method RawStream serves.
inline constexpr char kPackMicroBatchesMethod[] =
    "/packd.v1.PackService/PackMicroBatches";

// The streaming step's methods (docs/design.md §18).
inline constexpr char kSubmitGroupMethod[] =
    "/packd.v1.PackService/SubmitGroup";
inline constexpr char kReceiveStepMethod[] =
    "/packd.v1.PackService/ReceiveStep";

// How long a call may take: all its attempts together, and each one.
struct CallTimes {
  // The call's deadline; zero: the connection's (ClientOptions::deadline).
  absl::Duration total = absl::ZeroDuration();
  // Each attempt's own deadline; an attempt whose own deadline passed before
  // the call's is retried too (for calls packd takes once however often they
  // come: SubmitGroup with its group key). Infinite: the call's.
  absl::Duration attempt = absl::InfiniteDuration();
};

// Safe to share across threads, as gRPC channels are: calls from many threads
// at once each have their own context, deadline and reply.
class Connection {
 public:
  // Connects (lazily: the first call dials). INVALID_ARGUMENT for an empty
  // address or TLS files given without their partner; FAILED_PRECONDITION
  // when `token_file` or a TLS file cannot be read or is empty.
  static absl::StatusOr<std::unique_ptr<Connection>> Open(
      ClientOptions options);

  // Runs `rpc(context)` with the token, retrying on UNAVAILABLE and CANCELLED
  // (see max_attempts), every attempt within the one deadline of the call;
  // the last attempt's status.
  // `may_retry`, when given, says whether an attempt that failed so may be
  // made again (a stream that delivered messages may not).
  absl::Status Call(
      const std::function<grpc::Status(grpc::ClientContext*)>& rpc,
      const std::function<bool()>& may_retry = nullptr, CallTimes times = {});

  // Calls `method` (kPackMethod, kScatterMethod) on connection `connection`
  // (taken modulo connections(): parts of a call run at once on different
  // ones) with `request`, whose payloads are sent in place. Receives the
  // reply into `response`, its inline bytes left in place in the received
  // slices it then holds (INTERNAL when it does not parse).
  absl::Status RawCall(int connection, const char* method,
                       const WireMessage& request, WireMessage* response,
                       CallTimes times = {});

  // Calls server-streaming `method` (kPackMicroBatchesMethod) with `request`,
  // sent in place, and gives each message to `on_message` as it arrives, in
  // order. Retried as Call retries until the first message arrives, never
  // after. A failure of `on_message` cancels the call and is returned.
  absl::Status RawStream(
      const char* method, const WireMessage& request,
      const std::function<absl::Status(const grpc::ByteBuffer&)>& on_message,
      CallTimes times = {});

  absl::StatusOr<v1::ServerInfo> Info();
  // grpc.health.v1 status of `service` ("" liveness, "packd.v1.PackService"
  // readiness): "SERVING", "NOT_SERVING", ...
  absl::StatusOr<std::string> Health(
      const std::string& service = "packd.v1.PackService");
  // The micro-batch plan of `request` (docs/design.md §9).
  absl::StatusOr<v1::PlanResponse> Plan(const v1::PlanRequest& request);
  // A fresh name for a shared-memory segment of this process: its key,
  // "<prefix>_<tag>_<pid>_<random>_<n>" (ShmMapping::UniqueKey), and the
  // region it is registered as, "<tag>-<pid>_<random>_<n>", unique like the
  // key (across pid namespaces too). The prefix is the one the server gives
  // this caller (ServerInfo.shm_key_prefix: its tenant's, asked once), else
  // options().shm_key_prefix.
  struct SegmentName {
    std::string key;
    std::string region;
  };
  SegmentName NewSegmentName(absl::string_view tag);
  // Registers `segment` as region `region`, leased for
  // options().lease_seconds, and unlinks its name: the server has mapped it,
  // so nothing is left in /dev/shm however this process ends.
  absl::Status RegisterSegment(ShmMapping& segment, const std::string& region);
  // Unregisters region `name` (NOT_FOUND when the server holds none).
  absl::Status UnregisterRegion(const std::string& name);

  // The load-balancing policy the channels use ("round_robin", "pick_first"),
  // once they have connected.
  std::string LoadBalancingPolicy() const;
  const ClientOptions& options() const { return options_; }
  // How many connections there are (options().connections, at least 1).
  int connections() const { return static_cast<int>(channels_.size()); }
  v1::PackService::Stub& stub() { return *stub_; }

 private:
  Connection(ClientOptions options, std::string token,
             const std::shared_ptr<grpc::ChannelCredentials>& credentials);

  const ClientOptions options_;
  const std::string token_;  // empty: none
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<grpc::GenericStub>> generic_;
  std::unique_ptr<v1::PackService::Stub> stub_;  // on channels_[0]
  absl::Mutex mu_;
  // The server's key prefix for this caller, once asked.
  std::optional<std::string> key_prefix_ ABSL_GUARDED_BY(mu_);
};

}  // namespace packd

#endif  // PACKD_CLIENT_CONNECTION_H_
