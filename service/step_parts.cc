#include "service/step_parts.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/layout.h"
#include "kernels/shared_prefix.h"
#include "proto/plan_codec.h"

namespace packd {

MeasuredRows MeasureRows(const PackResult& counted, std::optional<DType> loss,
                         bool documents, const PackSizes& sizes,
                         const PlanOptions& model) {
  const int64_t B = static_cast<int64_t>(counted.last_index.size());
  MeasuredRows out;
  out.rows.resize(B);
  out.extents.resize(B);
  for (int64_t b = 0; b < B; ++b) out.extents[b] = counted.last_index[b] + 1;
  const std::vector<int64_t>& cu = counted.cu_seqlens;
  if (documents) {
    for (size_t d = 0; d < counted.doc_row.size(); ++d) {
      out.rows[counted.doc_row[d]].sequences.push_back(
          counted.doc_cu_seqlens[d + 1] - counted.doc_cu_seqlens[d]);
    }
  } else {
    for (int64_t b = 0; b < B; ++b) {
      out.rows[b].sequences.push_back(cu[b + 1] - cu[b]);
    }
  }
  const char* loss_bytes =
      loss.has_value() ? static_cast<const char*>(counted.packed[0].view.data)
                       : nullptr;
  const int64_t loss_item = loss.has_value() ? ItemSize(*loss) : 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t padded = 0;
    double cost = 0;
    for (int64_t L : out.rows[b].sequences) {
      const int64_t P = sizes.PaddedRows(L);
      padded = SaturatingAdd(padded, P);
      cost += SequenceCost(model, P);
    }
    // One CP or SP rank's share of a row's rows is what one GPU holds of it.
    out.lengths.push_back(sizes.RankRows(padded));
    out.costs.push_back(cost);
    const int64_t active = cu[b + 1] - cu[b];
    out.loss_tokens.push_back(
        loss_bytes == nullptr
            ? active
            : CountNonzero(*loss, loss_bytes + cu[b] * loss_item, active));
  }
  return out;
}

absl::StatusOr<MeasuredRows> MeasureSharedRows(const PackResult& counted,
                                               std::optional<DType> loss,
                                               const LayoutOptions& layout,
                                               const PlanOptions& model) {
  LayoutOptions whole = layout;
  whole.max_rows = 0;
  const SharedPrefix& shared = *whole.shared_prefix;
  const std::vector<int64_t>& cu = counted.cu_seqlens;
  PACKD_ASSIGN_OR_RETURN(
      const Layout stream,
      MakeSharedLayout(cu, whole, /*with_position_ids=*/false));
  const SharedLayout& s = *stream.shared;
  const int64_t B = static_cast<int64_t>(counted.last_index.size());
  MeasuredRows out;
  out.rows.resize(B);
  out.lengths.assign(B, 0);
  out.costs.assign(B, 0);
  out.extents.resize(B);
  for (int64_t b = 0; b < B; ++b) out.extents[b] = counted.last_index[b] + 1;
  // Each segment costs its row (a prompt's: its group's first).
  for (size_t n = 0; n + 1 < s.cu_seqlens_q.size(); ++n) {
    const int64_t b = s.segment_row[n];
    const int64_t q = s.cu_seqlens_q[n + 1] - s.cu_seqlens_q[n];
    const int64_t k = s.cu_seqlens_k[n + 1] - s.cu_seqlens_k[n];
    out.lengths[b] += q;
    out.costs[b] += SegmentCost(model, q, k);
    out.rows[b].keys += k;
    ++out.rows[b].segments;
  }
  const char* loss_bytes =
      loss.has_value() ? static_cast<const char*>(counted.packed[0].view.data)
                       : nullptr;
  const int64_t loss_item = loss.has_value() ? ItemSize(*loss) : 0;
  for (int64_t b = 0; b < B; ++b) {
    // Row b's targets are its active tokens j >= max(P, 1).
    const int64_t active = cu[b + 1] - cu[b];
    const int64_t first =
        std::min(active, std::max<int64_t>(shared.prefix_lengths[b], 1));
    out.rows[b].targets = active - first;
    out.loss_tokens.push_back(
        loss_bytes == nullptr
            ? active - first
            : CountNonzero(*loss, loss_bytes + (cu[b] + first) * loss_item,
                           active - first));
  }
  return out;
}

absl::StatusOr<MicroBatchTables> PlaceMicroBatches(
    const v1::PlanResponse& plan, absl::Span<const int32_t> ranks,
    int32_t num_ranks, const std::vector<MeasuredRow>& rows,
    const LayoutOptions& layout, const PackSizes& sizes,
    absl::Span<const TensorView> inputs, const HostGather& gather,
    int64_t max_message_bytes) {
  const int32_t plan_ranks = std::max<int32_t>(num_ranks, 1);
  absl::flat_hash_set<int32_t> wanted;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int32_t rank = ranks[i];
    if (rank < 0 || rank >= plan_ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("ranks[", i, "] is ", rank, "; the plan has ranks 0 .. ",
                       plan_ranks - 1, " (plan.num_ranks)"));
    }
    if (!wanted.insert(rank).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("ranks[", i, "] repeats rank ", rank));
    }
  }
  MicroBatchTables out;
  std::vector<int> index(plan_ranks, 0);
  for (const v1::MicroBatch& mb : plan.micro_batches()) {
    const int at = index[mb.rank()]++;
    if (!wanted.empty() && !wanted.contains(mb.rank())) continue;
    int64_t targets = 0, entries = 0;
    std::vector<int64_t> starts = {0};
    for (int64_t b : mb.samples()) {
      for (int64_t L : rows[b].sequences) starts.push_back(starts.back() + L);
      // A shared stream's targets, keys, and per-segment arrays.
      targets += rows[b].targets;
      entries += rows[b].keys + rows[b].targets + 3 * rows[b].segments;
    }
    // The micro-batch's rows exactly: a shared stream's are its rows'
    // lengths (the plan's tokens); a layout's, its layout's (which `fixed`,
    // applying to each micro-batch, must hold); else its active tokens.
    int64_t out_rows = starts.back(), shifted_rows = out_rows;
    if (layout.shared_prefix.has_value()) {
      out_rows = mb.padded_tokens();
      shifted_rows = targets;
    } else if (layout.any()) {
      absl::StatusOr<Layout> laid = MakeLayout(starts, layout, false);
      if (!laid.ok()) {
        return absl::Status(
            laid.status().code(),
            absl::StrCat("micro-batch ", at, " of rank ", mb.rank(), ": ",
                         laid.status().message()));
      }
      out_rows = shifted_rows = laid->rows();
    }
    const int64_t reply =
        sizes.MessageBytes(out_rows, shifted_rows, mb.samples_size(),
                           static_cast<int64_t>(starts.size()) - 1, entries);
    if (reply > max_message_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "micro-batch ", at, " of rank ", mb.rank(), " would be about ", reply,
          " bytes, over the server's limit of ", max_message_bytes,
          " bytes (--max_message_bytes): lower "
          "plan.max_tokens_per_micro_batch"));
    }
    out.max_micro_batch_bytes =
        std::max(out.max_micro_batch_bytes,
                 SaturatingAdd(gather.Bytes(mb.samples_size()), reply));
    // Its results' places in the outputs, each from a multiple of 64.
    MicroBatchPlace sent{&mb, at, {}, {}, {}};
    for (size_t r = 0; r < sizes.result_row_bytes.size(); ++r) {
      const int64_t n = r < inputs.size() ? out_rows : shifted_rows;
      sent.rows.push_back(n);
      out.output_bytes = SaturatingAdd(out.output_bytes, 63) / 64 * 64;
      sent.offsets.push_back(out.output_bytes);
      const int64_t bytes = sizes.ResultTensorBytes(r, n);
      sent.bytes.push_back(bytes);
      out.output_bytes = SaturatingAdd(out.output_bytes, bytes);
    }
    out.sent.push_back(std::move(sent));
  }
  return out;
}

absl::StatusOr<Plan> PlanWithinMessage(absl::Span<const int64_t> lengths,
                                       absl::Span<const int64_t> loss_tokens,
                                       PlanOptions options,
                                       int64_t max_message_bytes) {
  options.max_micro_batches = MaxEntriesPerMessage(max_message_bytes);
  absl::StatusOr<Plan> plan = PlanMicroBatches(lengths, loss_tokens, options);
  if (plan.status().code() == absl::StatusCode::kResourceExhausted) {
    return absl::ResourceExhaustedError(
        absl::StrCat(plan.status().message(),
                     " (one response holds no more: --max_message_bytes)"));
  }
  return plan;
}

absl::Status CheckStepRequest(const v1::PackMicroBatchesRequest& request) {
  const v1::PlanRequest& asked = request.plan();
  auto must_be_empty = [](const char* field) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan.", field,
        " must be empty: packd measures every row of the batch itself"));
  };
  if (asked.lengths_size() > 0) return must_be_empty("lengths");
  if (asked.loss_tokens_size() > 0) return must_be_empty("loss_tokens");
  if (asked.costs_size() > 0) return must_be_empty("costs");
  if (asked.pad_multiple() != 0) {
    return absl::InvalidArgumentError(
        "plan.pad_multiple must be 0: rows are measured with the batch's own "
        "layout (batch.pad_multiple)");
  }
  for (const auto& [value, field] :
       {std::pair<double, const char*>{asked.cost_per_token(),
                                       "cost_per_token"},
        {asked.cost_per_token_squared(), "cost_per_token_squared"}}) {
    if (!std::isfinite(value) || value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan.", field, " is ", value, "; it must be finite and >= 0"));
    }
  }
  if (request.batch().outputs_size() > 0) {
    return absl::InvalidArgumentError(
        "batch.outputs must be empty: micro-batches come back in the stream");
  }
  return absl::OkStatus();
}

absl::StatusOr<Plan> PlanStepRows(const v1::PlanRequest& measured,
                                  const LayoutOptions& layout,
                                  int64_t max_message_bytes) {
  PlanOptions options = PlanOptionsOf(measured);
  options.loss_tokens_within_lengths = false;
  if (layout.shared_prefix.has_value()) {
    options.groups = layout.shared_prefix->groups;  // a group is one unit
  }
  absl::StatusOr<Plan> planned = PlanWithinMessage(
      LengthsOf(measured), LossTokensOf(measured), options, max_message_bytes);
  if (!planned.ok()) {
    return absl::Status(
        planned.status().code(),
        absl::StrCat("planning the batch's rows (each row one sample): ",
                     planned.status().message()));
  }
  return planned;
}

}  // namespace packd
