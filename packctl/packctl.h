// packctl's shared core (packctl/): its exit codes, the synthetic or
// file-read batch its pack, probe and bench commands send, and the reference
// each checks the server's bytes against, then one entry point per command,
// each in its own file and handed its options (main.cc parses the flags; no
// command reads one).
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(Batch batch, MakeBatch(spec));
//   return PackCommand(connection, options);   // 0 ok, 1 check failed, 2 usage, 3 RPC error
// clang-format on
#ifndef PACKD_PACKCTL_PACKCTL_H_
#define PACKD_PACKCTL_PACKCTL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "base/layout_options.h"
#include "client/connection.h"
#include "planner/planner.h"
#include "proto/grpc_wire.h"

namespace packd::packctl {

constexpr int kOk = 0, kCheckFailed = 1, kUsage = 2, kRpcError = 3;

// Prints "packctl: message" to stderr; returns `code`.
int Fail(int code, const std::string& message);

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
  std::string Packed() const;
};

// What a batch is made of: --shape, --dtype, --density, --mask, --input,
// --mask_file, --groups and --prefix. This and the options structs below are
// filled field by field from the flags in main.cc, whose defaults are the only
// ones.
struct BatchSpec {
  std::string shape;  // B,S[,tail...]
  std::string dtype;
  double density = 0;
  std::string mask;       // prefix or holes
  std::string input;      // x's raw bytes, else random
  std::string mask_file;  // B*S bytes, else generated
  int groups = 0;         // GRPO groups of rows sharing a prompt
  int64_t prefix = 0;     // the groups' prompt length
};

// The batch `spec` asks for: x random (a bool 0 or 1) or read from --input,
// the mask generated (workloads/mask_patterns.h; with groups, a prompt of
// `prefix` then a response per row, every member's prompt its group's first
// row's) or read from --mask_file. INVALID_ARGUMENT names the flag at fault.
absl::StatusOr<Batch> MakeBatch(const BatchSpec& spec);

// A Pack request for `batch` with x's bytes inline (in place) or, when `x_in`
// is given, as that slice of a registered region, and the results in
// `results` when given. The batch outlives every request made from it.
void PackRequestFor(const Batch& batch, const v1::RegionSlice* x_in,
                    const v1::RegionSlice* results,
                    Wire<v1::PackRequest>* request);

// A Pack of a batch inline: the reply, its packed bytes and the milliseconds
// the call took.
struct PackResult {
  Wire<v1::PackResponse> reply;
  std::string packed;
  double ms = 0;
};
// `with_token_mask`: the response's token_mask too.
absl::StatusOr<PackResult> PackInline(Connection& connection,
                                      const Batch& batch,
                                      bool with_position_ids,
                                      const LayoutOptions& layout = {},
                                      bool with_token_mask = false);

// "A,B" into the cost model's two coefficients (empty: unchanged).
absl::Status ParseCost(const std::string& text, PlanOptions* options);

// One line per rank: a bar per micro-batch, its width its cost (the costliest
// rank spans 64 columns, neighbours alternate # and =), then the rank's cost
// over the mean and its tokens.
void PrintPlanPicture(const v1::PlanResponse& plan, int32_t ranks);

// health, info, probe (health_info_probe.cc).
int Health(Connection& connection);
int Info(Connection& connection);
int Probe(Connection& connection, double max_latency_ms);

// pack (pack_command.cc): one batch, with a layout.
struct PackCommandOptions {
  BatchSpec batch;
  int64_t pad_multiple = 0;
  int cp_size = 0;
  int cp_rank = 0;
  std::string fixed;        // TOKENS,SEQUENCES,MAX_SEQLEN
  bool token_mask = false;  // ask for it, count and check it
  int warm_calls = 0;       // after the first, timed apart from it
  std::string output;       // the packed bytes of x, written here
};
int PackCommand(Connection& connection, const PackCommandOptions& options);

// bench (bench_command.cc): Pack calls on connections of its own.
struct BenchOptions {
  BatchSpec batch;
  ClientOptions client;
  int concurrency = 0;
  double duration = 0;    // seconds
  std::string transport;  // inline or shm
  std::string json;       // the summary, also written here
};
int BenchCommand(const BenchOptions& options);

// plan (plan_command.cc): lengths from a file or generated, planned.
struct PlanCommandOptions {
  std::string lengths_file;
  int samples = 0;
  std::string distribution;  // lognormal, uniform or bimodal
  PlanOptions plan;      // budget, ranks, multiple, pad, pipeline order, cost
  bool by_cost = false;  // --cost was given
};
int PlanCommand(Connection& connection, const PlanCommandOptions& options);

// step (step_command.cc): one PackMicroBatches call on a synthetic rollout.
struct StepCommandOptions {
  std::string batch;  // B,S
  PlanOptions plan;
};
int StepCommand(Connection& connection, const StepCommandOptions& options);

}  // namespace packd::packctl

#endif  // PACKD_PACKCTL_PACKCTL_H_
