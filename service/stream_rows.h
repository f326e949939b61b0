// StreamRows: the rows a streaming step (service/stream_step.h) holds, group
// by group in the order it took them, each row's tensors in the step's memory
// from the moment its group is taken until every CP or SP rank of its
// micro-batch has packed it, and counted in --max_inflight_bytes until then.
// A micro-batch's rows come back as one Pack request of the step's layout.
//
// clang-format off
//   PACKD_RETURN_IF_ERROR(rows.CheckSchema(call));
//   const int64_t first = rows.Add(call, prefix_lengths, std::move(hold));
//   core->DoPack(rows.Request(layout, {first, first + 1}, cp_rank), &packed);
//   rows.Release({first, first + 1}, &metrics);
// clang-format on
#ifndef PACKD_SERVICE_STREAM_ROWS_H_
#define PACKD_SERVICE_STREAM_ROWS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/tensor_view.h"
#include "packd/v1/pack_service.pb.h"
#include "planner/stream_planner.h"
#include "prometheus/gauge.h"
#include "service/memory_budget.h"
#include "service/metrics.h"
#include "service/request_decoder.h"
#include "service/tenant.h"

namespace packd {

// A submitted group's tensors decoded where they are (inline, or in the
// tenant's host regions, kept mapped while it lives), and its loss mask.
struct DecodedGroup {
  DecodedCall call;
  std::optional<TensorView> loss_mask;
};
// Decodes `group` once for both its measure and its copy: INVALID_ARGUMENT
// for a group without rows, the decoder's errors naming the group's fields,
// FAILED_PRECONDITION for a tensor in device memory.
absl::StatusOr<DecodedGroup> DecodeGroup(const RequestDecoder& decoder,
                                         const Tenant& tenant,
                                         const v1::SubmitGroupRequest& group);
// Its rows measured with the step's layout as PackMicroBatches measures a
// batch's, without a plan: the plan request `options.plan` (the cost model)
// with each row's length, loss tokens and cost. INVALID_ARGUMENT for prefix
// lengths that do not fit the layout, and the measure's errors (prefixed "the
// group: ").
absl::StatusOr<v1::PlanRequest> MeasureGroup(
    const v1::StepOptions& options, const v1::SubmitGroupRequest& group,
    const DecodedGroup& decoded, int64_t max_message_bytes,
    const Tenant& tenant);

// The planner's units of a group measured (MeasureGroup's `rows`): each row,
// its id the step row (`first_row` onwards); or, where the layout shares the
// group's prompt (`shared`), the whole group as one unit, its id `group`.
std::vector<StreamUnit> PlanningUnits(const v1::PlanRequest& rows,
                                      int64_t first_row, int64_t group,
                                      bool shared);

// What a group_key's repeat must equal: a digest of the group's policy
// version, tensors (dtype, shape, then their bytes or their handle) and
// prefix lengths.
std::string GroupDigest(const v1::SubmitGroupRequest& group);

// Not safe to share across threads: its owner serialises every call.
class StreamRows {
 public:
  // `held`: the step's gauge of its groups' bytes.
  explicit StreamRows(prometheus::Gauge* held) : held_(held) {}

  // OK for the step's first group; for a later one, INVALID_ARGUMENT unless
  // its mask, segment ids and inputs have the first's dtypes and tails.
  absl::Status CheckSchema(const DecodedCall& group) const;
  // What one row of `group` holds of the budget: its mask, inputs and
  // segment ids.
  static int64_t RowBytes(const DecodedCall& group);
  // Copies `group`'s rows (decoded, in host memory) into the step's memory,
  // `held` their bytes in the budget; returns its first step row.
  int64_t Add(const DecodedCall& group, std::vector<int64_t> prefix_lengths,
              MemoryBudget::Hold held);

  // The Pack request of step rows `rows` (ascending, none released) with
  // `layout`, for CP or SP rank `cp_rank`: each row's positions, then
  // inactive ones up to the longest row's; with a shared-prefix layout, each
  // group its own, with its rows' prefix lengths.
  v1::PackRequest Request(const v1::PackRequest& layout,
                          const std::vector<int64_t>& rows, int cp_rank) const;
  // Every CP or SP rank has packed `rows`: their bytes go, and the metrics
  // hear how long their groups waited.
  void Release(const std::vector<int64_t>& rows, Metrics* metrics);
  // Forgets every row (the step has ended).
  void Clear();

  int64_t groups() const { return static_cast<int64_t>(groups_.size()); }
  int64_t rows() const { return rows_; }
  // Rows of group `index`: first_row .. first_row + size - 1.
  int64_t first_row(int64_t index) const { return groups_[index].first_row; }
  int64_t size(int64_t index) const { return groups_[index].rows; }

 private:
  struct Row {
    std::string mask, segment_ids;
    std::vector<std::string> inputs;
  };
  struct Group {
    int64_t first_row = 0;
    int64_t rows = 0;
    int64_t S = 0;
    std::vector<Row> data;
    std::vector<int64_t> prefix_lengths;
    absl::Time arrived;
    int64_t row_bytes = 0;    // what each row holds of the budget
    int64_t unpacked = 0;     // rows not yet released: they hold its bytes
    MemoryBudget::Hold held;  // unpacked * row_bytes
  };
  // A tensor's dtype and tail (its shape after [g, S]).
  struct Form {
    DType dtype = DType::kUnspecified;
    Shape tail;
    friend bool operator==(const Form& a, const Form& b) {
      return a.dtype == b.dtype && a.tail == b.tail;
    }
  };
  static Form FormOf(const TensorView& t);
  const Group& GroupOf(int64_t row) const;
  Group& GroupOf(int64_t row);

  prometheus::Gauge* const held_;
  std::vector<Group> groups_;
  int64_t rows_ = 0;
  // The first group's mask, inputs and segment ids: every later one's match.
  Form mask_;
  std::vector<Form> inputs_;
  std::optional<Form> segment_ids_;
};

}  // namespace packd

#endif  // PACKD_SERVICE_STREAM_ROWS_H_
