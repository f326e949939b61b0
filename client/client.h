// packd::Client: the C++ client of packd.v1.PackService for rollout workers and
// trainers, with libtorch tensors in and out, per-call deadlines, retry with
// backoff on UNAVAILABLE, and shared-memory tensor handles on one node. Inline
// tensors are sent from their own memory and results copied once out of the
// received slices (proto/wire.h).
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto client, Client::Connect({.address = "127.0.0.1:50051"}));
//   PACKD_ASSIGN_OR_RETURN(PackedBatch b, client->Pack({hidden, token_ids}, mask));
// clang-format on
#ifndef PACKD_CLIENT_CLIENT_H_
#define PACKD_CLIENT_CLIENT_H_

#include <ATen/ATen.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/shared_memory.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "proto/wire.h"

namespace packd {

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
  // Deadline of each call.
  absl::Duration deadline = absl::Seconds(60);
  // Attempts per call while the server answers UNAVAILABLE (draining,
  // restarting), with exponential backoff from initial_backoff up to
  // max_backoff between them: about 5 s in all by default, what a restarted
  // packd needs to answer again.
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
  // into two calls on two connections that run at once (a single connection
  // leaves the wire idle while the server works); 0 never splits.
  int64_t split_threshold_bytes = int64_t{16} << 20;
  // Keep memory freed by finished calls mapped for the next ones: tunes this
  // process's malloc (KeepFreedMemoryMapped, kernels/buffer.h), which
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
};

struct PackCallOptions {
  bool with_position_ids = false;
  // cu_seqlens as int32 (what flash-attention and TransformerEngine take)
  // instead of int64.
  bool cu_seqlens_int32 = false;
  // "cpu", "cuda:N", "hip:N"; empty: the server's default.
  std::string device;
  // Documents within rows (DESIGN.md section 8): [B, S] of an integer dtype,
  // or undefined for none. position_ids then restart at every document and
  // the doc_* fields of the result are set.
  at::Tensor segment_ids;
  // When set, results are written into this segment and returned as views of it
  // (read in place, valid until the segment is reset or destroyed) instead of
  // being copied out.
  SharedMemory* results_in = nullptr;
};

// What Pack returns, as the wire contract has it.
struct PackedBatch {
  // packed[i] answers tensors[i]: [total_active, *tail_i].
  std::vector<at::Tensor> packed;
  at::Tensor cu_seqlens;  // [B + 1], int64 (or int32 on request)
  int64_t total_active = 0;
  int64_t max_seqlen = 0;
  at::Tensor position_ids;  // [total_active] int64 when asked, else undefined
  at::Tensor last_index;    // [B] int64, -1 for an empty row
  // With segment_ids (else undefined / 0): doc_cu_seqlens [D + 1] (int64, or
  // int32 like cu_seqlens), doc_row and doc_last_index [D] int64.
  at::Tensor doc_cu_seqlens;
  int64_t doc_max_seqlen = 0;
  at::Tensor doc_row;
  at::Tensor doc_last_index;
};

// The slice of region `region` (registered from an IPC handle of the
// allocation starting at `allocation_base`) that holds the `bytes` bytes at
// `data`: its offset is data - allocation_base, because an IPC handle maps an
// allocation from its start (cuMemGetAddressRange, or PyTorch's storage
// offset, give the base). INVALID_ARGUMENT when data lies before the base.
absl::StatusOr<v1::RegionSlice> DeviceSlice(const std::string& region,
                                            const void* allocation_base,
                                            const void* data, uint64_t bytes);

class Client {
 public:
  // Connects (lazily: the first call dials). INVALID_ARGUMENT for an empty
  // address or TLS files given without their partner; FAILED_PRECONDITION
  // when `token_file` or a TLS file cannot be read or is empty.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options);
  ~Client();

  // Packs every tensor ([B, S, *tail], CPU, any of the ten dtypes) with one
  // scan of `mask`
  // ([B, S]). Errors carry the server's code and message (INVALID_ARGUMENT for
  // shapes, ...); tensors of a dtype packd does not carry are INVALID_ARGUMENT
  // here.
  absl::StatusOr<PackedBatch> Pack(const std::vector<at::Tensor>& tensors,
                                   const at::Tensor& mask,
                                   const PackCallOptions& options = {});

  // The inverse: each packed [total_active, *tail] back to [B, S, *tail], zeros
  // at inactive positions. `tail_shape`, when given, must equal every
  // packed[i].shape[1:].
  absl::StatusOr<std::vector<at::Tensor>> Scatter(
      const std::vector<at::Tensor>& packed, const at::Tensor& mask,
      const std::optional<std::vector<int64_t>>& tail_shape = std::nullopt,
      const std::string& device = "");

  // Registers device memory another library exported as region `name`:
  // `ipc_handle` from cudaIpcGetMemHandle / hipIpcGetMemHandle (64 bytes),
  // which maps the whole allocation from its start, on the server's `device`
  // ("cuda:N"), covering `byte_size` bytes from the allocation's start. Address
  // a tensor in it with DeviceSlice. Errors: the server's (FAILED_PRECONDITION
  // without a GPU; INVALID_ARGUMENT when byte_size passes the allocation or
  // the memory is on another device).
  absl::Status RegisterDeviceMemory(const std::string& name,
                                    const std::string& ipc_handle,
                                    const std::string& device,
                                    uint64_t byte_size);

  // Plans micro-batches over data-parallel ranks (DESIGN.md section 9): each
  // sample of `lengths` in one micro-batch of at most
  // max_tokens_per_micro_batch tokens, every rank with the same count, and
  // global_loss_tokens to divide the summed token loss by. `loss_tokens` is
  // empty or one per sample. Errors: the server's (INVALID_ARGUMENT for bad
  // lengths or options).
  absl::StatusOr<v1::PlanResponse> PlanMicroBatches(
      const std::vector<int64_t>& lengths, int64_t max_tokens_per_micro_batch,
      int32_t num_ranks = 1, int32_t micro_batch_multiple = 1,
      const std::vector<int64_t>& loss_tokens = {});

  absl::StatusOr<v1::ServerInfo> Info();
  // The load-balancing policy the channels use ("round_robin", "pick_first"),
  // once they have connected.
  std::string LoadBalancingPolicy() const;
  // grpc.health.v1 status of `service` ("" liveness, "packd.v1.PackService"
  // readiness): "SERVING", "NOT_SERVING", ...
  absl::StatusOr<std::string> Health(
      const std::string& service = "packd.v1.PackService");

  // Creates a shared-memory segment of `bytes`, registers it with the server,
  // and returns it: tensors allocated from it travel as handles, without a
  // copy. FAILED_PRECONDITION when the server has shared memory off. Its name
  // is removed from /dev/shm once the server has mapped it: the memory goes
  // when both this process and the server's lease let go.
  absl::StatusOr<std::unique_ptr<SharedMemory>> CreateSharedMemory(
      int64_t bytes);

  const ClientOptions& options() const { return options_; }
  v1::PackService::Stub& stub() { return *stub_; }

 private:
  // A request on its way: the inline tensors' bytes, in place, and the
  // tensors that own them.
  struct Outgoing {
    Payloads payloads;
    std::shared_ptr<std::vector<at::Tensor>> keep =
        std::make_shared<std::vector<at::Tensor>>();
  };
  // A reply: its inline tensors' bytes in the received slices.
  struct Incoming {
    std::vector<grpc::Slice> slices;
    Payloads payloads;
  };
  struct PackPart;

  Client(ClientOptions options,
         std::shared_ptr<grpc::ChannelCredentials> credentials);

  // Runs `rpc(context)` with the deadline, retrying on UNAVAILABLE.
  template <typename Rpc>
  absl::Status Call(Rpc&& rpc);
  // Calls `method` ("/packd.v1.PackService/Pack") on connection `connection`
  // with `request` and its inline bytes, without copying them; parses the
  // reply into `response` with its inline bytes in place (INTERNAL when it
  // does not parse).
  absl::Status RawCall(int connection, const std::string& method,
                       const google::protobuf::Message& request,
                       const Outgoing& outgoing,
                       google::protobuf::Message* response, Incoming* incoming);
  // One Pack call over rows of the batch, on `connection`.
  absl::StatusOr<PackPart> PackRows(const std::vector<at::Tensor>& tensors,
                                    const at::Tensor& mask,
                                    const at::Tensor& segment_ids,
                                    const PackCallOptions& options,
                                    SharedMemory* scratch, int connection);
  // Registers `segment` (named anew when unlinked) and unlinks its name.
  absl::Status RegisterSegment(SharedMemory& segment)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers again the segments and device memory of this client that the
  // server does not hold (a lease ran out, the server restarted); how many.
  absl::StatusOr<int> Reregister();
  // Whether a call of `bytes` with inline tensors is split into two.
  bool Splits(int64_t bytes, SharedMemory* scratch) const;
  // Whether this call's tensors should travel through shared memory; sets up
  // the scratch segment of at least `bytes`.
  absl::StatusOr<SharedMemory*> ScratchFor(int64_t bytes);
  // Fills `out` from `t`: a handle when `t` lies in a registered segment (or is
  // copied into `scratch`), inline bytes otherwise.
  // Inline bytes are recorded in `outgoing`, not copied.
  absl::Status EncodeTensor(const at::Tensor& t, SharedMemory* scratch,
                            v1::Tensor* out, Outgoing* outgoing);
  // A result as a tensor: a view of its region slice (cloned when
  // `copy_out`), or a copy of its inline bytes (from `incoming`).
  absl::StatusOr<at::Tensor> DecodeResult(const v1::Tensor& t, bool copy_out,
                                          const Incoming& incoming);

  const ClientOptions options_;
  std::string token_;  // empty: none
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::PackService::Stub> stub_;
  // Two connections for large inline calls (the first is channel_'s).
  std::shared_ptr<grpc::Channel> channels_[2];
  std::unique_ptr<grpc::GenericStub> generic_[2];
  absl::Mutex mu_;
  // Registered segments, for lookups.
  std::vector<SharedMemory*> segments_ ABSL_GUARDED_BY(mu_);
  // Device memory registered through this client, by region name.
  absl::flat_hash_map<std::string, v1::RegisterDeviceRegionRequest>
      device_regions_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<SharedMemory> scratch_;  // automatic handles
  std::optional<bool> server_allows_shm_;
};

}  // namespace packd

#endif  // PACKD_CLIENT_CLIENT_H_
