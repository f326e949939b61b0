#include "kernels/pack.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/registry.h"
#include "kernels/status_macros.h"

namespace packd {
namespace {

// Checks dtype, dims, byte size, data pointer and device of one tensor; returns
// its byte size.
absl::StatusOr<int64_t> ValidateTensor(const TensorView& t,
                                       absl::string_view field,
                                       const Device& device) {
  PACKD_ASSIGN_OR_RETURN(int64_t bytes, ByteSize(t.dtype, t.shape, field));
  if (bytes > 0 && t.data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has no data for its ", bytes, " bytes"));
  }
  if (t.device != device) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is on ", t.device.ToString(),
                     " but the mask is on ", device.ToString()));
  }
  return bytes;
}

absl::Status ValidateMask(const TensorView& mask) {
  if (mask.shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("mask.shape ", ShapeString(mask.shape),
                     " must have rank 2 ([B, S]), not ", mask.shape.size()));
  }
  return ValidateTensor(mask, "mask", mask.device).status();
}

struct ByteRange {
  const char* begin;
  int64_t size;
  bool Overlaps(const ByteRange& o) const {
    return size > 0 && o.size > 0 && begin < o.begin + o.size &&
           o.begin < begin + size;
  }
};

ByteRange RangeOf(const TensorView& t) {
  return ByteRange{static_cast<const char*>(t.data), t.nbytes()};
}

// INVALID_ARGUMENT when result i's memory overlaps the mask, an input or an
// earlier result: the kernels read inputs while they write results.
absl::Status CheckNoOverlap(const std::vector<Tensor>& results, size_t i,
                            absl::Span<const TensorView> sources,
                            const TensorView& mask) {
  const std::string field = absl::StrCat("outputs[", i, "]");
  const ByteRange range = RangeOf(results[i].view);
  if (range.Overlaps(RangeOf(mask))) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " overlaps the mask"));
  }
  for (size_t j = 0; j < sources.size(); ++j) {
    if (range.Overlaps(RangeOf(sources[j]))) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " overlaps input ", j));
    }
  }
  for (size_t j = 0; j < i; ++j) {
    if (range.Overlaps(RangeOf(results[j].view))) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " overlaps outputs[", j, "]"));
    }
  }
  return absl::OkStatus();
}

// Validates caller-provided outputs against the expected shapes (the sources'
// dtypes), or places results where `allocate` says, or has the backend allocate
// them.
absl::StatusOr<std::vector<Tensor>> PrepareOutputs(
    Backend& backend, absl::Span<const TensorView> outputs,
    const OutputAllocator& allocate, absl::Span<const TensorView> sources,
    const std::vector<Shape>& shapes, const TensorView& mask) {
  std::vector<Tensor> results(sources.size());
  if (outputs.empty()) {
    for (size_t i = 0; i < sources.size(); ++i) {
      TensorView& v = results[i].view;
      v.dtype = sources[i].dtype;
      v.shape = shapes[i];
      v.device = mask.device;
      PACKD_ASSIGN_OR_RETURN(
          int64_t bytes,
          ByteSize(v.dtype, v.shape, absl::StrCat("result[", i, "]")));
      if (allocate) {
        PACKD_ASSIGN_OR_RETURN(v.data, allocate(i, bytes));
        PACKD_RETURN_IF_ERROR(CheckNoOverlap(results, i, sources, mask));
      } else {
        PACKD_ASSIGN_OR_RETURN(results[i].storage,
                               backend.Allocate(bytes, mask.device));
        v.data = results[i].storage.data();
      }
    }
    return results;
  }
  if (outputs.size() != sources.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("outputs has ", outputs.size(), " entries but there are ",
                     sources.size(), " inputs: give one per input, or none"));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    const std::string field = absl::StrCat("outputs[", i, "]");
    const TensorView& out = outputs[i];
    if (out.dtype != sources[i].dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".dtype is ", DTypeName(out.dtype),
                       " but the result is ", DTypeName(sources[i].dtype)));
    }
    if (absl::MakeConstSpan(out.shape) != absl::MakeConstSpan(shapes[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape is ", ShapeString(out.shape),
                       " but the result is ", ShapeString(shapes[i])));
    }
    PACKD_RETURN_IF_ERROR(ValidateTensor(out, field, mask.device).status());
    results[i].view = out;
    PACKD_RETURN_IF_ERROR(CheckNoOverlap(results, i, sources, mask));
  }
  return results;
}

}  // namespace

absl::Status ValidatePackArgs(const TensorView& mask,
                              absl::Span<const TensorView> inputs) {
  PACKD_RETURN_IF_ERROR(ValidateMask(mask));
  if (inputs.empty()) {
    return absl::InvalidArgumentError(
        "inputs is empty: give at least one [B, S, *tail] tensor");
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string field = absl::StrCat("inputs[", i, "]");
    const TensorView& x = inputs[i];
    if (x.shape.size() < 2 || x.shape[0] != mask.shape[0] ||
        x.shape[1] != mask.shape[1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape ", ShapeString(x.shape),
          " does not start with mask shape ", ShapeString(mask.shape)));
    }
    PACKD_RETURN_IF_ERROR(ValidateTensor(x, field, mask.device).status());
  }
  return absl::OkStatus();
}

absl::StatusOr<PackResult> Pack(const TensorView& mask,
                                absl::Span<const TensorView> inputs,
                                const PackOptions& options) {
  PACKD_RETURN_IF_ERROR(ValidatePackArgs(mask, inputs));
  PACKD_ASSIGN_OR_RETURN(Backend * backend,
                         Registry::Get("pack", mask.device, options.impl));
  PACKD_ASSIGN_OR_RETURN(std::unique_ptr<MaskPlan> plan, backend->Plan(mask));

  const int64_t total = plan->total_active();
  std::vector<Shape> shapes;
  for (const TensorView& x : inputs) {
    Shape s = x.shape;
    s.erase(s.begin());
    s[0] = total;
    shapes.push_back(std::move(s));
  }
  PackResult result;
  PACKD_ASSIGN_OR_RETURN(
      result.packed, PrepareOutputs(*backend, options.outputs, options.allocate,
                                    inputs, shapes, mask));
  for (size_t i = 0; i < inputs.size(); ++i) {
    PACKD_RETURN_IF_ERROR(
        backend->Gather(*plan, inputs[i], result.packed[i].view));
  }

  result.total_active = total;
  for (size_t b = 0; b + 1 < plan->cu_seqlens.size(); ++b) {
    result.max_seqlen = std::max(result.max_seqlen,
                                 plan->cu_seqlens[b + 1] - plan->cu_seqlens[b]);
  }
  if (options.with_position_ids) {
    // A packed token's rank among its row's active tokens: cumsum(mask != 0) -
    // 1 at that token.
    result.position_ids.resize(total);
    for (size_t b = 0; b + 1 < plan->cu_seqlens.size(); ++b) {
      for (int64_t k = plan->cu_seqlens[b]; k < plan->cu_seqlens[b + 1]; ++k) {
        result.position_ids[k] = k - plan->cu_seqlens[b];
      }
    }
  }
  result.cu_seqlens = std::move(plan->cu_seqlens);
  result.last_index = std::move(plan->last_index);
  return result;
}

absl::Status ValidateScatterArgs(const TensorView& mask,
                                 absl::Span<const TensorView> packed,
                                 const std::optional<Shape>& tail_shape) {
  PACKD_RETURN_IF_ERROR(ValidateMask(mask));
  if (packed.empty()) {
    return absl::InvalidArgumentError(
        "packed is empty: give at least one [total_active, *tail] tensor");
  }
  for (size_t i = 0; i < packed.size(); ++i) {
    const std::string field = absl::StrCat("packed[", i, "]");
    const TensorView& p = packed[i];
    if (p.shape.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape [] must have rank 1 or more ([total_active, *tail])"));
    }
    PACKD_RETURN_IF_ERROR(ValidateTensor(p, field, mask.device).status());
    if (tail_shape.has_value()) {
      const auto tail = absl::MakeConstSpan(p.shape).subspan(1);
      if (tail != absl::MakeConstSpan(*tail_shape)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tail_shape ", ShapeString(*tail_shape), " does not match ", field,
            ".shape[1:] ", ShapeString(tail)));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ScatterResult> Scatter(const TensorView& mask,
                                      absl::Span<const TensorView> packed,
                                      const ScatterOptions& options) {
  PACKD_RETURN_IF_ERROR(ValidateScatterArgs(mask, packed, options.tail_shape));
  PACKD_ASSIGN_OR_RETURN(Backend * backend,
                         Registry::Get("scatter", mask.device, options.impl));
  PACKD_ASSIGN_OR_RETURN(std::unique_ptr<MaskPlan> plan, backend->Plan(mask));

  const int64_t total = plan->total_active();
  std::vector<Shape> shapes;
  for (size_t i = 0; i < packed.size(); ++i) {
    const TensorView& p = packed[i];
    if (p.shape[0] != total) {
      return absl::InvalidArgumentError(absl::StrCat(
          "packed[", i, "].shape ", ShapeString(p.shape), " has ", p.shape[0],
          " rows but the mask has ", total, " active positions"));
    }
    Shape s = {mask.shape[0], mask.shape[1]};
    s.insert(s.end(), p.shape.begin() + 1, p.shape.end());
    PACKD_RETURN_IF_ERROR(
        ByteSize(p.dtype, s, absl::StrCat("dense[", i, "]")).status());
    shapes.push_back(std::move(s));
  }
  ScatterResult result;
  PACKD_ASSIGN_OR_RETURN(
      result.dense, PrepareOutputs(*backend, options.outputs, options.allocate,
                                   packed, shapes, mask));
  for (size_t i = 0; i < packed.size(); ++i) {
    PACKD_RETURN_IF_ERROR(
        backend->Scatter(*plan, packed[i], result.dense[i].view));
  }
  return result;
}

}  // namespace packd
