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
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "client/connection.h"
#include "packctl/packctl.h"

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
ABSL_FLAG(bool, token_mask, false,
          "pack: ask for the token mask (1 per token row, 0 per pad or ghost "
          "row), print its counts and check it");
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

namespace packd::packctl {
namespace {

// The connection the flags describe.
ClientOptions ClientOptionsFromFlags() {
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
  return options;
}

// The batch the flags describe (pack, bench).
BatchSpec BatchSpecFromFlags() {
  BatchSpec spec;
  spec.shape = absl::GetFlag(FLAGS_shape);
  spec.dtype = absl::GetFlag(FLAGS_dtype);
  spec.density = absl::GetFlag(FLAGS_density);
  spec.mask = absl::GetFlag(FLAGS_mask);
  spec.input = absl::GetFlag(FLAGS_input);
  spec.mask_file = absl::GetFlag(FLAGS_mask_file);
  spec.groups = absl::GetFlag(FLAGS_groups);
  spec.prefix = absl::GetFlag(FLAGS_prefix);
  return spec;
}

// The plan the flags ask for (plan, step); INVALID_ARGUMENT for a bad --cost.
absl::StatusOr<PlanOptions> PlanOptionsFromFlags() {
  PlanOptions options;
  options.max_tokens_per_micro_batch = absl::GetFlag(FLAGS_max_tokens);
  options.num_ranks = absl::GetFlag(FLAGS_ranks);
  options.micro_batch_multiple = absl::GetFlag(FLAGS_multiple);
  options.pad_multiple = absl::GetFlag(FLAGS_pad_multiple);
  options.pipeline_order = absl::GetFlag(FLAGS_pipeline_order);
  PACKD_RETURN_IF_ERROR(ParseCost(absl::GetFlag(FLAGS_cost), &options));
  return options;
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
    return absl::StrContains(file, "packctl/") ? std::string("packctl")
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
  if (command == "bench") {
    BenchOptions options;
    options.batch = BatchSpecFromFlags();
    options.client = ClientOptionsFromFlags();
    options.concurrency = absl::GetFlag(FLAGS_concurrency);
    options.duration = absl::GetFlag(FLAGS_duration);
    options.transport = absl::GetFlag(FLAGS_transport);
    options.json = absl::GetFlag(FLAGS_json);
    return BenchCommand(options);
  }
  absl::StatusOr<std::unique_ptr<Connection>> connection =
      Connection::Open(ClientOptionsFromFlags());
  if (!connection.ok()) return Fail(kUsage, connection.status().ToString());
  if (command == "health") return Health(**connection);
  if (command == "info") return Info(**connection);
  if (command == "probe") {
    return Probe(**connection, absl::GetFlag(FLAGS_max_latency_ms));
  }
  if (command == "pack") {
    PackCommandOptions options;
    options.batch = BatchSpecFromFlags();
    options.pad_multiple = absl::GetFlag(FLAGS_pad_multiple);
    options.cp_size = absl::GetFlag(FLAGS_cp_size);
    options.cp_rank = absl::GetFlag(FLAGS_cp_rank);
    options.fixed = absl::GetFlag(FLAGS_fixed);
    options.token_mask = absl::GetFlag(FLAGS_token_mask);
    options.warm_calls = absl::GetFlag(FLAGS_warm_calls);
    options.output = absl::GetFlag(FLAGS_output);
    return PackCommand(**connection, options);
  }
  if (command == "plan" || command == "step") {
    absl::StatusOr<PlanOptions> plan = PlanOptionsFromFlags();
    if (!plan.ok()) return Fail(kUsage, std::string(plan.status().message()));
    if (command == "step") {
      StepCommandOptions options;
      options.batch = absl::GetFlag(FLAGS_batch);
      options.plan = *plan;
      return StepCommand(**connection, options);
    }
    PlanCommandOptions options;
    options.lengths_file = absl::GetFlag(FLAGS_lengths_file);
    options.samples = absl::GetFlag(FLAGS_samples);
    options.distribution = absl::GetFlag(FLAGS_distribution);
    options.plan = *plan;
    options.by_cost = !absl::GetFlag(FLAGS_cost).empty();
    return PlanCommand(**connection, options);
  }
  return Fail(
      kUsage,
      absl::StrCat("unknown command \"", command,
                   "\": use health, info, probe, pack, bench, plan or step"));
}
}  // namespace
}  // namespace packd::packctl

int main(int argc, char** argv) { return packd::packctl::Main(argc, argv); }
