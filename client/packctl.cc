// packctl: the command-line tool for packd's operators and probes.
//
// clang-format off
//   packctl health                     # liveness and readiness
//   packctl info                       # version, devices, limits
//   packctl probe --max_latency_ms=50  # one small Pack round trip; a Kubernetes exec probe
//   packctl pack --shape=16,1024,4096 --dtype=bfloat16 --density=0.3
//   packctl pack --pad_multiple=8 --cp_size=2 --cp_rank=1 --fixed=16384,0,16384
//   packctl pack --shape=64,2048,1 --dtype=int64 --groups=8 --prefix=1024   # GRPO
//   packctl bench --concurrency=4 --duration=10 --transport=shm --json=out.json
//   packctl plan --samples=1024 --distribution=lognormal --max_tokens=16384 --ranks=8
//   packctl plan --cost=24576,1 --pad_multiple=8 --pipeline_order
// clang-format on
//
// Exit codes: 0 ok; 1 a check failed (not serving, too slow, wrong result); 2
// usage; 3 the server answered with an error or could not be reached.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "client/connection.h"
#include "client/shm_region.h"
#include "kernels/layout.h"
#include "kernels/shared_prefix.h"
#include "planner/planner.h"
#include "proto/grpc_wire.h"
#include "proto/plan_codec.h"
#include "proto/tensor_codec.h"
#include "workloads/lengths.h"
#include "workloads/mask_patterns.h"
#include "workloads/peer_planners.h"

ABSL_FLAG(std::string, token_file, "",
          "Bearer token for a server with --auth_token_file: the file's first "
          "line (default: the PACKD_TOKEN environment variable)");
ABSL_FLAG(std::string, tls_ca_file, "",
          "TLS: PEM CA certificates that signed the server's certificate "
          "(default: plaintext)");
ABSL_FLAG(std::string, tls_cert_file, "",
          "Mutual TLS: this client's PEM certificate chain");
ABSL_FLAG(std::string, tls_key_file, "",
          "Mutual TLS: the PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_server_name, "",
          "TLS: the name the server's certificate carries, when not the "
          "address's host (unix sockets: localhost)");
ABSL_FLAG(std::string, address, "127.0.0.1:50051",
          "packd address: HOST:PORT or unix:PATH");
ABSL_FLAG(int, deadline_ms, 60000, "Deadline of each call");
ABSL_FLAG(int, attempts, 1,
          "Attempts per call while the server answers UNAVAILABLE or goes away "
          "(CANCELLED), with backoff from 50 ms to 2 s, as the clients retry");
ABSL_FLAG(double, max_latency_ms, 1000,
          "probe: fail when the round trip takes longer");
ABSL_FLAG(std::string, shape, "16,1024,4096",
          "pack, bench: shape of x, B,S[,tail...]");
ABSL_FLAG(std::string, dtype, "bfloat16", "pack, bench: dtype of x");
ABSL_FLAG(double, density, 0.3, "pack, bench: fraction of active positions");
ABSL_FLAG(std::string, mask, "prefix",
          "pack, bench: prefix (a completion then padding per row) or holes "
          "(positions active independently)");
ABSL_FLAG(std::string, input, "",
          "pack: read x from this file (raw little-endian bytes)");
ABSL_FLAG(std::string, mask_file, "",
          "pack: read the mask from this file (B*S bytes, 0 inactive, else "
          "active) instead of generating it");
ABSL_FLAG(std::string, output, "",
          "pack: write the packed bytes of x to this file");
ABSL_FLAG(int64_t, pad_multiple, 0,
          "pack: pad every row to a multiple of this (docs/operation.md)");
ABSL_FLAG(int, cp_size, 0, "pack: context-parallel ranks (0 or 1: none)");
ABSL_FLAG(int, cp_rank, 0, "pack: the context-parallel rank to return");
ABSL_FLAG(std::string, fixed, "",
          "pack: fixed shapes TOKENS,SEQUENCES,MAX_SEQLEN (0 = not fixed)");
ABSL_FLAG(int, groups, 0,
          "pack: GRPO groups of this many rows sharing a prompt, packed with "
          "it once (docs/operation.md, \"Shared prompts\"); 0: none");
ABSL_FLAG(int64_t, prefix, 0,
          "pack --groups: the prompt's length, below S; each row's response "
          "after it is 1 .. S - prefix tokens");
ABSL_FLAG(int, warm_calls, 3,
          "pack: calls after the first, timed apart from it (the first pays "
          "for the connection and the first touch of fresh memory); the best "
          "is shown");
ABSL_FLAG(int, concurrency, 1, "bench: calls in flight");
ABSL_FLAG(double, duration, 5, "bench: seconds to run");
ABSL_FLAG(std::string, transport, "inline",
          "bench: inline bytes or shm (shared-memory handles)");
ABSL_FLAG(std::string, lengths_file, "",
          "plan: sample lengths, one per line (else generated: --samples, "
          "--distribution)");
ABSL_FLAG(int, samples, 1024, "plan: how many lengths to generate");
ABSL_FLAG(std::string, distribution, "lognormal",
          "plan: lognormal (RL rollouts up to 8192), uniform (1-4096) or "
          "bimodal (64-128 and 8000-8192)");
ABSL_FLAG(int64_t, max_tokens, 16384, "plan: token budget of a micro-batch");
ABSL_FLAG(int, ranks, 8, "plan: data-parallel ranks");
ABSL_FLAG(int, multiple, 1,
          "plan: micro-batches per rank are a multiple of this");
ABSL_FLAG(std::string, cost, "",
          "plan: A,B balances ranks by A*P + B*P^2 per sample (P: its padded "
          "length), e.g. 24576,1 (a 7B-class model) or 0,1 (attention); "
          "empty: by tokens");
ABSL_FLAG(bool, pipeline_order, false,
          "plan: each rank's micro-batches costliest in the middle");
ABSL_FLAG(
    std::string, batch, "512,4096",
    "step: B,S of the synthetic batch (token ids, log-probs, advantages)");
ABSL_FLAG(std::string, json, "",
          "bench: also write the summary as JSON to this file");

namespace packd {
namespace {

constexpr int kOk = 0, kCheckFailed = 1, kUsage = 2, kRpcError = 3;

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "packctl: %s\n", message.c_str());
  return code;
}

absl::StatusOr<std::unique_ptr<Connection>> Connect() {
  ClientOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.deadline = absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  // Operators want the answer, not a retry loop: one attempt unless asked.
  options.max_attempts = std::max(1, absl::GetFlag(FLAGS_attempts));
  options.token_file = absl::GetFlag(FLAGS_token_file);  // else $PACKD_TOKEN
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  return Connection::Open(options);
}

// One tensor x of [B, S, *tail] and its [B, S] mask, as bytes.
struct Batch {
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  std::vector<char> x;
  std::vector<uint8_t> mask;  // bool: 0 or 1

  int64_t rows() const { return shape[0] * shape[1]; }
  int64_t row_bytes() const {
    return rows() > 0 ? static_cast<int64_t>(x.size()) / rows() : 0;
  }
  // The reference result: the rows of x where the mask is set, in order.
  std::string Packed() const {
    std::string out;
    for (int64_t i = 0; i < rows(); ++i) {
      if (mask[i]) out.append(x.data() + i * row_bytes(), row_bytes());
    }
    return out;
  }
};

// The contents of `path`, which must hold exactly `bytes` bytes (`flag` names
// it in the error).
absl::StatusOr<std::vector<char>> ReadExactly(const std::string& flag,
                                              const std::string& path,
                                              int64_t bytes,
                                              const std::string& needs) {
  std::ifstream f(path, std::ios::binary);
  if (!f)
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read --", flag, "=", path));
  std::vector<char> out(bytes + 1);
  f.read(out.data(), bytes + 1);
  if (f.gcount() > bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, " holds more than the ", bytes,
                     " bytes ", needs, " needs"));
  }
  if (f.gcount() < bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, " holds ", f.gcount(), " bytes; ",
                     needs, " needs ", bytes));
  }
  out.resize(bytes);
  return out;
}

absl::StatusOr<Batch> MakeBatch() {
  Batch batch;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_shape), ',')) {
    int64_t d = 0;
    if (!absl::SimpleAtoi(part, &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shape=", absl::GetFlag(FLAGS_shape), " is not B,S[,tail...]"));
    }
    batch.shape.push_back(d);
  }
  if (batch.shape.size() < 2)
    return absl::InvalidArgumentError("--shape needs at least B,S");
  if (!ParseDType(absl::GetFlag(FLAGS_dtype), &batch.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--dtype=", absl::GetFlag(FLAGS_dtype), " is not a dtype"));
  }
  MaskPattern pattern;
  if (!ParseMaskPattern(absl::GetFlag(FLAGS_mask), &pattern)) {
    return absl::InvalidArgumentError("--mask must be prefix or holes");
  }
  absl::StatusOr<int64_t> bytes = ByteSize(batch.dtype, batch.shape, "--shape");
  if (!bytes.ok()) return bytes.status();
  const std::string what = absl::StrCat("shape ", absl::GetFlag(FLAGS_shape),
                                        " of ", DTypeName(batch.dtype));
  std::mt19937_64 rng(std::random_device{}());
  if (!absl::GetFlag(FLAGS_input).empty()) {
    absl::StatusOr<std::vector<char>> x =
        ReadExactly("input", absl::GetFlag(FLAGS_input), *bytes, what);
    if (!x.ok()) return x.status();
    batch.x = *std::move(x);
  } else {
    // Random bytes: packing moves bytes and never reads them as numbers. A
    // bool is 0 or 1.
    batch.x.resize(*bytes);
    for (char& c : batch.x) c = static_cast<char>(rng());
    if (batch.dtype == DType::kBool) {
      for (char& c : batch.x) c &= 1;
    }
  }
  const int64_t B = batch.shape[0], S = batch.shape[1];
  if (const int G = absl::GetFlag(FLAGS_groups); G != 0) {
    const int64_t P = absl::GetFlag(FLAGS_prefix);
    if (G < 0 || P <= 0 || P >= S) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--groups=", G, " --prefix=", P, ": groups of G > 0 rows need a ",
          "prompt of 0 < P < S = ", S, " positions"));
    }
  }
  if (!absl::GetFlag(FLAGS_mask_file).empty()) {
    absl::StatusOr<std::vector<char>> mask =
        ReadExactly("mask_file", absl::GetFlag(FLAGS_mask_file), B * S,
                    absl::StrCat("a [", B, ", ", S, "] mask"));
    if (!mask.ok()) return mask.status();
    for (char c : *mask) batch.mask.push_back(c != 0);
  } else if (absl::GetFlag(FLAGS_groups) > 0) {
    // GRPO rows: the prompt, then a response of 1 .. S - P tokens.
    const int64_t P = absl::GetFlag(FLAGS_prefix);
    batch.mask.assign(B * S, 0);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t length = std::min(
          S, P + 1 + static_cast<int64_t>(rng() % std::max<int64_t>(S - P, 1)));
      std::fill_n(batch.mask.begin() + b * S, length, 1);
    }
  } else {
    batch.mask = MaskActivity(pattern, B, S, absl::GetFlag(FLAGS_density), rng);
  }
  const int G = absl::GetFlag(FLAGS_groups);
  if (G > 0 && absl::GetFlag(FLAGS_input).empty()) {
    // Generated x: every member's prompt its group's first row's, as a
    // rollout's token ids are (the server checks it: same_inputs).
    const int64_t width = batch.row_bytes(), P = absl::GetFlag(FLAGS_prefix);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t first = b / G * G;
      std::copy_n(batch.x.begin() + first * S * width, P * width,
                  batch.x.begin() + b * S * width);
    }
  }
  return batch;
}

// A Pack request for `batch` with x's bytes inline (in place) or, when
// `x_in` is given, as that slice of a registered region, and the results in
// `results` when given.
// The batch outlives every request made from it.
void PackRequestFor(const Batch& batch, const v1::RegionSlice* x_in,
                    const v1::RegionSlice* results,
                    Wire<v1::PackRequest>* request) {
  const int64_t mask_shape[] = {batch.shape[0], batch.shape[1]};
  EncodeTensorHeader(DType::kBool, mask_shape, (*request)->mutable_mask());
  request->Carry(
      (*request)->mask(),
      Payload::Of(batch.mask.data(), static_cast<int64_t>(batch.mask.size())));
  v1::Tensor* x = (*request)->add_inputs();
  EncodeTensorHeader(batch.dtype, batch.shape, x);
  if (x_in != nullptr) {
    *x->mutable_region() = *x_in;
  } else {
    request->Carry(
        *x, Payload::Of(batch.x.data(), static_cast<int64_t>(batch.x.size())));
  }
  if (results != nullptr) *(*request)->add_outputs() = *results;
}

// The packed bytes of x in a reply.
absl::StatusOr<std::string> PackedBytes(const Wire<v1::PackResponse>& reply) {
  if (reply->packed_size() != 1) {
    return absl::InternalError(absl::StrCat("the server returned ",
                                            reply->packed_size(),
                                            " packed tensors for one input"));
  }
  const Payload bytes = reply.BytesOf(reply->packed(0));
  std::string out(bytes.size, '\0');
  bytes.CopyOut(0, bytes.size, out.data());
  return out;
}

int Health(Connection& connection) {
  absl::StatusOr<std::string> live = connection.Health("");
  if (!live.ok()) return Fail(kRpcError, live.status().ToString());
  absl::StatusOr<std::string> ready = connection.Health("packd.v1.PackService");
  if (!ready.ok()) return Fail(kRpcError, ready.status().ToString());
  std::printf(
      "liveness  (\"\"):                   %s\nreadiness "
      "(packd.v1.PackService): %s\n",
      live->c_str(), ready->c_str());
  return *ready == "SERVING" ? kOk : kCheckFailed;
}

int Info(Connection& connection) {
  absl::StatusOr<v1::ServerInfo> info = connection.Info();
  if (!info.ok()) return Fail(kRpcError, info.status().ToString());
  std::printf(
      "version:          %s\ndefault device:   %s\nmax message:      %llu "
      "bytes\n"
      "shared memory:    %s\ndevices:\n",
      info->version().c_str(), info->default_device().c_str(),
      static_cast<unsigned long long>(info->max_message_bytes()),
      info->shared_memory_enabled() ? "on" : "off");
  for (const v1::DeviceInfo& d : info->devices()) {
    const std::string memory =
        d.memory_bytes() > 0
            ? absl::StrFormat("%.1f GiB", d.memory_bytes() / 1073741824.0)
            : "";
    std::printf("  %-10s %-5s %-10s %s\n", d.name().c_str(), d.kind().c_str(),
                memory.c_str(), d.uuid().c_str());
  }
  return kOk;
}

// Packs `batch` inline; the reply, its packed bytes and the milliseconds the
// call took.
struct PackResult {
  Wire<v1::PackResponse> reply;
  std::string packed;
  double ms = 0;
};
absl::StatusOr<PackResult> PackInline(Connection& connection,
                                      const Batch& batch,
                                      bool with_position_ids,
                                      const LayoutOptions& layout = {}) {
  Wire<v1::PackRequest> request;
  request->set_with_position_ids(with_position_ids);
  EncodeLayout(layout, &request.message());
  PackRequestFor(batch, nullptr, nullptr, &request);
  PackResult result;
  const auto start = std::chrono::steady_clock::now();
  absl::Status status =
      connection.RawCall(0, kPackMethod, request, &result.reply);
  result.ms = std::chrono::duration<double, std::milli>(
                  std::chrono::steady_clock::now() - start)
                  .count();
  if (!status.ok()) return status;
  absl::StatusOr<std::string> packed = PackedBytes(result.reply);
  if (!packed.ok()) return packed.status();
  result.packed = *std::move(packed);
  return result;
}

int Probe(Connection& connection) {
  Batch batch;  // x = 0..15 as float32 [2, 4, 2]
  batch.dtype = DType::kFloat32;
  batch.shape = {2, 4, 2};
  batch.mask = {1, 1, 0, 1, 0, 0, 1, 1};
  for (int i = 0; i < 16; ++i) {
    const float v = static_cast<float>(i);
    const char* p = reinterpret_cast<const char*>(&v);
    batch.x.insert(batch.x.end(), p, p + sizeof(v));
  }
  absl::StatusOr<PackResult> r = PackInline(connection, batch, false);
  if (!r.ok()) return Fail(kRpcError, r.status().ToString());
  if (r->packed != batch.Packed() || r->reply->total_active() != 5) {
    return Fail(kCheckFailed, "probe: the server returned a wrong result");
  }
  if (r->ms > absl::GetFlag(FLAGS_max_latency_ms)) {
    return Fail(kCheckFailed,
                absl::StrFormat("probe: %.2f ms is over --max_latency_ms=%g",
                                r->ms, absl::GetFlag(FLAGS_max_latency_ms)));
  }
  std::printf("probe ok: %.2f ms\n", r->ms);
  return kOk;
}

// The layout the flags ask for (docs/design.md §10, §14) for `batch`.
absl::StatusOr<LayoutOptions> LayoutFromFlags(const Batch& batch) {
  LayoutOptions layout;
  layout.pad_multiple = absl::GetFlag(FLAGS_pad_multiple);
  layout.cp_size = absl::GetFlag(FLAGS_cp_size);
  layout.cp_rank = absl::GetFlag(FLAGS_cp_rank);
  const std::string fixed = absl::GetFlag(FLAGS_fixed);
  if (!fixed.empty()) {
    std::vector<std::string> parts = absl::StrSplit(fixed, ',');
    int64_t v[3] = {0, 0, 0};
    if (parts.size() > 3) {
      return absl::InvalidArgumentError(
          "--fixed takes TOKENS,SEQUENCES,MAX_SEQLEN");
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      if (!absl::SimpleAtoi(parts[i], &v[i])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--fixed=", fixed, ": \"", parts[i], "\" is not an integer"));
      }
    }
    layout.fixed = {v[0], v[1], v[2]};
  }
  if (const int G = absl::GetFlag(FLAGS_groups); G > 0) {
    const int64_t P = absl::GetFlag(FLAGS_prefix), B = batch.shape[0];
    SharedPrefix shared;
    for (int64_t b = 0; b < B; ++b) {
      shared.groups.push_back(b / G);
      shared.prefix_lengths.push_back(P);
    }
    if (absl::GetFlag(FLAGS_input).empty()) shared.same_inputs = {0};
    layout.shared_prefix = std::move(shared);
  }
  return layout;
}

// The bytes a Pack of `batch` with `layout` returns (each output row x's row
// of the token it holds, zeros for padding), and its Layout.
absl::StatusOr<std::string> LaidOutBytes(const Batch& batch,
                                         const LayoutOptions& layout,
                                         Layout* out) {
  std::vector<int64_t> starts = {0}, positions;
  for (int64_t b = 0; b < batch.shape[0]; ++b) {
    for (int64_t s = 0; s < batch.shape[1]; ++s) {
      if (batch.mask[b * batch.shape[1] + s]) {
        positions.push_back(b * batch.shape[1] + s);
      }
    }
    starts.push_back(static_cast<int64_t>(positions.size()));
  }
  absl::StatusOr<Layout> laid =
      layout.shared_prefix.has_value()
          ? MakeSharedLayout(starts, layout, /*with_position_ids=*/false)
          : MakeLayout(starts, layout);
  if (!laid.ok()) return laid.status();
  laid->ExpandRuns();  // a shared stream is made of runs
  const int64_t width = batch.row_bytes();
  std::string bytes;
  for (int64_t token : laid->source) {
    if (token < 0) {
      bytes.append(width, '\0');
    } else {
      bytes.append(batch.x.data() + positions[token] * width, width);
    }
  }
  *out = *std::move(laid);
  return bytes;
}

std::string Head(const google::protobuf::RepeatedField<int64_t>& values) {
  const int head = std::min(values.size(), 9);
  return absl::StrCat(
      "[", absl::StrJoin(values.begin(), values.begin() + head, ", "),
      values.size() > head ? ", ..." : "", "]");
}

// What a shared stream saves, and its metadata.
void PrintStream(const Batch& batch, int G, const v1::PackResponse& response) {
  const v1::SharedLayout& s = response.shared();
  int64_t active = 0;
  for (uint8_t m : batch.mask) active += m;
  const int64_t rows = response.total_active();
  const double saved_mib =
      static_cast<double>(active - rows) * batch.row_bytes() / 1048576.0;
  std::printf("shared:       %lld groups of %d, prompt %lld\n",
              static_cast<long long>((batch.shape[0] + G - 1) / G), G,
              static_cast<long long>(absl::GetFlag(FLAGS_prefix)));
  std::printf(
      "stream:       %lld rows for %lld active tokens: %.1f%% fewer (%.2fx), "
      "%.1f MiB less\n",
      static_cast<long long>(rows), static_cast<long long>(active),
      active > 0 ? 100.0 * (active - rows) / active : 0.0,
      rows > 0 ? static_cast<double>(active) / rows : 0.0, saved_mib);
  std::printf(
      "segments:     %d   max_seqlen_q: %lld   max_seqlen_k: %lld   keys: "
      "%d   targets: %d\n",
      s.segment_row_size(), static_cast<long long>(s.max_seqlen_q()),
      static_cast<long long>(s.max_seqlen_k()), s.kv_index_size(),
      s.pred_index_size());
  std::printf("kv_index:     %s\n", Head(s.kv_index()).c_str());
  std::printf("pred_index:   %s\n", Head(s.pred_index()).c_str());
}

template <typename Values, typename Field>
bool SameValues(const Values& want, const Field& got) {
  return std::equal(want.begin(), want.end(), got.begin(), got.end());
}

bool SameStream(const SharedLayout& want, const v1::SharedLayout& got) {
  return SameValues(want.cu_seqlens_q, got.cu_seqlens_q()) &&
         SameValues(want.cu_seqlens_k, got.cu_seqlens_k()) &&
         SameValues(want.kv_index, got.kv_index()) &&
         SameValues(want.pred_index, got.pred_index()) &&
         SameValues(want.target_cu_seqlens, got.target_cu_seqlens()) &&
         SameValues(want.segment_row, got.segment_row()) &&
         want.max_seqlen_q == got.max_seqlen_q() &&
         want.max_seqlen_k == got.max_seqlen_k();
}

int PackCommand(Connection& connection) {
  absl::StatusOr<Batch> batch = MakeBatch();
  if (!batch.ok()) return Fail(kUsage, std::string(batch.status().message()));
  absl::StatusOr<LayoutOptions> layout = LayoutFromFlags(*batch);
  if (!layout.ok()) return Fail(kUsage, std::string(layout.status().message()));
  absl::StatusOr<PackResult> r = PackInline(connection, *batch, true, *layout);
  if (!r.ok()) return Fail(kRpcError, r.status().ToString());
  // The same call again, warm: what a caller that keeps its client pays.
  const int warm_calls = std::max(0, absl::GetFlag(FLAGS_warm_calls));
  double warm_ms = 0;
  for (int i = 0; i < warm_calls; ++i) {
    absl::StatusOr<PackResult> again =
        PackInline(connection, *batch, true, *layout);
    if (!again.ok()) return Fail(kRpcError, again.status().ToString());
    if (again->packed != r->packed) {
      return Fail(kCheckFailed,
                  "pack: a warm call returned other bytes than the first");
    }
    warm_ms = i == 0 ? again->ms : std::min(warm_ms, again->ms);
  }
  const v1::PackResponse& response = r->reply.message();
  std::printf("x:            [%s] %s (%.1f MiB)\n",
              absl::StrJoin(batch->shape, ", ").c_str(),
              DTypeName(batch->dtype), batch->x.size() / 1048576.0);
  std::printf("packed:       [%s] (%.1f MiB)\n",
              absl::StrJoin(response.packed(0).shape(), ", ").c_str(),
              r->packed.size() / 1048576.0);
  std::printf("total_active: %lld   max_seqlen: %lld\n",
              static_cast<long long>(response.total_active()),
              static_cast<long long>(response.max_seqlen()));
  std::printf("cu_seqlens:   %s\n", Head(response.cu_seqlens()).c_str());
  const bool shared = layout->shared_prefix.has_value();
  if (layout->any() && !shared) {
    std::printf("cu_seqlens_padded: %s   max_seqlen_padded: %lld\n",
                Head(response.cu_seqlens_padded()).c_str(),
                static_cast<long long>(response.max_seqlen_padded()));
  }
  if (layout->any()) {
    std::printf("position_ids: %s\n", Head(response.position_ids()).c_str());
  }
  if (shared) PrintStream(*batch, absl::GetFlag(FLAGS_groups), response);
  std::printf(
      "time:         %.2f ms the first call (the connection, the first touch "
      "of fresh memory)\n",
      r->ms);
  if (warm_calls > 0) {
    std::printf("              %.2f ms a warm call (the best of %d)\n", warm_ms,
                warm_calls);
  }
  const std::string output = absl::GetFlag(FLAGS_output);
  if (!output.empty()) {
    std::ofstream f(output, std::ios::binary);
    f.write(r->packed.data(), static_cast<std::streamsize>(r->packed.size()));
    if (!f) return Fail(kUsage, "cannot write --output=" + output);
  }
  // Every byte checked against packing here, row by row; a stream's metadata
  // against the op library's.
  Layout laid;
  absl::StatusOr<std::string> want =
      layout->any() ? LaidOutBytes(*batch, *layout, &laid) : batch->Packed();
  if (!want.ok()) return Fail(kCheckFailed, want.status().ToString());
  if (r->packed != *want) {
    return Fail(kCheckFailed,
                "pack: the packed bytes differ from the rows of x the mask "
                "selects (laid out)");
  }
  if (shared && !SameStream(*laid.shared, response.shared())) {
    return Fail(kCheckFailed,
                "pack: the stream's kv_index, pred_index or cu_seqlens differ "
                "from the op library's");
  }
  std::printf("checked:      the packed bytes equal the masked rows of x%s\n",
              shared          ? " in the stream, and its metadata"
              : layout->any() ? ", laid out"
                              : "");
  return kOk;
}

// What the bench workers share.
struct BenchRun {
  const Batch* batch = nullptr;
  bool shm = false;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> calls{0};
  std::mutex mu;
  std::vector<double> latencies;  // ms, every call of every worker
  std::string error;              // the first error; it stops the run

  void Fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu);
    if (error.empty()) error = message;
    stop = true;
  }
};

// A shared-memory region registered with the server for the life of the
// object (its name unlinked once the server has mapped it).
absl::StatusOr<std::unique_ptr<ShmRegion>> BenchRegion(Connection& connection,
                                                       int64_t bytes) {
  Connection::SegmentName name = connection.NewSegmentName("packctl");
  const std::string region = name.region;
  // On a failed registration the unregister finds nothing, harmlessly.
  absl::StatusOr<std::unique_ptr<ShmRegion>> shm =
      ShmRegion::Create(std::move(name.key), region,
                        std::max<int64_t>(bytes, 1), [&connection, region] {
                          connection.UnregisterRegion(region).IgnoreError();
                        });
  if (!shm.ok()) return shm.status();
  absl::Status registered =
      connection.RegisterSegment((*shm)->segment(), region);
  if (!registered.ok()) return registered;
  return shm;
}

// The first `bytes` of `region`.
v1::RegionSlice Head(const ShmRegion& region, int64_t bytes) {
  v1::RegionSlice slice;
  region.Contains(region.At(0), bytes, &slice);
  return slice;
}

// One connection calling Pack until the run stops. Inline, each call sends x
// from the batch's own memory. With shm, x is written once into one region and
// the results land in another: nothing is copied per call.
void BenchWorker(BenchRun& run) {
  absl::StatusOr<std::unique_ptr<Connection>> connection = Connect();
  if (!connection.ok()) return run.Fail(connection.status().ToString());
  const Batch& batch = *run.batch;
  const int64_t bytes = static_cast<int64_t>(batch.x.size());
  std::unique_ptr<ShmRegion> in, out;
  v1::RegionSlice x_in, results;
  if (run.shm) {
    auto a = BenchRegion(**connection, bytes);
    if (!a.ok()) return run.Fail(a.status().ToString());
    auto b = BenchRegion(**connection, bytes);
    if (!b.ok()) return run.Fail(b.status().ToString());
    in = *std::move(a);
    out = *std::move(b);
    std::memcpy(in->At(0), batch.x.data(), bytes);
    x_in = Head(*in, bytes);
    results = Head(*out, bytes);
  }
  Wire<v1::PackRequest> request;
  PackRequestFor(batch, run.shm ? &x_in : nullptr, run.shm ? &results : nullptr,
                 &request);
  std::vector<double> mine;
  while (!run.stop) {
    Wire<v1::PackResponse> reply;
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status status =
        (*connection)->RawCall(0, kPackMethod, request, &reply);
    mine.push_back(std::chrono::duration<double, std::milli>(
                       std::chrono::steady_clock::now() - t0)
                       .count());
    if (!status.ok()) run.Fail(status.ToString());
    ++run.calls;
  }
  std::lock_guard<std::mutex> lock(run.mu);
  run.latencies.insert(run.latencies.end(), mine.begin(), mine.end());
}

// Waits until `duration` seconds pass or the run stops, with a live progress
// line on a terminal; returns the seconds elapsed.
double WaitWithProgress(BenchRun& run, double duration) {
  const auto start = std::chrono::steady_clock::now();
  const bool tty = isatty(STDERR_FILENO);
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                         start)
        .count();
  };
  while (!run.stop && elapsed() < duration) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    if (tty) {
      const int64_t calls = run.calls.load();
      std::fprintf(stderr, "\r%5.1f / %.0f s  %8lld calls  %8.1f calls/s",
                   elapsed(), duration, static_cast<long long>(calls),
                   calls / elapsed());
    }
  }
  if (tty) std::fprintf(stderr, "\n");
  return elapsed();
}

// Prints (and with --json writes) latency percentiles and throughput.
void ReportBench(std::vector<double> latencies, double seconds,
                 int64_t bytes_per_call, const std::string& transport,
                 int concurrency) {
  std::sort(latencies.begin(), latencies.end());
  auto pct = [&](double p) {
    return latencies.empty()
               ? 0.0
               : latencies[std::min(latencies.size() - 1,
                                    size_t(p * latencies.size()))];
  };
  const double max = latencies.empty() ? 0.0 : latencies.back();
  const double rate = latencies.size() / seconds;
  const double gbps = rate * bytes_per_call / 1e9;
  std::printf("transport %s, concurrency %d, %zu calls in %.1f s\n",
              transport.c_str(), concurrency, latencies.size(), seconds);
  std::printf("latency ms: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n", pct(0.5),
              pct(0.9), pct(0.99), max);
  std::printf("throughput: %.1f calls/s, %.3f GB/s of input\n", rate, gbps);
  if (absl::GetFlag(FLAGS_json).empty()) return;
  std::ofstream f(absl::GetFlag(FLAGS_json));
  f << absl::StrFormat(
      "{\"transport\": \"%s\", \"concurrency\": %d, \"calls\": %d, "
      "\"seconds\": %.3f, \"p50_ms\": %.4f, \"p90_ms\": %.4f, "
      "\"p99_ms\": %.4f, \"max_ms\": %.4f, \"calls_per_s\": %.2f, "
      "\"gbps\": %.4f}\n",
      transport, concurrency, latencies.size(), seconds, pct(0.5), pct(0.9),
      pct(0.99), max, rate, gbps);
}

int Bench() {
  absl::StatusOr<Batch> batch = MakeBatch();
  if (!batch.ok()) return Fail(kUsage, std::string(batch.status().message()));
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport != "inline" && transport != "shm") {
    return Fail(kUsage, "--transport must be inline or shm");
  }
  const int concurrency = std::max(1, absl::GetFlag(FLAGS_concurrency));
  BenchRun run;
  run.batch = &*batch;
  run.shm = transport == "shm";
  std::vector<std::thread> workers;
  for (int w = 0; w < concurrency; ++w) {
    workers.emplace_back([&run] { BenchWorker(run); });
  }
  const double seconds = WaitWithProgress(run, absl::GetFlag(FLAGS_duration));
  run.stop = true;
  for (auto& t : workers) t.join();
  if (!run.error.empty()) return Fail(kRpcError, run.error);
  ReportBench(std::move(run.latencies), seconds,
              static_cast<int64_t>(batch->x.size() + batch->mask.size()),
              transport, concurrency);
  return kOk;
}

absl::StatusOr<std::vector<int64_t>> PlanLengths() {
  std::vector<int64_t> lengths;
  const std::string file = absl::GetFlag(FLAGS_lengths_file);
  if (!file.empty()) {
    std::ifstream f(file);
    if (!f)
      return absl::InvalidArgumentError("cannot read --lengths_file=" + file);
    std::string line;
    while (std::getline(f, line)) {
      if (line.empty()) continue;
      int64_t v = 0;
      if (!absl::SimpleAtoi(line, &v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--lengths_file: \"", line, "\" is not a length"));
      }
      lengths.push_back(v);
    }
    return lengths;
  }
  std::mt19937_64 rng(std::random_device{}());
  const std::string d = absl::GetFlag(FLAGS_distribution);
  const int64_t n = std::max(0, absl::GetFlag(FLAGS_samples));
  if (d == "lognormal") return LognormalLengths(rng, n, 6.8, 1.0, 8192);
  if (d == "uniform") return UniformLengths(rng, n, 1, 4096);
  if (d == "bimodal") return BimodalLengths(rng, n - n / 8, n / 8);
  return absl::InvalidArgumentError(
      "--distribution must be lognormal, uniform or bimodal");
}

// "A,B" into the cost model's two coefficients.
absl::Status ParseCost(const std::string& text, PlanOptions* options) {
  if (text.empty()) return absl::OkStatus();
  const std::vector<std::string> parts = absl::StrSplit(text, ',');
  if (parts.size() != 2 ||
      !absl::SimpleAtod(parts[0], &options->cost_per_token) ||
      !absl::SimpleAtod(parts[1], &options->cost_per_token_squared)) {
    return absl::InvalidArgumentError(
        "--cost must be A,B (cost = A*P + B*P^2), e.g. --cost=24576,1");
  }
  return absl::OkStatus();
}

// One line per rank: a bar per micro-batch, its width its cost (the
// costliest rank spans kWidth columns, neighbours alternate # and =), then
// the rank's cost over the mean and its tokens.
void PrintPlanPicture(const v1::PlanResponse& plan, int32_t ranks) {
  constexpr int kWidth = 64;
  std::vector<double> rank_cost(ranks, 0);
  std::vector<int64_t> rank_tokens(ranks, 0);
  for (const v1::MicroBatch& mb : plan.micro_batches()) {
    rank_cost[mb.rank()] += mb.cost();
    rank_tokens[mb.rank()] += mb.tokens();
  }
  const double max = *std::max_element(rank_cost.begin(), rank_cost.end());
  double total = 0;
  for (double c : rank_cost) total += c;
  const double mean = total / ranks;
  std::printf(
      "\neach bar is a micro-batch, as wide as its cost; the costliest rank "
      "is %d columns\n",
      kWidth);
  for (int32_t r = 0; r < ranks; ++r) {
    std::string bar;
    double cumulative = 0;
    int drawn = 0, i = 0;
    for (const v1::MicroBatch& mb : plan.micro_batches()) {
      if (mb.rank() != r) continue;
      cumulative += mb.cost();
      const int end =
          max == 0 ? 0
                   : static_cast<int>(std::lround(kWidth * cumulative / max));
      bar.append(std::max(0, end - drawn), i++ % 2 == 0 ? '#' : '=');
      drawn = std::max(drawn, end);
    }
    bar.resize(kWidth, ' ');
    std::printf("rank %-4d |%s| %7.4f of mean, %lld tokens\n", r, bar.c_str(),
                mean == 0 ? 1.0 : rank_cost[r] / mean,
                static_cast<long long>(rank_tokens[r]));
  }
}

int PlanCommand(Connection& connection) {
  absl::StatusOr<std::vector<int64_t>> lengths = PlanLengths();
  if (!lengths.ok())
    return Fail(kUsage, std::string(lengths.status().message()));
  PlanOptions options;
  options.max_tokens_per_micro_batch = absl::GetFlag(FLAGS_max_tokens);
  options.num_ranks = absl::GetFlag(FLAGS_ranks);
  options.micro_batch_multiple = absl::GetFlag(FLAGS_multiple);
  options.pad_multiple = absl::GetFlag(FLAGS_pad_multiple);
  options.pipeline_order = absl::GetFlag(FLAGS_pipeline_order);
  absl::Status cost = ParseCost(absl::GetFlag(FLAGS_cost), &options);
  if (!cost.ok()) return Fail(kUsage, std::string(cost.message()));
  absl::StatusOr<v1::PlanResponse> plan =
      connection.Plan(PlanRequestOf(options, *lengths, {}));
  if (!plan.ok()) return Fail(kRpcError, plan.status().ToString());
  int64_t total = 0;
  for (int64_t v : *lengths) total += v;
  const int32_t ranks = std::max(1, options.num_ranks);
  std::printf(
      "%zu samples, %lld tokens, %d ranks, budget %lld, multiple %d, pad %lld, "
      "cost %s\n",
      lengths->size(), static_cast<long long>(total), ranks,
      static_cast<long long>(options.max_tokens_per_micro_batch),
      std::max(1, options.micro_batch_multiple),
      static_cast<long long>(std::max<int64_t>(1, options.pad_multiple)),
      absl::GetFlag(FLAGS_cost).empty()
          ? "P (tokens)"
          : absl::StrCat(options.cost_per_token, "*P + ",
                         options.cost_per_token_squared, "*P^2")
                .c_str());
  std::printf(
      "packd:       %lld micro-batches per rank (lower bound %lld), cost "
      "imbalance %.5f, token imbalance %.5f\n",
      static_cast<long long>(plan->micro_batches_per_rank()),
      static_cast<long long>(MicroBatchLowerBound(*lengths, options)),
      plan->cost_imbalance(), plan->imbalance());
  for (const auto& [name, peer] :
       {std::make_pair("verl", PlanMicroBatchesLikeVerl(*lengths, {}, options)),
        std::make_pair("slime",
                       PlanMicroBatchesLikeSlime(*lengths, {}, options))}) {
    if (!peer.ok()) continue;
    std::printf("peer %-6s  %lld micro-batches per rank, cost imbalance %.5f\n",
                name, static_cast<long long>(peer->micro_batches_per_rank),
                peer->cost_imbalance);
  }
  std::printf(
      "global_loss_tokens: %lld (divide the summed token loss by this); "
      "global_sequences: %lld (a sum of sequence-mean losses)\n",
      static_cast<long long>(plan->global_loss_tokens()),
      static_cast<long long>(plan->global_sequences()));
  PrintPlanPicture(*plan, ranks);
  return kOk;
}

// "B,S" of --batch.
absl::Status ParseBatch(int64_t* B, int64_t* S) {
  const std::vector<std::string> parts =
      absl::StrSplit(absl::GetFlag(FLAGS_batch), ',');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], B) ||
      !absl::SimpleAtoi(parts[1], S) || *B < 0 || *S <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch=", absl::GetFlag(FLAGS_batch), " is not B,S"));
  }
  return absl::OkStatus();
}

// One PackMicroBatches call on a synthetic rollout batch: token ids,
// log-probs and advantages [B, S], each row a prompt-and-response of a
// lognormal length, right-padded; labels are the token ids shifted. Prints
// the plan, its picture and when each micro-batch arrived; checks every
// micro-batch's packed token ids against its rows (exits 1 when one differs).
int StepCommand(Connection& connection) {
  int64_t B = 0, S = 0;
  if (absl::Status parsed = ParseBatch(&B, &S); !parsed.ok()) {
    return Fail(kUsage, std::string(parsed.message()));
  }
  PlanOptions plan;
  absl::Status cost = ParseCost(absl::GetFlag(FLAGS_cost), &plan);
  if (!cost.ok()) return Fail(kUsage, std::string(cost.message()));
  std::mt19937_64 rng(std::random_device{}());
  const std::vector<int64_t> lengths = LognormalLengths(rng, B, 6.8, 1.0, S);
  std::vector<uint8_t> mask(B * S, 0);
  std::vector<int64_t> tokens(B * S);
  std::vector<float> logprobs(B * S), advantages(B * S);
  std::uniform_int_distribution<int64_t> token(0, 151935);
  std::normal_distribution<float> normal;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      mask[b * S + s] = s < lengths[b];
      tokens[b * S + s] = token(rng);
      logprobs[b * S + s] = -std::abs(normal(rng));
      advantages[b * S + s] = normal(rng);
    }
  }
  Wire<v1::PackMicroBatchesRequest> request;
  v1::PackRequest* batch = request->mutable_batch();
  auto carry = [&](v1::Tensor* t, DType dtype, const void* data, size_t bytes) {
    EncodeTensorHeader(dtype, {B, S}, t);
    request.Carry(*t, Payload::Of(data, static_cast<int64_t>(bytes)));
  };
  carry(batch->mutable_mask(), DType::kBool, mask.data(), mask.size());
  carry(batch->add_inputs(), DType::kInt64, tokens.data(), tokens.size() * 8);
  carry(batch->add_inputs(), DType::kFloat32, logprobs.data(),
        logprobs.size() * 4);
  carry(batch->add_inputs(), DType::kFloat32, advantages.data(),
        advantages.size() * 4);
  batch->set_pad_multiple(absl::GetFlag(FLAGS_pad_multiple));
  v1::Shift* labels = batch->add_shifts();
  labels->set_input(0);
  labels->set_fill(-100);
  v1::PlanRequest* planned = request->mutable_plan();
  planned->set_max_tokens_per_micro_batch(absl::GetFlag(FLAGS_max_tokens));
  planned->set_num_ranks(absl::GetFlag(FLAGS_ranks));
  planned->set_micro_batch_multiple(absl::GetFlag(FLAGS_multiple));
  planned->set_cost_per_token(plan.cost_per_token);
  planned->set_cost_per_token_squared(plan.cost_per_token_squared);
  planned->set_pipeline_order(absl::GetFlag(FLAGS_pipeline_order));
  const int32_t ranks = std::max(1, absl::GetFlag(FLAGS_ranks));
  std::printf(
      "batch %lld x %lld (token ids, log-probs, advantages; labels shifted), "
      "%lld tokens, %d ranks, budget %lld\n",
      static_cast<long long>(B), static_cast<long long>(S),
      static_cast<long long>(
          std::accumulate(lengths.begin(), lengths.end(), int64_t{0})),
      ranks, static_cast<long long>(absl::GetFlag(FLAGS_max_tokens)));
  const auto start = std::chrono::steady_clock::now();
  auto ms = [&] {
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now() - start)
        .count();
  };
  int64_t received = 0, wrong = 0, bytes = 0;
  double last = 0, first = 0;
  absl::Status status = connection.RawStream(
      kPackMicroBatchesMethod, request,
      [&](const grpc::ByteBuffer& buffer) -> absl::Status {
        const double at = ms();
        bytes += static_cast<int64_t>(buffer.Length());
        Wire<v1::PackMicroBatchesResponse> reply;
        PACKD_RETURN_IF_ERROR(Receive(buffer, &reply));
        if (received++ == 0) {
          const v1::PlanResponse& p = reply->plan();
          std::printf(
              "plan at %.1f ms: %lld micro-batches per rank, cost imbalance "
              "%.5f, token imbalance %.5f, global_loss_tokens %lld\n",
              at, static_cast<long long>(p.micro_batches_per_rank()),
              p.cost_imbalance(), p.imbalance(),
              static_cast<long long>(p.global_loss_tokens()));
          PrintPlanPicture(p, ranks);
          std::printf("\n");
          last = at;
          return absl::OkStatus();
        }
        // The packed token ids are the rows' active tokens, in plan order.
        std::vector<int64_t> expected;
        for (int64_t b : reply->samples()) {
          expected.insert(expected.end(), tokens.begin() + b * S,
                          tokens.begin() + b * S + lengths[b]);
        }
        const Payload got = reply.BytesOf(reply->packed().packed(0));
        std::string flat(static_cast<size_t>(got.size), '\0');
        got.CopyOut(0, got.size, flat.data());
        if (flat.size() != expected.size() * 8 ||
            std::memcmp(flat.data(), expected.data(), flat.size()) != 0) {
          ++wrong;
        }
        if (received == 2) first = at;
        std::printf(
            "rank %-3d #%-3d %4d rows %7lld tokens  at %8.1f ms (+%.1f)\n",
            reply->rank(), reply->index(), reply->samples_size(),
            static_cast<long long>(reply->packed().total_active()), at,
            at - last);
        last = at;
        return absl::OkStatus();
      });
  if (!status.ok()) return Fail(kRpcError, status.ToString());
  const double total = ms();
  std::printf(
      "\n%lld micro-batches in %.1f ms (%.2f GB/s of replies), the first at "
      "%.1f ms\n",
      static_cast<long long>(received - 1), total, bytes / total / 1e6, first);
  if (wrong > 0) {
    return Fail(kCheckFailed,
                absl::StrCat(wrong, " micro-batches differ from their rows"));
  }
  return kOk;
}

constexpr char kUsageText[] = R"(talks to a packd server.

usage: packctl [flags] <command>

commands:
  health  Asks liveness and readiness (grpc.health.v1); exits 1 unless SERVING.
            packctl health --address=unix:/run/packd/packd.sock
  info    Prints the server's version, devices, limits and whether it takes
          shared-memory handles.
            packctl info
  probe   One small Pack round trip, its result checked byte for byte; exits 1
          when wrong or slower than --max_latency_ms (a Kubernetes exec probe).
            packctl probe --max_latency_ms=50
  pack    Packs one batch (random, or --input and --mask_file) of --shape,
          --dtype, --density and --mask; prints the packed shape, cu_seqlens
          and the time, checks every packed byte against the masked rows of x
          (exits 1 when one differs) and with --output writes them to a file.
            packctl pack --shape=16,1024,4096 --dtype=bfloat16 --density=0.3
          With --groups=G --prefix=P, a GRPO batch: rows in groups of G sharing
          a P-token prompt, packed with it once; prints the stream, what it
          saves and its attention metadata, and checks them.
            packctl pack --shape=64,2048,1 --dtype=int64 --groups=8 --prefix=1024
  bench   Pack calls at --concurrency for --duration seconds, inline or through
          shared memory (--transport); prints calls/s, GB/s, p50 and p99.
            packctl bench --concurrency=4 --duration=10 --transport=shm
  plan    Plans --samples lengths (or --lengths_file) into micro-batches of
          --max_tokens over --ranks, balanced by --cost (A,B: A*P + B*P^2)
          with --pad_multiple and --pipeline_order; prints the imbalances,
          the peers' (verl, slime), the global counts, and a picture: a line
          per rank, a bar per micro-batch as wide as its cost.
            packctl plan --samples=1024 --max_tokens=16384 --ranks=8
            packctl plan --cost=24576,1 --pad_multiple=8
  step    One PackMicroBatches call on a synthetic rollout batch (--batch=B,S of
          token ids, log-probs and advantages; labels shifted) planned over
          --ranks with --max_tokens, --cost, --pad_multiple: prints the plan,
          its picture and when each micro-batch arrived, and checks every
          micro-batch's token ids against its rows (exits 1 when one differs).
            packctl step --batch=512,4096 --ranks=8 --max_tokens=32768

Every command takes --address (HOST:PORT or unix:PATH), --deadline_ms, --attempts, a token
(--token_file, else PACKD_TOKEN in the environment) and TLS files (--tls_*).
Exit codes: 0 ok; 1 a check failed; 2 usage; 3 the server answered with an
error or could not be reached.)";

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsageText);
  // --help lists this file's flags, under the tool's name rather than the path
  // of the machine that built it.
  absl::FlagsUsageConfig config;
  // absl filters on the normalized name.
  config.normalize_filename = [](absl::string_view file) {
    return absl::EndsWith(file, "packctl.cc") ? std::string("packctl")
                                              : std::string(file);
  };
  config.contains_help_flags = [](absl::string_view file) {
    return file == "packctl";
  };
  absl::SetFlagsUsageConfig(config);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    return Fail(
        kUsage,
        "usage: packctl [flags] <health|info|probe|pack|bench|plan|step>; "
        "packctl --help says what each does");
  }
  const std::string command = args[1];
  if (command == "bench") return Bench();
  absl::StatusOr<std::unique_ptr<Connection>> connection = Connect();
  if (!connection.ok()) return Fail(kUsage, connection.status().ToString());
  if (command == "health") return Health(**connection);
  if (command == "info") return Info(**connection);
  if (command == "probe") return Probe(**connection);
  if (command == "pack") return PackCommand(**connection);
  if (command == "plan") return PlanCommand(**connection);
  if (command == "step") return StepCommand(**connection);
  return Fail(
      kUsage,
      absl::StrCat("unknown command \"", command,
                   "\": use health, info, probe, pack, bench, plan or step"));
}

}  // namespace
}  // namespace packd

int main(int argc, char** argv) { return packd::Main(argc, argv); }
