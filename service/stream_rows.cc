#include "service/stream_rows.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "proto/tensor_codec.h"
#include "service/step.h"

namespace packd {

std::string GroupDigest(const v1::SubmitGroupRequest& group) {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  auto number = [&](int64_t v) { EVP_DigestUpdate(ctx, &v, sizeof(v)); };
  auto bytes = [&](absl::string_view b) {
    number(static_cast<int64_t>(b.size()));
    EVP_DigestUpdate(ctx, b.data(), b.size());
  };
  auto tensor = [&](const v1::Tensor& t, bool present) {
    number(present);
    if (!present) return;
    number(t.dtype());
    number(t.shape_size());
    for (int64_t d : t.shape()) number(d);
    bytes(t.has_data() ? t.data() : t.region().SerializeAsString());
  };
  number(group.policy_version());
  tensor(group.mask(), true);
  number(group.inputs_size());
  for (const v1::Tensor& t : group.inputs()) tensor(t, true);
  tensor(group.segment_ids(), group.has_segment_ids());
  tensor(group.loss_mask(), group.has_loss_mask());
  number(group.prefix_lengths_size());
  for (int64_t v : group.prefix_lengths()) number(v);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_DigestFinal_ex(ctx, digest, &size);
  EVP_MD_CTX_free(ctx);
  return std::string(reinterpret_cast<const char*>(digest), size);
}

StreamRows::Form StreamRows::FormOf(const TensorView& t) {
  return Form{t.dtype,
              Shape(t.shape.begin() + std::min<size_t>(2, t.shape.size()),
                    t.shape.end())};
}

absl::Status StreamRows::CheckSchema(const DecodedCall& group) const {
  if (groups_.empty()) return absl::OkStatus();
  bool same = FormOf(group.mask) == mask_ &&
              group.tensors.size() == inputs_.size() &&
              group.segment_ids.has_value() == segment_ids_.has_value() &&
              (!segment_ids_.has_value() ||
               FormOf(*group.segment_ids) == *segment_ids_);
  for (size_t i = 0; same && i < inputs_.size(); ++i) {
    same = FormOf(group.tensors[i]) == inputs_[i];
  }
  if (same) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the group's mask, segment ids and inputs must have the dtypes and "
      "tails of the step's first group (",
      inputs_.size(),
      " inputs): every micro-batch packs rows of several groups"));
}

int64_t StreamRows::RowBytes(const DecodedCall& group) {
  const int64_t g = group.mask.shape[0];
  int64_t bytes = group.mask.nbytes();
  for (const TensorView& t : group.tensors) bytes += t.nbytes();
  if (group.segment_ids.has_value()) bytes += group.segment_ids->nbytes();
  return bytes / g;
}

int64_t StreamRows::Add(const DecodedCall& group,
                        std::vector<int64_t> prefix_lengths,
                        MemoryBudget::Hold held) {
  if (groups_.empty()) {
    mask_ = FormOf(group.mask);
    for (const TensorView& t : group.tensors) inputs_.push_back(FormOf(t));
    if (group.segment_ids.has_value()) {
      segment_ids_ = FormOf(*group.segment_ids);
    }
  }
  Group kept;
  kept.first_row = rows_;
  kept.rows = group.mask.shape[0];
  kept.S = group.mask.shape[1];
  kept.data.assign(kept.rows, Row{});
  // Each row's slice of `t` into `field` of every row.
  auto split = [&](const TensorView& t,
                   const std::function<std::string*(Row&)>& field) {
    const size_t per_row = static_cast<size_t>(t.nbytes() / kept.rows);
    const char* from = static_cast<const char*>(t.data);
    for (int64_t r = 0; r < kept.rows; ++r) {
      field(kept.data[r])->assign(from + r * per_row, per_row);
    }
  };
  split(group.mask, [](Row& r) { return &r.mask; });
  for (size_t i = 0; i < group.tensors.size(); ++i) {
    split(group.tensors[i], [i, n = group.tensors.size()](Row& r) {
      r.inputs.resize(n);
      return &r.inputs[i];
    });
  }
  if (group.segment_ids.has_value()) {
    split(*group.segment_ids, [](Row& r) { return &r.segment_ids; });
  }
  kept.prefix_lengths = std::move(prefix_lengths);
  kept.arrived = absl::Now();
  kept.row_bytes = RowBytes(group);
  kept.unpacked = kept.rows;
  kept.held = std::move(held);
  held_->Increment(static_cast<double>(kept.row_bytes * kept.rows));
  rows_ += kept.rows;
  groups_.push_back(std::move(kept));
  return groups_.back().first_row;
}

const StreamRows::Group& StreamRows::GroupOf(int64_t row) const {
  auto it = std::upper_bound(
      groups_.begin(), groups_.end(), row,
      [](int64_t r, const Group& g) { return r < g.first_row; });
  return *(it - 1);
}

StreamRows::Group& StreamRows::GroupOf(int64_t row) {
  return const_cast<Group&>(std::as_const(*this).GroupOf(row));
}

v1::PackRequest StreamRows::Request(const v1::PackRequest& layout,
                                    const std::vector<int64_t>& rows,
                                    int cp_rank) const {
  v1::PackRequest request = layout;
  if (request.cp_size() > 1) request.set_cp_rank(cp_rank);
  if (request.sp_size() > 1) request.set_sp_rank(cp_rank);
  std::vector<const Group*> of;
  int64_t S = 1;
  for (int64_t row : rows) {
    of.push_back(&GroupOf(row));
    S = std::max(S, of.back()->S);
  }
  const int64_t B = static_cast<int64_t>(rows.size());
  // Each row's S_g positions, then zeros (inactive) up to S.
  auto gather =
      [&](v1::Tensor* out, const Form& form,
          const std::function<const std::string&(const Row&)>& of_row) {
        std::vector<int64_t> shape = {B, S};
        shape.insert(shape.end(), form.tail.begin(), form.tail.end());
        int64_t position = ItemSize(form.dtype);
        for (int64_t d : form.tail) position *= d;
        EncodeTensorHeader(form.dtype, shape, out);
        std::string* data = out->mutable_data();
        data->assign(static_cast<size_t>(B * S * position), '\0');
        for (int64_t j = 0; j < B; ++j) {
          const Group& g = *of[j];
          const std::string& src = of_row(g.data[rows[j] - g.first_row]);
          std::memcpy(data->data() + j * S * position, src.data(), src.size());
        }
      };
  gather(request.mutable_mask(), mask_,
         [](const Row& r) -> const std::string& { return r.mask; });
  for (size_t i = 0; i < inputs_.size(); ++i) {
    gather(request.add_inputs(), inputs_[i],
           [i](const Row& r) -> const std::string& { return r.inputs[i]; });
  }
  if (segment_ids_.has_value()) {
    gather(request.mutable_segment_ids(), *segment_ids_,
           [](const Row& r) -> const std::string& { return r.segment_ids; });
  }
  if (request.has_shared_prefix()) {
    v1::SharedPrefix* shared = request.mutable_shared_prefix();
    shared->clear_groups();
    shared->clear_prefix_lengths();
    for (int64_t j = 0; j < B; ++j) {
      shared->add_groups(of[j] - groups_.data());
      shared->add_prefix_lengths(
          of[j]->prefix_lengths[rows[j] - of[j]->first_row]);
    }
  }
  return request;
}

void StreamRows::Release(const std::vector<int64_t>& rows, Metrics* metrics) {
  const absl::Time now = absl::Now();
  const Group* last = nullptr;
  for (int64_t row : rows) {
    Group& g = GroupOf(row);
    if (&g != last) metrics->StreamGroupSent(now - g.arrived);
    last = &g;
    g.data[row - g.first_row] = Row{};
    --g.unpacked;
    MemoryBudget::ShrinkTo(g.held, g.unpacked * g.row_bytes);
    held_->Decrement(static_cast<double>(g.row_bytes));
    if (g.unpacked == 0) {
      g.data.clear();
      g.data.shrink_to_fit();
      g.held.reset();
    }
  }
}

void StreamRows::Clear() {
  groups_.clear();
  groups_.shrink_to_fit();
  held_->Set(0);
}

absl::StatusOr<DecodedGroup> DecodeGroup(const RequestDecoder& decoder,
                                         const Tenant& tenant,
                                         const v1::SubmitGroupRequest& group) {
  if (group.mask().shape_size() == 2 && group.mask().shape(0) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the group has no rows (mask is [0, ",
                     group.mask().shape(1), "]): a group is one or more rows"));
  }
  DecodedGroup d;
  d.call.device = Device::Cpu();
  d.call.tenant = tenant;
  auto decode = [&](const v1::Tensor& t,
                    absl::string_view field) -> absl::StatusOr<TensorView> {
    PACKD_ASSIGN_OR_RETURN(TensorView view,
                           decoder.DecodeTensor(t, field, &d.call));
    if (view.device.kind != DeviceKind::kCpu) {
      return absl::FailedPreconditionError(
          absl::StrCat(field,
                       " is in device memory: a streaming step's groups come "
                       "inline or in shared memory"));
    }
    return view;
  };
  PACKD_ASSIGN_OR_RETURN(d.call.mask, decode(group.mask(), "mask"));
  for (int i = 0; i < group.inputs_size(); ++i) {
    PACKD_ASSIGN_OR_RETURN(
        TensorView x, decode(group.inputs(i), absl::StrCat("inputs[", i, "]")));
    d.call.tensors.push_back(x);
  }
  if (group.has_segment_ids()) {
    PACKD_ASSIGN_OR_RETURN(d.call.segment_ids,
                           decode(group.segment_ids(), "segment_ids"));
  }
  if (group.has_loss_mask()) {
    PACKD_ASSIGN_OR_RETURN(d.loss_mask, decode(group.loss_mask(), "loss_mask"));
  }
  return d;
}

absl::StatusOr<v1::PlanRequest> MeasureGroup(
    const v1::StepOptions& options, const v1::SubmitGroupRequest& group,
    const DecodedGroup& decoded, int64_t max_message_bytes,
    const Tenant& tenant) {
  // The group as a batch of the step's layout: its tensors' headers (the
  // bytes are read through `decoded`), its prompt's lengths.
  v1::PackRequest headers = options.layout();
  headers.set_device("cpu");
  auto header = [](const v1::Tensor& t, v1::Tensor* out) {
    out->set_dtype(t.dtype());
    *out->mutable_shape() = t.shape();
  };
  header(group.mask(), headers.mutable_mask());
  for (const v1::Tensor& t : group.inputs()) header(t, headers.add_inputs());
  if (group.has_segment_ids()) {
    header(group.segment_ids(), headers.mutable_segment_ids());
  }
  const int64_t g = group.mask().shape_size() > 0 ? group.mask().shape(0) : 0;
  if (options.layout().has_shared_prefix()) {
    if (group.prefix_lengths_size() != g) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefix_lengths has ", group.prefix_lengths_size(),
          " values; the layout shares each group's prompt, so it needs one "
          "per row of mask (",
          g, ")"));
    }
    v1::SharedPrefix* shared = headers.mutable_shared_prefix();
    shared->clear_groups();
    for (int64_t r = 0; r < g; ++r) shared->add_groups(0);
    *shared->mutable_prefix_lengths() = group.prefix_lengths();
  } else if (group.prefix_lengths_size() > 0) {
    return absl::InvalidArgumentError(
        "prefix_lengths must be empty: the step's layout has no shared_prefix");
  }
  v1::PlanRequest model = options.plan();
  model.set_num_ranks(1);
  model.set_micro_batch_multiple(1);
  absl::StatusOr<v1::PlanRequest> rows =
      TrainingStep::MeasureDecoded(headers, decoded.call, decoded.loss_mask,
                                   model, max_message_bytes, tenant);
  if (!rows.ok()) {
    return absl::Status(rows.status().code(),
                        absl::StrCat("the group: ", rows.status().message()));
  }
  return rows;
}

std::vector<StreamUnit> PlanningUnits(const v1::PlanRequest& rows,
                                      int64_t first_row, int64_t group,
                                      bool shared) {
  std::vector<StreamUnit> units;
  if (!shared) {
    for (int64_t r = 0; r < rows.lengths_size(); ++r) {
      units.push_back(
          {first_row + r, rows.lengths(r), rows.loss_tokens(r), rows.costs(r)});
    }
    return units;
  }
  StreamUnit u{group, 0, 0, 0};
  for (int64_t r = 0; r < rows.lengths_size(); ++r) {
    u.length += rows.lengths(r);
    u.loss_tokens += rows.loss_tokens(r);
    u.cost += rows.costs(r);
  }
  units.push_back(u);
  return units;
}

}  // namespace packd
