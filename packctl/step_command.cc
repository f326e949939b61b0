// packctl step: one PackMicroBatches call on a synthetic rollout batch; the
// plan, its picture and when each micro-batch arrived, every micro-batch's
// token ids checked against its rows.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "packctl/packctl.h"
#include "proto/tensor_codec.h"
#include "workloads/lengths.h"

namespace packd::packctl {
namespace {

// "B,S" of --batch.
absl::Status ParseBatch(const std::string& batch, int64_t* B, int64_t* S) {
  const std::vector<std::string> parts = absl::StrSplit(batch, ',');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], B) ||
      !absl::SimpleAtoi(parts[1], S) || *B < 0 || *S <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch=", batch, " is not B,S"));
  }
  return absl::OkStatus();
}

// One PackMicroBatches call on a synthetic rollout batch: token ids,
// log-probs and advantages [B, S], each row a prompt-and-response of a
// lognormal length, right-padded; labels are the token ids shifted. Prints
// the plan, its picture and when each micro-batch arrived; checks every
// micro-batch's packed token ids against its rows (exits 1 when one differs).
}  // namespace

int StepCommand(Connection& connection, const StepCommandOptions& options) {
  int64_t B = 0, S = 0;
  if (absl::Status parsed = ParseBatch(options.batch, &B, &S); !parsed.ok()) {
    return Fail(kUsage, std::string(parsed.message()));
  }
  const PlanOptions& plan = options.plan;
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
  batch->set_pad_multiple(plan.pad_multiple);
  v1::Shift* labels = batch->add_shifts();
  labels->set_input(0);
  labels->set_fill(-100);
  v1::PlanRequest* planned = request->mutable_plan();
  planned->set_max_tokens_per_micro_batch(plan.max_tokens_per_micro_batch);
  planned->set_num_ranks(plan.num_ranks);
  planned->set_micro_batch_multiple(plan.micro_batch_multiple);
  planned->set_cost_per_token(plan.cost_per_token);
  planned->set_cost_per_token_squared(plan.cost_per_token_squared);
  planned->set_pipeline_order(plan.pipeline_order);
  const int32_t ranks = std::max(1, plan.num_ranks);
  std::printf(
      "batch %lld x %lld (token ids, log-probs, advantages; labels shifted), "
      "%lld tokens, %d ranks, budget %lld\n",
      static_cast<long long>(B), static_cast<long long>(S),
      static_cast<long long>(
          std::accumulate(lengths.begin(), lengths.end(), int64_t{0})),
      ranks, static_cast<long long>(plan.max_tokens_per_micro_batch));
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

}  // namespace packd::packctl
