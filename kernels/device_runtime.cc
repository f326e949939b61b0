#include "kernels/device_runtime.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace packd {

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (release_) release_(handle_);
    device_ = other.device_;
    handle_ = other.handle_;
    release_ = std::move(other.release_);
    held_ = std::move(other.held_);
    other.handle_ = nullptr;
    other.release_ = nullptr;
  }
  return *this;
}

Stream::~Stream() {
  if (release_) release_(handle_);
}

absl::StatusOr<Stream> DeviceRuntime::AcquireStream(const Device& device) {
  return Stream(device, nullptr, nullptr);
}

absl::Status DeviceRuntime::Synchronize(const Stream& stream) {
  stream.ReleaseHeld();
  return absl::OkStatus();
}

absl::StatusOr<Buffer> DeviceRuntime::AllocateHost(int64_t bytes,
                                                   const Device&) {
  return HostBufferPool::Global().Acquire(static_cast<size_t>(bytes));
}

absl::Status DeviceRuntime::CopyAsync(void* dst, const void* src, int64_t bytes,
                                      CopyDirection, const Stream&) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

void AppendRowSpans(absl::Span<const int64_t> rows, int64_t to,
                    int64_t row_bytes, std::vector<CopySpan>* spans) {
  if (row_bytes == 0) return;
  // Whole runs first, then each cut into pieces.
  std::vector<CopySpan> runs;
  for (size_t j = 0; j < rows.size(); ++j) {
    const int64_t from = rows[j] < 0 ? -1 : rows[j] * row_bytes;
    const int64_t at = to + static_cast<int64_t>(j) * row_bytes;
    if (!runs.empty()) {
      CopySpan& last = runs.back();
      const bool pads = from < 0 && last.from < 0;
      const bool follows =
          from >= 0 && last.from >= 0 && last.from + last.bytes == from;
      if (pads || follows) {
        last.bytes += row_bytes;
        continue;
      }
    }
    runs.push_back(CopySpan{at, from, row_bytes});
  }
  for (const CopySpan& run : runs) {
    const int64_t piece =
        run.from >= 0
            ? kMaxSpanBytes
            : std::max<int64_t>(1, kMaxSpanBytes / row_bytes) * row_bytes;
    for (int64_t at = 0; at < run.bytes; at += piece) {
      spans->push_back(CopySpan{run.to + at, run.from < 0 ? -1 : run.from + at,
                                std::min(piece, run.bytes - at)});
    }
  }
}

void RunCopySpans(void* dst, const void* src, const CopySpan* spans,
                  int64_t count, const void* pattern, int64_t pattern_bytes) {
  char* out = static_cast<char*>(dst);
  const char* in = static_cast<const char*>(src);
  const char* fill = static_cast<const char*>(pattern);
  for (int64_t i = 0; i < count; ++i) {
    const CopySpan& span = spans[i];
    if (span.from >= 0) {
      std::memcpy(out + span.to, in + span.from, span.bytes);
      continue;
    }
    for (int64_t at = 0; at < span.bytes; at += pattern_bytes) {
      std::memcpy(out + span.to + at, fill,
                  std::min(pattern_bytes, span.bytes - at));
    }
  }
}

absl::Status DeviceRuntime::CopySpans(void* dst, const void* src,
                                      const CopySpan* spans, int64_t count,
                                      const void* pattern,
                                      int64_t pattern_bytes, const Stream&) {
  RunCopySpans(dst, src, spans, count, pattern, pattern_bytes);
  return absl::OkStatus();
}

void ForEachRowRun(
    absl::Span<const int64_t> rows,
    const std::function<void(int64_t to, int64_t from, int64_t count)>& copy) {
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t j = 0; j < n;) {
    int64_t end = j + 1;
    while (end < n && rows[end] == rows[end - 1] + 1) ++end;
    copy(j, rows[j], end - j);
    j = end;
  }
}

absl::StatusOr<DeviceMapping> DeviceRuntime::OpenIpcMemory(absl::string_view,
                                                           const Device& device,
                                                           uint64_t) {
  return absl::FailedPreconditionError(absl::StrCat(
      "IPC memory handles are for GPU devices, not ", device.ToString()));
}

namespace {

class HostRuntime : public DeviceRuntime {
 public:
  DeviceKind kind() const override { return DeviceKind::kCpu; }

  std::vector<DeviceInfo> ListDevices() const override {
    DeviceInfo cpu;
    cpu.memory_bytes = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                       static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    return {cpu};
  }

  absl::Status CheckDevice(const Device& device) const override {
    if (device == Device::Cpu()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", device.ToString(), " is not available: host memory is cpu"));
  }

  absl::StatusOr<Buffer> Allocate(int64_t bytes, const Device&) override {
    return HostBufferPool::Global().Acquire(static_cast<size_t>(bytes));
  }

  absl::Status CopyToDevice(void* dst, const void* src, int64_t bytes,
                            const Stream&) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  absl::Status CopyToHost(void* dst, const void* src, int64_t bytes,
                          const Stream&) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  absl::Status CopyRows(void* dst, const void* src,
                        absl::Span<const int64_t> rows, int64_t row_bytes,
                        const Stream&) override {
    if (row_bytes == 0) return absl::OkStatus();
    ForEachRowRun(rows, [&](int64_t to, int64_t from, int64_t count) {
      std::memcpy(static_cast<char*>(dst) + to * row_bytes,
                  static_cast<const char*>(src) + from * row_bytes,
                  count * row_bytes);
    });
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<DeviceRuntime> MakeHostRuntime() {
  return std::make_unique<HostRuntime>();
}

}  // namespace packd
