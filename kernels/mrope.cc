#include "kernels/mrope.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/pack_sizes.h"

namespace packd {
namespace {

// "row b (active position p)" of packed token k.
std::string WhereIs(absl::Span<const int64_t> row_starts, int64_t k) {
  const int64_t b = std::upper_bound(row_starts.begin(), row_starts.end(), k) -
                    row_starts.begin() - 1;
  return absl::StrCat("row ", b, " (active position ",
                      k - row_starts[std::max<int64_t>(b, 0)], ")");
}

}  // namespace

absl::Status ValidateMRope(const MRopeOptions& options, size_t inputs) {
  if (options.input < 0 || static_cast<size_t>(options.input) >= inputs) {
    return absl::InvalidArgumentError(
        absl::StrCat("mrope.input ", options.input,
                     " names no input (the call has ", inputs, ")"));
  }
  if (options.spatial_merge_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("mrope.spatial_merge_size is ", options.spatial_merge_size,
                     "; it must be at least 1"));
  }
  if (options.image_token_id == options.video_token_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mrope.image_token_id and mrope.video_token_id are both ",
        options.image_token_id, "; a vision family has one of each"));
  }
  for (size_t g = 0; g < options.grids.size(); ++g) {
    const VisionGrid& grid = options.grids[g];
    if (grid.t < 1 || grid.h < 1 || grid.w < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("mrope.grids[", g, "] (t, h, w) = (", grid.t, ", ",
                       grid.h, ", ", grid.w, "); each must be at least 1"));
    }
  }
  if (!std::isfinite(options.tokens_per_second) ||
      options.tokens_per_second < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("mrope.tokens_per_second is ", options.tokens_per_second,
                     "; it must be finite and not negative"));
  }
  for (size_t v = 0; v < options.seconds_per_grid.size(); ++v) {
    const double s = options.seconds_per_grid[v];
    if (!std::isfinite(s) || s < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("mrope.seconds_per_grid[", v, "] is ", s,
                       "; it must be finite and not negative"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> MRopePositions(
    absl::Span<const int64_t> ids, absl::Span<const int64_t> starts,
    absl::Span<const int64_t> row_starts, const MRopeOptions& options) {
  const int64_t total = ids.size();
  const int64_t m = options.spatial_merge_size;
  std::vector<int64_t> out(3 * total);
  int64_t* const t_row = out.data();
  int64_t* const h_row = t_row + total;
  int64_t* const w_row = h_row + total;
  size_t grid_index = 0, videos = 0;
  for (size_t k = 0; k + 1 < starts.size(); ++k) {
    int64_t position = 0;
    for (int64_t i = starts[k]; i < starts[k + 1];) {
      const int64_t id = ids[i];
      const bool video = id == options.video_token_id;
      if (id != options.image_token_id && !video) {
        t_row[i] = h_row[i] = w_row[i] = position++;
        ++i;
        continue;
      }
      int64_t end = i;
      while (end < starts[k + 1] && ids[end] == id) ++end;
      const char* const kind = video ? "video" : "image";
      if (options.vision_start_token_id != 0 &&
          (i == starts[k] || ids[i - 1] != options.vision_start_token_id)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "mrope: the ", kind, " tokens at ", WhereIs(row_starts, i),
            " do not follow vision_start_token_id ",
            options.vision_start_token_id));
      }
      if (grid_index >= options.grids.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "mrope.grids has ", options.grids.size(), " grids; the ", kind,
            " tokens at ", WhereIs(row_starts, i), " have none"));
      }
      const VisionGrid& grid = options.grids[grid_index];
      const int64_t lh = grid.h / m, lw = grid.w / m;
      const int64_t tokens = SaturatingMul(grid.t, SaturatingMul(lh, lw));
      if (tokens != end - i) {
        return absl::InvalidArgumentError(absl::StrCat(
            "mrope.grids[", grid_index, "] (t, h, w) = (", grid.t, ", ", grid.h,
            ", ", grid.w, ") is t * (h / ", m, ") * (w / ", m, ") = ", tokens,
            " vision tokens; ", WhereIs(row_starts, i), " has ", end - i, " ",
            kind, " tokens"));
      }
      // Qwen2.5-VL spaces a video's frames by tokens_per_second *
      // seconds_per_grid, in float32 as transformers multiplies them.
      const bool spaced = video && options.tokens_per_second > 0;
      float interval = 1;
      if (spaced) {
        const double seconds = videos < options.seconds_per_grid.size()
                                   ? options.seconds_per_grid[videos]
                                   : 1.0;
        // A double past float32's range would make the spacing inf (and
        // frame 0's offset inf * 0 = NaN); an offset past 2^52 is no position.
        const bool fits =
            options.tokens_per_second <= FLT_MAX && seconds <= FLT_MAX;
        if (fits) {
          interval = static_cast<float>(options.tokens_per_second) *
                     static_cast<float>(seconds);
        }
        if (!fits || !std::isfinite(interval) ||
            static_cast<double>(grid.t - 1) * interval >= 0x1p52) {
          return absl::InvalidArgumentError(absl::StrCat(
              "mrope: video ", videos, " at ", WhereIs(row_starts, i),
              " spaces its ", grid.t,
              " frames by tokens_per_second * seconds_per_grid = ",
              options.tokens_per_second, " * ", seconds,
              " positions (float32); its last frame's offset is past 2^52"));
        }
      }
      int64_t j = i;
      for (int64_t a = 0; a < grid.t; ++a) {
        const int64_t temporal =
            spaced ? static_cast<int64_t>(static_cast<float>(a) * interval) : a;
        for (int64_t y = 0; y < lh; ++y) {
          for (int64_t x = 0; x < lw; ++x, ++j) {
            t_row[j] = position + temporal;
            h_row[j] = position + y;
            w_row[j] = position + x;
          }
        }
      }
      position += std::max(grid.h, grid.w) / m;
      ++grid_index;
      videos += video;
      i = end;
    }
  }
  if (grid_index != options.grids.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mrope.grids has ", options.grids.size(),
                     " grids; the batch's rows have ", grid_index,
                     " runs of vision tokens"));
  }
  if (!options.seconds_per_grid.empty() &&
      options.seconds_per_grid.size() != videos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mrope.seconds_per_grid has ", options.seconds_per_grid.size(),
        " entries; the batch's rows have ", videos, " videos"));
  }
  return out;
}

GridsByRow VisionRunsByRow(absl::Span<const int64_t> ids,
                           absl::Span<const int64_t> starts,
                           absl::Span<const int64_t> row_starts,
                           const MRopeOptions& options) {
  const size_t rows = row_starts.empty() ? 0 : row_starts.size() - 1;
  std::vector<int64_t> grids(rows, 0), videos(rows, 0);
  for (size_t k = 0; k + 1 < starts.size(); ++k) {
    for (int64_t i = starts[k]; i < starts[k + 1]; ++i) {
      const int64_t id = ids[i];
      const bool vision =
          id == options.image_token_id || id == options.video_token_id;
      if (!vision || (i > starts[k] && ids[i - 1] == id)) continue;
      const size_t b =
          std::upper_bound(row_starts.begin(), row_starts.end(), i) -
          row_starts.begin() - 1;
      ++grids[b];
      videos[b] += id == options.video_token_id;
    }
  }
  GridsByRow out;
  out.grids.assign(1, 0);
  out.videos.assign(1, 0);
  for (size_t b = 0; b < rows; ++b) {
    out.grids.push_back(out.grids.back() + grids[b]);
    out.videos.push_back(out.videos.back() + videos[b]);
  }
  return out;
}

MRopeOptions MRopeOfRows(const MRopeOptions& options, const GridsByRow& by_row,
                         absl::Span<const int64_t> rows) {
  MRopeOptions out = options;
  out.grids.clear();
  out.seconds_per_grid.clear();
  for (int64_t b : rows) {
    out.grids.insert(out.grids.end(), options.grids.begin() + by_row.grids[b],
                     options.grids.begin() + by_row.grids[b + 1]);
    if (!options.seconds_per_grid.empty()) {
      out.seconds_per_grid.insert(
          out.seconds_per_grid.end(),
          options.seconds_per_grid.begin() + by_row.videos[b],
          options.seconds_per_grid.begin() + by_row.videos[b + 1]);
    }
  }
  return out;
}

std::vector<int64_t> LayOutMRope(absl::Span<const int64_t> dense,
                                 absl::Span<const TokenRun> runs,
                                 absl::Span<const int64_t> position_ids) {
  const int64_t total = dense.size() / 3;
  const int64_t rows = position_ids.size();
  std::vector<int64_t> out(3 * rows);
  int64_t j = 0;
  for (const TokenRun& run : runs) {
    for (int d = 0; d < 3; ++d) {
      int64_t* to = out.data() + d * rows + j;
      if (run.token < 0) {
        std::copy_n(position_ids.data() + j, run.count, to);
      } else {
        std::copy_n(dense.data() + d * total + run.token, run.count, to);
      }
    }
    j += run.count;
  }
  return out;
}

std::string TokenMaskOf(absl::Span<const TokenRun> runs) {
  std::string mask;
  for (const TokenRun& run : runs) {
    mask.append(run.count, run.token < 0 ? '\0' : '\1');
  }
  return mask;
}

}  // namespace packd
