"""Multimodal rotary positions for transformers' vision-language families (docs/design.md §17):
the packd.MRope of a processor's output, so that a Pack returns, for every sequence, the
[3, rows] positions the family's get_rope_index computes.

    mrope = packd.hf.mrope_of(model.config, inputs["input_ids"], inputs["attention_mask"],
                              inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
                              inputs.get("second_per_grid_ts"))
    r = client.pack([inputs["input_ids"]], inputs["attention_mask"], with_position_ids=True,
                    mrope=mrope)
    position_ids = packd.hf.mrope_position_ids(r)    # [4, 1, rows], as the model takes them
"""
from typing import Any, List, Optional, Sequence, Tuple

import torch

from packd.layout import MRope

__all__ = ["mrope_of", "mrope_position_ids"]

# Families whose video frames are grids of their own, one per frame (timestamps between them).
_FRAME_GRIDS = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Families that space a video's frames by tokens_per_second * seconds per grid.
_SPACED = ("qwen2_5_vl",)


def _grids(thw: Optional[Any]) -> List[Tuple[int, int, int]]:
    if thw is None:
        return []
    return [tuple(int(v) for v in row) for row in torch.as_tensor(thw).tolist()]


def mrope_of(config: Any, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
             image_grid_thw: Optional[Any] = None, video_grid_thw: Optional[Any] = None,
             second_per_grid_ts: Optional[Sequence[float]] = None, input: int = 0) -> MRope:
    """The MRope of a batch as a Qwen2-VL, Qwen2.5-VL or Qwen3-VL processor returns it: the
    image and video grids interleaved in their order over the rows' active tokens (a run of
    image or video tokens takes the next of its kind), a Qwen3-VL video split into its frames,
    Qwen2.5-VL's tokens_per_second and seconds per grid. `input`: the Pack input holding
    input_ids. ValueError when the runs and the grids do not match in number."""
    vision = getattr(config, "vision_config", None)
    image_id = getattr(config, "image_token_id", None)
    video_id = getattr(config, "video_token_id", None)
    if image_id is None or video_id is None or vision is None:
        raise ValueError("mrope_of takes a vision-language config (image_token_id, "
                         "video_token_id, vision_config); %s has not all three"
                         % type(config).__name__)
    family = getattr(config, "model_type", "")
    images, videos = _grids(image_grid_thw), _grids(video_grid_thw)
    seconds = [float(s) for s in torch.as_tensor(second_per_grid_ts).tolist()] \
        if second_per_grid_ts is not None else []
    if family in _FRAME_GRIDS:
        videos = [(1, h, w) for t, h, w in videos for _ in range(t)]
    ids = torch.as_tensor(input_ids)
    mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None \
        else torch.as_tensor(attention_mask) != 0
    grids: List[Tuple[int, int, int]] = []
    next_image = next_video = 0
    for row, keep in zip(ids.tolist(), mask.tolist()):
        previous = None
        for token, active in zip(row, keep):
            if not active:
                continue
            if token in (image_id, video_id) and token != previous:
                if token == image_id:
                    if next_image >= len(images):
                        raise ValueError("the batch has more runs of image tokens than "
                                         "image_grid_thw's %d grids" % len(images))
                    grids.append(images[next_image])
                    next_image += 1
                else:
                    if next_video >= len(videos):
                        raise ValueError("the batch has more runs of video tokens than "
                                         "video_grid_thw's %d grids" % len(videos))
                    grids.append(videos[next_video])
                    next_video += 1
            previous = token
    if next_image != len(images) or next_video != len(videos):
        raise ValueError("image_grid_thw has %d grids and video_grid_thw %d; the batch's rows "
                         "have %d runs of image tokens and %d of video tokens"
                         % (len(images), len(videos), next_image, next_video))
    spaced = family in _SPACED
    return MRope(image_token_id=int(image_id), video_token_id=int(video_id), grids=grids,
                 spatial_merge_size=int(vision.spatial_merge_size),
                 vision_start_token_id=int(getattr(config, "vision_start_token_id", 0) or 0),
                 tokens_per_second=float(getattr(vision, "tokens_per_second", 0) or 0)
                 if spaced else 0.0,
                 seconds_per_grid=tuple(seconds) if spaced else (), input=input)


def mrope_position_ids(result: Any) -> torch.Tensor:
    """[4, 1, rows] int64: a Pack's position_ids (text positions, which transformers reads the
    packed sequences from) above its mrope_position_ids, as a vision-language model takes them
    for a packed batch. The Pack must have asked for both."""
    if result.position_ids is None or result.mrope_position_ids is None:
        raise ValueError("mrope_position_ids needs a Pack with with_position_ids=True and mrope")
    return torch.cat([result.position_ids.view(1, -1), result.mrope_position_ids]).unsqueeze(1)
