#include "service/device_pass.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "kernels/layout.h"
#include "kernels/pack.h"
#include "kernels/registry.h"
#include "service/pack_reply.h"

namespace packd {
namespace {

// Where result r of the step is read from: input r, or the shifted input.
int SourceOf(const LayoutOptions& layout, size_t inputs, size_t r) {
  return r < inputs ? static_cast<int>(r) : layout.shifts[r - inputs].input;
}

}  // namespace

bool DevicePass::Applies(const StepBatch& batch, const CallSpec& spec,
                         const ResolvedSlice* outputs, int64_t output_bytes) {
  const Device& device = batch.device();
  if (device.kind == DeviceKind::kCpu || spec.mrope.has_value()) return false;
  for (const TensorView& x : batch.call().tensors) {
    if (x.device != device) return false;
  }
  if (outputs != nullptr) return outputs->region->device() == device;
  return output_bytes <= kInlineBytes;
}

absl::StatusOr<PackResult> DevicePass::PositionsOf(size_t k) const {
  const v1::MicroBatch& mb = *sent_[k].micro_batch;
  const absl::Span<const int64_t> rows(mb.samples().data(), mb.samples_size());
  const int64_t R = static_cast<int64_t>(rows.size());
  const int64_t S = batch_.mask().shape[1];
  PACKD_ASSIGN_OR_RETURN(const GatheredRows gathered, batch_.GatherMasks(rows));
  std::vector<int64_t> dense(static_cast<size_t>(R * S));
  for (int64_t j = 0; j < R; ++j) {
    for (int64_t s = 0; s < S; ++s) dense[j * S + s] = rows[j] * S + s;
  }
  TensorView positions;
  positions.data = dense.data();
  positions.dtype = DType::kInt64;
  positions.shape = {R, S};
  CallOptions base;
  base.device = Device::Cpu();
  // No mrope: a step with it packs on the host.
  PackOptions options = spec_.OfRows(rows, GridsByRow{})
                            .PackOptionsFor(base, gathered.segment_ids);
  // -1 marks a row with no token: its pad value, or its shift's fill. The
  // prompts were compared over the whole batch when it was measured.
  options.layout.pad_values = {-1};
  for (Shift& shift : options.layout.shifts) shift = Shift{0, -1};
  if (options.layout.shared_prefix.has_value()) {
    options.layout.shared_prefix->same_inputs.clear();
  }
  return Pack({positions}, gathered.mask, options);
}

absl::Status DevicePass::WaveOnce(size_t k) const {
  const int wave = k == 0 ? 0 : 1;
  absl::MutexLock lock(&mu_);
  if (!run_[wave]) {
    run_[wave] = true;
    const absl::Time start = absl::Now();
    status_[wave] = wave == 0 ? Run(0, std::min<size_t>(1, sent_.size()))
                              : Run(1, sent_.size());
    time_ += absl::Now() - start;
  }
  return status_[wave];
}

absl::Duration DevicePass::time() const {
  absl::MutexLock lock(&mu_);
  return time_;
}

absl::Status DevicePass::Run(size_t begin, size_t end) const {
  if (begin >= end) return absl::OkStatus();
  const LayoutOptions& layout = spec_.layout;
  const size_t inputs = batch_.call().tensors.size();
  const size_t results = inputs + layout.shifts.size();
  // The spans of the wave's micro-batches, by result.
  std::vector<std::vector<CopySpan>> spans(results);
  for (size_t k = begin; k < end; ++k) {
    PACKD_ASSIGN_OR_RETURN(PackResult meta, PositionsOf(k));
    const MicroBatchPlace& sent = sent_[k];
    for (size_t r = 0; r < results; ++r) {
      const TensorView& table =
          r < inputs ? meta.packed[0].view : meta.shifted[r - inputs].view;
      const int64_t n = table.shape[0];
      if (n != sent.rows[r]) {
        return absl::InternalError(
            absl::StrCat("micro-batch ", k, ": result ", r, " has ", n,
                         " rows where the plan placed ", sent.rows[r]));
      }
      const TensorView& x = batch_.call().tensors[SourceOf(layout, inputs, r)];
      AppendRowSpans(
          absl::MakeConstSpan(static_cast<const int64_t*>(table.data), n),
          sent.offsets[r], PositionBytes(x), &spans[r]);
    }
    meta.packed.clear();
    meta.shifted.clear();
    prepared_[k] = std::move(meta);
  }
  // One table: every result's spans, then its pattern (one row of its pad
  // value or fill), each from a multiple of 16 bytes.
  auto aligned = [](int64_t n) { return (n + 15) / 16 * 16; };
  std::vector<int64_t> span_at(results), pattern_at(results);
  int64_t table_bytes = 0;
  for (size_t r = 0; r < results; ++r) {
    span_at[r] = table_bytes;
    table_bytes +=
        aligned(static_cast<int64_t>(spans[r].size() * sizeof(CopySpan)));
    pattern_at[r] = table_bytes;
    table_bytes += aligned(
        PositionBytes(batch_.call().tensors[SourceOf(layout, inputs, r)]));
  }
  const Device& device = batch_.device();
  PACKD_ASSIGN_OR_RETURN(DeviceRuntime * runtime, Registry::Runtime(device));
  PACKD_ASSIGN_OR_RETURN(Stream stream, runtime->AcquireStream(device));
  PACKD_ASSIGN_OR_RETURN(Buffer host_table,
                         runtime->AllocateHost(table_bytes, device));
  PACKD_ASSIGN_OR_RETURN(Buffer table, runtime->Allocate(table_bytes, device));
  char* const host = static_cast<char*>(host_table.data());
  for (size_t r = 0; r < results; ++r) {
    if (!spans[r].empty()) {
      std::memcpy(host + span_at[r], spans[r].data(),
                  spans[r].size() * sizeof(CopySpan));
    }
    const TensorView& x = batch_.call().tensors[SourceOf(layout, inputs, r)];
    const ElementBytes& value =
        r < inputs ? values_.pads[r] : values_.fills[r - inputs];
    const int64_t item = ItemSize(x.dtype);
    for (int64_t at = 0; at < PositionBytes(x); ++at) {
      host[pattern_at[r] + at] = static_cast<char>(value[at % item]);
    }
  }
  char* arena = outputs_;
  if (arena == nullptr && output_bytes_ > 0) {
    if (device_results_.data() == nullptr) {
      PACKD_ASSIGN_OR_RETURN(device_results_,
                             runtime->Allocate(output_bytes_, device));
      PACKD_ASSIGN_OR_RETURN(host_results_,
                             runtime->AllocateHost(output_bytes_, device));
    }
    arena = static_cast<char*>(device_results_.data());
  }
  // The wave's results in the outputs: its micro-batches' places, in order.
  const int64_t first = sent_[begin].offsets[0];
  const int64_t last =
      end < sent_.size() ? sent_[end].offsets[0] : output_bytes_;
  // Queued on the stream; the host waits once, whatever happened, before
  // any buffer the work uses is let go.
  auto queue = [&]() -> absl::Status {
    PACKD_RETURN_IF_ERROR(runtime->CopyAsync(
        table.data(), host, table_bytes, CopyDirection::kHostToDevice, stream));
    const char* on_device = static_cast<const char*>(table.data());
    for (size_t r = 0; r < results; ++r) {
      const TensorView& x = batch_.call().tensors[SourceOf(layout, inputs, r)];
      PACKD_RETURN_IF_ERROR(runtime->CopySpans(
          arena, x.data,
          reinterpret_cast<const CopySpan*>(on_device + span_at[r]),
          static_cast<int64_t>(spans[r].size()), on_device + pattern_at[r],
          PositionBytes(x), stream));
    }
    if (host_results_.data() != nullptr && last > first) {
      PACKD_RETURN_IF_ERROR(runtime->CopyAsync(
          static_cast<char*>(host_results_.data()) + first,
          static_cast<const char*>(device_results_.data()) + first,
          last - first, CopyDirection::kDeviceToHost, stream));
    }
    return absl::OkStatus();
  };
  const absl::Status queued = queue();
  const absl::Status done = runtime->Synchronize(stream);
  PACKD_RETURN_IF_ERROR(queued);
  return done;
}

absl::Status DevicePass::Message(
    size_t k, v1::PackResponse* packed, const CallOptions& base,
    const google::protobuf::RepeatedPtrField<v1::RegionSlice>& written) const {
  PACKD_RETURN_IF_ERROR(WaveOnce(k));
  const MicroBatchPlace& sent = sent_[k];
  PackResult result = std::move(prepared_[k]);
  const size_t inputs = batch_.call().tensors.size();
  for (size_t r = 0; r < sent.rows.size(); ++r) {
    const TensorView& x =
        batch_.call().tensors[SourceOf(spec_.layout, inputs, r)];
    PACKD_ASSIGN_OR_RETURN(OutputPlace place, base.allocate(r, sent.bytes[r]));
    if (outputs_ == nullptr && sent.bytes[r] > 0) {
      std::memcpy(
          place.data,
          static_cast<const char*>(host_results_.data()) + sent.offsets[r],
          sent.bytes[r]);
    }
    ResultTensor out;
    out.view.data = place.data;
    out.view.device = place.device;
    out.view.dtype = x.dtype;
    out.view.shape = x.shape;
    out.view.shape.erase(out.view.shape.begin());
    out.view.shape[0] = sent.rows[r];
    (r < inputs ? result.packed : result.shifted).push_back(std::move(out));
  }
  EncodeResults(SetPackResponse(std::move(result), packed), written,
                PackSlots(packed, inputs));
  return absl::OkStatus();
}

}  // namespace packd
