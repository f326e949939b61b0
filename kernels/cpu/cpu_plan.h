// The CPU backend's plan of a mask (kernels/cpu/cpu_backend.cc): the mask
// scanned once into [B * S] flags, cu_seqlens, last_index and the runs of
// consecutive active positions, and the documents of segment ids cut along it.
// Not API: cpu_backend.h is.
//
//   PACKD_ASSIGN_OR_RETURN(std::unique_ptr<CpuPlan> plan, ScanMaskPlan(mask));
//   for (const Run& run : plan->runs()) { /* copy run.len rows */ }
#ifndef PACKD_KERNELS_CPU_CPU_PLAN_H_
#define PACKD_KERNELS_CPU_CPU_PLAN_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/buffer.h"
#include "base/status_macros.h"
#include "base/tensor_view.h"
#include "kernels/backend.h"

namespace packd::cpu_internal {

// A run of consecutive active positions: flattened dense positions [src, src +
// len) map to packed rows [dst, dst + len). Runs may cross batch rows: the
// layout is contiguous across them.
struct Run {
  int64_t src;
  int64_t dst;
  int64_t len;
};

// [B * S] flags, 1 where mask != 0, in pooled memory: a fresh allocation of
// them would cost a page fault per 4 KiB every call, and zeroing them another
// pass; the scan writes every one.
class Flags {
 public:
  absl::Status Allocate(int64_t n) {
    PACKD_ASSIGN_OR_RETURN(buffer_, HostBufferPool::Global().Acquire(n));
    size_ = n;
    return absl::OkStatus();
  }
  uint8_t* data() { return static_cast<uint8_t*>(buffer_.data()); }
  const uint8_t* data() const {
    return static_cast<const uint8_t*>(buffer_.data());
  }
  uint8_t operator[](int64_t i) const { return data()[i]; }
  int64_t size() const { return size_; }

 private:
  Buffer buffer_;
  int64_t size_ = 0;
};

class CpuPlan : public MaskPlan {
 public:
  Flags active;  // [B * S], 1 where mask != 0
  int64_t num_runs = 0;
  // Runs of active positions within each row (a run that continues from the
  // row before counts here too): a row of one run needs no search for it.
  std::vector<int64_t> row_runs;

  // Built on first use: only the run-copy path needs them.
  const std::vector<Run>& runs() const {
    absl::call_once(runs_once_, [this] { BuildRuns(); });
    return runs_;
  }

 private:
  void BuildRuns() const;

  mutable absl::once_flag runs_once_;
  mutable std::vector<Run> runs_;
};

// Eight flags of 1, as one word.
constexpr uint64_t kOnes = 0x0101010101010101ULL;

inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The plan of a [B, S] mask on the host, any dtype (nonzero is active, -0.0
// is not), scanned across ThreadPool::Global() when large.
absl::StatusOr<std::unique_ptr<CpuPlan>> ScanMaskPlan(const TensorView& mask);

// The documents of `segment_ids` ([B, S], an integer dtype) along `plan`: a
// document starts at a row's first token and wherever the id changes.
void CutDocumentsOf(const CpuPlan& plan, const TensorView& segment_ids,
                    DocumentCuts* out);

}  // namespace packd::cpu_internal

#endif  // PACKD_KERNELS_CPU_CPU_PLAN_H_
