#include "client/region_arena.h"

#include <utility>

#include "base/status_macros.h"

namespace packd {

absl::StatusOr<std::unique_ptr<RegionArena>> RegionArena::Create(
    std::string key, std::string region, int64_t bytes,
    std::function<void()> on_close) {
  return CreateAs<RegionArena>(std::move(key), std::move(region), bytes,
                               std::move(on_close));
}

absl::Status RegionArena::Init(std::string key, std::string region,
                               int64_t bytes, std::function<void()> on_close) {
  PACKD_ASSIGN_OR_RETURN(segment_, ShmMapping::Create(std::move(key), bytes));
  region_ = std::move(region);
  data_ = segment_->data();
  size_ = bytes;
  on_close_ = std::move(on_close);
  return absl::OkStatus();
}

RegionArena::~RegionArena() {
  if (on_close_) on_close_();
}

char* RegionArena::Allocate(int64_t bytes) {
  const int64_t start = (used_ + 63) / 64 * 64;
  if (bytes < 0 || start + bytes > size_) return nullptr;
  used_ = start + bytes;
  return data_ + start;
}

bool RegionArena::Contains(const void* p, int64_t bytes,
                           v1::RegionSlice* slice) const {
  const char* c = static_cast<const char*>(p);
  if (c < data_ || bytes < 0 || c + bytes > data_ + size_) return false;
  slice->set_region(region_);
  slice->set_offset(static_cast<uint64_t>(c - data_));
  slice->set_byte_size(static_cast<uint64_t>(bytes));
  return true;
}

}  // namespace packd
