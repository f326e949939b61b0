// The options of multimodal rotary positions (docs/design.md §17): what a
// caller tells a Pack about a vision-language batch so that it returns the
// [3, rows] positions transformers' get_rope_index gives each sequence (the
// arithmetic: kernels/mrope.h). Plain data, shared by the clients, the codec
// and the op library.
//
//   MRopeOptions mrope;
//   mrope.image_token_id = 151655; mrope.video_token_id = 151656;
//   mrope.spatial_merge_size = 2; mrope.grids = {{1, 4, 6}, {2, 4, 4}};
#ifndef PACKD_BASE_MROPE_OPTIONS_H_
#define PACKD_BASE_MROPE_OPTIONS_H_

#include <cstdint>
#include <vector>

namespace packd {

// An image's or a video's grid of patches, before the spatial merge.
struct VisionGrid {
  int64_t t = 1;
  int64_t h = 1;
  int64_t w = 1;
};

struct MRopeOptions {
  int32_t input = 0;  // the input holding the token ids ([B, S], integers)
  int64_t image_token_id = 0;
  int64_t video_token_id = 0;
  // Nonzero: every run of vision tokens must follow this token.
  int64_t vision_start_token_id = 0;
  int64_t spatial_merge_size = 1;
  // One per run of vision tokens, in order over the batch's rows.
  std::vector<VisionGrid> grids;
  // Qwen2.5-VL's temporal spacing of video frames (0: one per frame).
  double tokens_per_second = 0;
  // One per video grid, in order (empty: 1.0 each).
  std::vector<double> seconds_per_grid;
};

}  // namespace packd

#endif  // PACKD_BASE_MROPE_OPTIONS_H_
