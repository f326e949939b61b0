// packd::Client: the C++ client of packd.v1.PackService for rollout workers and
// trainers, with libtorch tensors in and out and shared-memory tensor handles
// on one node, over a Connection (connection.h: channels, deadlines, retry
// with backoff on UNAVAILABLE). Inline tensors are sent from their own memory
// and results copied once out of the received slices (proto/wire.h).
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto client, Client::Connect({.address = "127.0.0.1:50051"}));
//   PACKD_ASSIGN_OR_RETURN(PackedBatch b, client->Pack({hidden, token_ids}, mask));
// clang-format on
#ifndef PACKD_CLIENT_CLIENT_H_
#define PACKD_CLIENT_CLIENT_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/layout_options.h"
#include "base/mrope_options.h"
#include "client/connection.h"
#include "client/device_memory.h"
#include "client/gpu_allocations.h"
#include "client/shared_memory.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "planner/planner.h"
#include "proto/wire.h"

namespace packd {

struct PackCallOptions {
  bool with_position_ids = false;
  // cu_seqlens as int32 (what flash-attention and TransformerEngine take)
  // instead of int64.
  bool cu_seqlens_int32 = false;
  // "cpu", "cuda:N", "hip:N", "uuid:GPU-..."; empty: the server's default.
  // For host tensors: GPU tensors run on their own GPU.
  std::string device;
  // Documents within rows (docs/design.md §8): [B, S] of an integer dtype,
  // or undefined for none. position_ids then restart at every document and
  // the doc_* fields of the result are set.
  at::Tensor segment_ids;
  // When set, results are written into this segment and returned as views of it
  // (read in place, valid until the segment is reset or destroyed) instead of
  // being copied out.
  SharedMemory* results_in = nullptr;
  // Layouts for parallel attention (docs/design.md §10, docs/operation.md):
  // padding, CP slices, fixed shapes, shifts, seq_idx. Sequences are the
  // documents with segment_ids, else the rows. A call with a layout goes
  // whole (not in parts), its results inline (results_in refused).
  LayoutOptions layout;
  // Also return token_mask (1 for each output row holding a token, 0 for
  // padding and ghosts) and, with mrope, the rows' multimodal rotary
  // positions (docs/design.md §17). A call with either goes whole.
  bool with_token_mask = false;
  std::optional<MRopeOptions> mrope;
};

// A Scatter's options: the Pack's layout it inverts (pad_multiple, cp_size /
// cp_rank, fixed, and segment_ids for documents), where it runs, and the
// tail check.
struct ScatterCallOptions {
  std::optional<std::vector<int64_t>> tail_shape;
  std::string device;
  at::Tensor segment_ids;
  LayoutOptions layout;
};

// How a plan is made (docs/design.md §9, §11), beyond the lengths and the
// budget: PlanRequest's fields, with the same defaults.
struct PlanCallOptions {
  int32_t num_ranks = 1;
  int32_t micro_batch_multiple = 1;
  std::vector<int64_t> loss_tokens;  // empty, or one per sample
  // cost = cost_per_token * P + cost_per_token_squared * P^2 (P: the padded
  // length); both 0: P. `costs` (one per sample) replaces the model.
  double cost_per_token = 0;
  double cost_per_token_squared = 0;
  std::vector<double> costs;
  std::vector<int64_t> groups;  // empty, or a group id per sample
  int64_t pad_multiple = 0;
  bool pipeline_order = false;

  // These options as the planner's, for the plan codec (proto/plan_codec.h):
  // its costs and groups view these, which must outlive it.
  PlanOptions ForPlanner(int64_t max_tokens_per_micro_batch) const;
};

// A training step in one call (docs/design.md §12): how the batch's rows are
// planned (plan: loss_tokens, costs and pad_multiple must stay empty, packd
// measures them) and packed (pack: its layout and options, results_in
// refused), the loss mask, and the ranks whose micro-batches are sent (empty:
// every rank).
struct StepCallOptions {
  PlanCallOptions plan;
  PackCallOptions pack;
  at::Tensor loss_mask;  // [B, S], or undefined: every active position
  std::vector<int32_t> ranks;
};
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
  // With a layout: packed and position_ids hold the layout's rows, and
  // cu_seqlens (doc_cu_seqlens with documents) and the maxima are extended
  // for `fixed`. cu_seqlens_padded (like cu_seqlens' dtype) when the layout
  // reshapes; seq_idx [rows] int64 with with_seq_idx; shifted[j] answers
  // layout.shifts[j].
  at::Tensor cu_seqlens_padded;
  int64_t max_seqlen_padded = 0;
  at::Tensor seq_idx;
  std::vector<at::Tensor> shifted;
  // With with_token_mask: [rows] uint8, 1 for a token, 0 for padding and
  // ghosts. With mrope: [3, rows] int64 (temporal, height, width), a pad or
  // ghost row holding its position id in all three.
  at::Tensor token_mask;
  at::Tensor mrope_position_ids;
  // With layout.shared_prefix (docs/design.md §14): packed holds the stream,
  // shifted[j] one row per target, and these (int64; undefined without one)
  // its attention metadata and targets, as SharedLayout names them.
  struct Shared {
    at::Tensor cu_seqlens_q, cu_seqlens_k, kv_index;
    int64_t max_seqlen_q = 0, max_seqlen_k = 0;
    at::Tensor pred_index, target_cu_seqlens, segment_row;
  };
  std::optional<Shared> shared;
};

// One micro-batch of a step: exactly Pack of the batch's rows `samples`, in
// that order, with the step's options.
struct StepMicroBatch {
  int32_t rank = 0;
  int32_t index = 0;  // its position in its rank
  std::vector<int64_t> samples;
  PackedBatch batch;
  // Whether its results came through the step's shared-memory arena (copied
  // out) rather than inline: from the second step of a shape on, node-local.
  bool through_shared_memory = false;
};

// A group for a streaming step (Client::SubmitGroup).
struct GroupOptions {
  int64_t policy_version = 0;  // the policy that generated the group
  at::Tensor segment_ids;      // [g, S] documents within rows, or undefined
  at::Tensor loss_mask;        // [g, S], or undefined
  // With a shared-prefix layout: one per row, the group's prompt length.
  std::vector<int64_t> prefix_lengths;
  // Names the group within the step; empty: a fresh random key per call.
  std::string group_key;
  // How long each attempt waits for its reply before the call is retried;
  // zero: a quarter of the client's deadline.
  absl::Duration attempt_timeout = absl::ZeroDuration();
};

// The slice of region `region` (registered from an IPC handle of the
// allocation starting at `allocation_base`) that holds the `bytes` bytes at
// `data`: its offset is data - allocation_base, because an IPC handle maps an
// allocation from its start (cuMemGetAddressRange, or PyTorch's storage
// offset, give the base). INVALID_ARGUMENT when data lies before the base.
absl::StatusOr<v1::RegionSlice> DeviceSlice(const std::string& region,
                                            const void* allocation_base,
                                            const void* data, uint64_t bytes);

// Safe to share across threads, as gRPC stubs are: calls from many threads at
// once each get their own scratch memory, parts and results, and nothing one
// call writes is visible to another. A SharedMemory it hands out is not:
// one thread at a time allocates from it.
//
// GPU tensors stay on their GPU: a call whose tensors are all on one GPU
// (ClientOptions::device_memory says which) registers the allocations holding
// them as device regions, once each, with the lease, and again when the server
// lost them; allocates the results on that GPU; and has packd write them
// there. The results, cu_seqlens and the rest, are tensors on that GPU.
// Tensors on different devices in one call are INVALID_ARGUMENT.
class Client {
 public:
  // Connects (lazily: the first call dials): the errors of Connection::Open.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options);
  ~Client();

  // Packs every tensor ([B, S, *tail], any of the ten dtypes, in host memory
  // or all on one GPU with the mask) with one scan of `mask` ([B, S]). Errors
  // carry the server's code and message (INVALID_ARGUMENT for shapes, ...);
  // tensors of a dtype packd does not carry are INVALID_ARGUMENT here.
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
  // With a Pack's layout: packed[i] holds that layout's rows, and pad rows,
  // ghost rows and other CP ranks' positions are dropped (the gradient of that
  // Pack).
  absl::StatusOr<std::vector<at::Tensor>> Scatter(
      const std::vector<at::Tensor>& packed, const at::Tensor& mask,
      const ScatterCallOptions& options);

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

  // Plans micro-batches over data-parallel ranks (docs/design.md §9): each
  // sample of `lengths` in one micro-batch of at most
  // max_tokens_per_micro_batch tokens, every rank with the same count, and
  // global_loss_tokens to divide the summed token loss by. `loss_tokens` is
  // empty or one per sample. Errors: the server's (INVALID_ARGUMENT for bad
  // lengths or options).
  absl::StatusOr<v1::PlanResponse> PlanMicroBatches(
      const std::vector<int64_t>& lengths, int64_t max_tokens_per_micro_batch,
      int32_t num_ranks = 1, int32_t micro_batch_multiple = 1,
      const std::vector<int64_t>& loss_tokens = {});
  // The same, balanced by cost, with groups, padding and pipeline order
  // (docs/design.md §11): each micro-batch's cost and padded_tokens, and
  // cost_imbalance and global_sequences in the response.
  //
  //   PlanCallOptions o{.num_ranks = 8, .cost_per_token = 24576,
  //                     .cost_per_token_squared = 1, .pad_multiple = 8};
  //   auto plan = client->PlanMicroBatches(lengths, 16384, o);
  absl::StatusOr<v1::PlanResponse> PlanMicroBatches(
      const std::vector<int64_t>& lengths, int64_t max_tokens_per_micro_batch,
      const PlanCallOptions& options);

  // A training step in one call (docs/design.md §12): the rows of the batch
  // (`tensors` [B, S, *tail], `mask` and the options' tensors, all in host
  // memory or all on one GPU) planned into micro-batches of at most
  // max_tokens_per_micro_batch tokens in the layout, and each packed. `on_plan`
  // gets the plan first (global_loss_tokens: the one denominator of the summed
  // token loss), then `on_micro_batch` each micro-batch as it arrives, by rank
  // and index; while it runs the server packs the next one. A callback's error
  // cancels the call and is returned; otherwise the server's errors (Pack's and
  // Plan's). On a GPU, packd reads the batch there and packs each micro-batch
  // there; its results are tensors on that GPU: views of an arena allocated for
  // the step (from the second step of a shape on), or inline results copied
  // there.
  //
  //   StepCallOptions o;
  //   o.plan.num_ranks = 8;
  //   o.pack.layout.shifts = {{0, -100}};
  //   client->PackMicroBatches({token_ids}, mask, 16384, o,
  //       [&](const v1::PlanResponse& plan) { ...; return absl::OkStatus(); },
  //       [&](StepMicroBatch mb) { ...; return absl::OkStatus(); });
  absl::Status PackMicroBatches(
      const std::vector<at::Tensor>& tensors, const at::Tensor& mask,
      int64_t max_tokens_per_micro_batch, const StepCallOptions& options,
      const std::function<absl::Status(const v1::PlanResponse&)>& on_plan,
      const std::function<absl::Status(StepMicroBatch)>& on_micro_batch);

  // The streaming step (docs/operation.md, "The streaming step"), for
  // rollout workers and trainer ranks in C++ (the step is opened by a
  // controller, packd.Client.open_step or OpenStep).
  //
  // SubmitGroup: one finished group to step `step_id` on this replica: its
  // rows `mask` [g, S] and `tensors` [g, S, *tail], in host memory, sent
  // inline. packd takes it once: the options' group_key (default: a fresh
  // random key for this call) names it, so the call is retried like every
  // other and also when an attempt's reply does not come within
  // attempt_timeout; a repeat of a key taken gets the first reply. Errors as
  // docs/service.md lists them (RESOURCE_EXHAUSTED: retry after a wait).
  //
  //   GroupOptions o{.policy_version = v, .loss_mask = response_mask};
  //   auto taken = client->SubmitGroup(step_id, {token_ids}, mask, o);
  absl::StatusOr<v1::SubmitGroupResponse> SubmitGroup(
      const std::string& step_id, const std::vector<at::Tensor>& tensors,
      const at::Tensor& mask, const GroupOptions& options = {});
  // ReceiveStep: rank `rank`'s (and `cp_rank`'s) micro-batches of step
  // `step_id`, each to `on_micro_batch` as waves commit (read with the step's
  // own layout, which packd sends with each; cu_seqlens as int32 when
  // asked), then the step's plan (global_loss_tokens: scale the summed
  // gradients by world_size / it). A callback's error cancels the stream,
  // which ends the step for every party, and is returned.
  absl::StatusOr<v1::PlanResponse> ReceiveStep(
      const std::string& step_id, int rank, int cp_rank, bool cu_seqlens_int32,
      const std::function<absl::Status(StepMicroBatch)>& on_micro_batch);

  // `t` on the GPU holding `like`, when it is not there (a gradient autograd
  // left in host memory); `t` itself otherwise.
  absl::StatusOr<at::Tensor> ToDeviceOf(const at::Tensor& t,
                                        const at::Tensor& like);

  absl::StatusOr<v1::ServerInfo> Info() { return connection_->Info(); }
  // The load-balancing policy the channels use ("round_robin", "pick_first"),
  // once they have connected.
  std::string LoadBalancingPolicy() const {
    return connection_->LoadBalancingPolicy();
  }
  // grpc.health.v1 status of `service` ("" liveness, "packd.v1.PackService"
  // readiness): "SERVING", "NOT_SERVING", ...
  absl::StatusOr<std::string> Health(
      const std::string& service = "packd.v1.PackService") {
    return connection_->Health(service);
  }

  // Creates a shared-memory segment of `bytes`, registers it with the server,
  // and returns it: tensors allocated from it travel as handles, without a
  // copy. FAILED_PRECONDITION when the server has shared memory off. Its name
  // is removed from /dev/shm once the server has mapped it: the memory goes
  // when both this process and the server's lease let go.
  absl::StatusOr<std::unique_ptr<SharedMemory>> CreateSharedMemory(
      int64_t bytes);

  const ClientOptions& options() const { return connection_->options(); }
  v1::PackService::Stub& stub() { return connection_->stub(); }
  Connection& connection() { return *connection_; }

 private:
  // A request on its way: the message, whose inline tensors it carries in
  // place (each held by its tensor), and the regions it names.
  struct Outgoing {
    explicit Outgoing(WireMessage* request) : request(request) {}
    WireMessage* request;
    std::vector<std::string> regions;
  };
  struct PackPart;
  struct ScatterPart;
  // Gives a scratch segment back to the client's pool.
  struct ScratchReturn {
    Client* client;
    void operator()(SharedMemory* segment) const;
  };
  // A scratch segment lent to one call; back to the pool when it ends.
  using Scratch = std::unique_ptr<SharedMemory, ScratchReturn>;

  explicit Client(std::unique_ptr<Connection> connection);

  // Connection::RawCall of `outgoing`'s request; when the server does not
  // know a region (NOT_FOUND), registers again the regions of `outgoing` that
  // it lost and, if any was, calls once more.
  absl::Status RawCall(int connection, const char* method,
                       const Outgoing& outgoing, WireMessage* response);
  // One Pack call over rows of the batch, on `connection`.
  absl::StatusOr<PackPart> PackRows(const std::vector<at::Tensor>& tensors,
                                    const at::Tensor& mask,
                                    const at::Tensor& segment_ids,
                                    const PackCallOptions& options,
                                    SharedMemory* scratch, int connection);
  // Registers `segment` (named anew when unlinked) and unlinks its name.
  // Takes no lock: the caller holds the segment.
  absl::Status RegisterSegment(SharedMemory& segment);
  // Registers again those of `regions` (named by a call, so alive while it
  // runs) that are this client's and that the server no longer holds (a lease
  // ran out, the server restarted); a region another call is registering
  // again is waited for, not registered twice. Whether any was missing.
  absl::StatusOr<bool> Reregister(const std::vector<std::string>& regions);
  // Registers this client's region `region` again: NOT_FOUND when it has none.
  absl::Status RegisterAgain(const std::string& region);
  // Into how many parts (one per connection, at most one per row of `rows`)
  // a call of `bytes` is split: 1 through shared memory or when small.
  int Parts(int64_t bytes, bool through_shared_memory, int64_t rows) const;
  // The scratch segment of a call whose tensors hold `bytes`: none when they
  // travel inline, else an idle one of at least `bytes` from the pool or a
  // new one. Each call has its own.
  absl::StatusOr<Scratch> ScratchFor(int64_t bytes);
  // Fills `out` from `t`: a handle when `t` lies in a registered segment (or is
  // copied into `scratch`), inline bytes otherwise.
  // Inline bytes are recorded in `outgoing`, not copied.
  absl::Status EncodeTensor(const at::Tensor& t, SharedMemory* scratch,
                            v1::Tensor* out, Outgoing* outgoing);
  // How a path adds a tensor to a request's field `out`: EncodeTensor (its
  // bytes, or a slice of a shared-memory segment) on the host, EncodeGpuTensor
  // (a slice of its device region) on a GPU.
  using Encoder =
      std::function<absl::Status(const at::Tensor&, v1::Tensor*, Outgoing*)>;
  // The fields of a Pack's and a Scatter's request, the same on every path:
  // the device, the options and the layout, then each tensor through
  // `encode` (mask, then inputs or packed, then segment ids when defined).
  static absl::Status EncodePack(const std::string& device,
                                 const PackCallOptions& options,
                                 const std::vector<at::Tensor>& tensors,
                                 const at::Tensor& mask,
                                 const at::Tensor& segment_ids,
                                 const Encoder& encode,
                                 v1::PackRequest* request, Outgoing* outgoing);
  static absl::Status EncodeScatter(
      const std::string& device, const ScatterCallOptions& options,
      const std::vector<at::Tensor>& packed, const at::Tensor& mask,
      const at::Tensor& segment_ids, const Encoder& encode,
      v1::ScatterRequest* request, Outgoing* outgoing);
  // EncodeTensor through `scratch` (none: inline bytes), as an Encoder.
  Encoder HostEncoder(SharedMemory* scratch);
  // A result as a tensor: a view of its region slice (cloned when
  // `copy_out`), or a copy of its inline bytes (a tensor of `reply`).
  absl::StatusOr<at::Tensor> DecodeResult(const v1::Tensor& t, bool copy_out,
                                          const WireMessage& reply);
  // The results of a call made in parts (rows of the batch, in order), each
  // part's `results` in its `replies`: decoded from the one part (see
  // DecodeResult), or result i of every part joined along dim 0 with one copy.
  // INTERNAL when the parts do not join.
  using Tensors = google::protobuf::RepeatedPtrField<v1::Tensor>;
  absl::StatusOr<std::vector<at::Tensor>> Results(
      const std::vector<const Tensors*>& results,
      const std::vector<const WireMessage*>& replies, bool copy_out);

  // Sets the fields of `batch` that the response carries as numbers:
  // cu_seqlens, position ids, last indices and the documents', on the host.
  static void FillMetadata(const v1::PackResponse& response,
                           const PackCallOptions& options, PackedBatch* batch);

  // GPU tensors (gpu_calls.cc). The GPU of a call's tensors (name, tensor;
  // undefined ones skipped): nullopt for host memory; INVALID_ARGUMENT naming
  // two on different devices.
  using Named = std::vector<std::pair<std::string, const at::Tensor*>>;
  absl::StatusOr<std::optional<int>> GpuOf(const Named& tensors) const;
  absl::StatusOr<std::string> GpuUuid(int index);
  // The slice of `t` (contiguous, on GPU `index`, with bytes) in the device
  // region of its allocation, registered first when it is not yet.
  absl::StatusOr<v1::RegionSlice> GpuSlice(const at::Tensor& t, int index,
                                           Outgoing* outgoing);
  absl::Status EncodeGpuTensor(const at::Tensor& t, int index, v1::Tensor* out,
                               Outgoing* outgoing);
  // EncodeGpuTensor on GPU `index`, as an Encoder.
  Encoder GpuEncoder(int index);
  // Forgets and unregisters the regions of allocations freed since the last
  // call (or of every GPU allocation, with `all`).
  void UnregisterFreed(bool all = false);
  // Sends `outgoing` (its GPU tensors encoded) with the results into
  // `outputs` (none: inline), their slices added to `slices`, once the GPU's
  // queued work has finished.
  absl::Status CallOnGpu(
      int index, const char* method, Outgoing* outgoing,
      const std::vector<at::Tensor>& outputs,
      google::protobuf::RepeatedPtrField<v1::RegionSlice>* slices,
      WireMessage* reply);
  // A Pack or a Scatter of tensors on GPU `index`: its request encoded by
  // `encode` (EncodePack or EncodeScatter) with the GPU's tensors as slices of
  // their device regions, then CallOnGpu.
  template <typename Request, typename Options>
  using EncodeFn = absl::Status (*)(const std::string&, const Options&,
                                    const std::vector<at::Tensor>&,
                                    const at::Tensor&, const at::Tensor&,
                                    const Encoder&, Request*, Outgoing*);
  template <typename Request, typename Options>
  absl::Status EncodeAndCallOnGpu(int index, const char* method,
                                  EncodeFn<Request, Options> encode,
                                  const Options& options,
                                  const std::vector<at::Tensor>& tensors,
                                  const at::Tensor& mask,
                                  const std::vector<at::Tensor>& outputs,
                                  WireMessage* reply);
  // Result memory on GPU `index`, one tensor per `like`: [*lead,
  // *t.shape[tail_from:]]; none at all when one would have no bytes (results
  // then come inline).
  absl::StatusOr<std::vector<at::Tensor>> GpuOutputs(
      const std::vector<at::Tensor>& like, const std::vector<int64_t>& lead,
      int64_t tail_from, int index);
  // The results on GPU `index`: `outputs` where packd wrote them (checked
  // against the reply's shapes), else the inline ones copied there.
  absl::StatusOr<std::vector<at::Tensor>> GpuResults(
      const Tensors& results, const WireMessage& reply,
      const std::vector<at::Tensor>& outputs, int index);
  // How a step's micro-batch results are read (micro_batches.cc): copied out of
  // the shared-memory arena or the reply; on a GPU, views of the step's arena
  // there (which they keep) or inline ones copied to it.
  using StepResults = std::function<absl::StatusOr<std::vector<at::Tensor>>(
      const Tensors&, const WireMessage&)>;
  // A micro-batch's message as a StepMicroBatch: its results through
  // `results`, its metadata as `pack` asks (micro_batches.cc).
  static absl::StatusOr<StepMicroBatch> MicroBatchOf(
      const Wire<v1::PackMicroBatchesResponse>& reply,
      const PackCallOptions& pack, const StepResults& results);
  // A step's batch on GPU `index` encoded into `request` (slices of its
  // device regions), with its results' arena of `arena` bytes (0: none, the
  // results come inline) allocated there; returns once the GPU's queued work
  // is done, with how the micro-batches' results are read.
  absl::StatusOr<StepResults> EncodeStepOnGpu(
      int index, const std::vector<at::Tensor>& tensors, const at::Tensor& mask,
      const StepCallOptions& options, int64_t arena,
      v1::PackMicroBatchesRequest* request, Outgoing* outgoing);
  // A packed batch's metadata tensors (cu_seqlens, position ids, ...) copied
  // to GPU `index`.
  absl::Status MetadataToDevice(int index, PackedBatch* batch);
  absl::StatusOr<PackedBatch> PackOnGpu(int index,
                                        const std::vector<at::Tensor>& tensors,
                                        const at::Tensor& mask,
                                        const PackCallOptions& options);
  absl::StatusOr<std::vector<at::Tensor>> ScatterOnGpu(
      int index, const std::vector<at::Tensor>& packed, const at::Tensor& mask,
      const ScatterCallOptions& options);

  const std::unique_ptr<Connection> connection_;
  const ClientOptions& options_;                       // connection_'s
  const std::shared_ptr<DeviceMemory> device_memory_;  // may be null
  // The device regions of GPU allocations (safe to share; it has its own
  // lock, taken without mu_).
  GpuAllocations gpu_allocations_;
  // Guards what follows; never held across an RPC.
  absl::Mutex mu_;
  // Signalled when a region's registration again ends.
  absl::CondVar reregistered_;
  // Registered segments, for lookups.
  std::vector<SharedMemory*> segments_ ABSL_GUARDED_BY(mu_);
  // Device memory registered through this client, by region name.
  absl::flat_hash_map<std::string, v1::RegisterDeviceRegionRequest>
      device_regions_ ABSL_GUARDED_BY(mu_);
  // Every region of this client, by name: how many times it was registered;
  // and those being registered again now.
  absl::flat_hash_map<std::string, int64_t> registrations_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> reregistering_ ABSL_GUARDED_BY(mu_);
  // Scratch segments no call holds now.
  std::vector<std::unique_ptr<SharedMemory>> idle_scratch_ ABSL_GUARDED_BY(mu_);
  std::optional<bool> server_allows_shm_ ABSL_GUARDED_BY(mu_);
  // The last step's output_bytes: the arena the next step asks its results
  // in (docs/design.md §12).
  int64_t step_output_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The devices' UUIDs.
  absl::flat_hash_map<int, std::string> uuids_ ABSL_GUARDED_BY(mu_);
};

}  // namespace packd

#endif  // PACKD_CLIENT_CLIENT_H_
