"""Layouts for parallel attention (docs/design.md §10): how Pack lays its rows out, and the
fields Scatter needs to invert it.

    layout = packd.Layout(pad_multiple=8, cp_size=2, cp_rank=rank, shifts=[(1, -100)])
    ulysses = packd.Layout(sp_size=4, sp_rank=rank, shifts=[(1, -100)])   # verl's SP slices
    r = client.pack([hidden, token_ids], mask, segment_ids=doc_ids, layout=layout)
    labels = r.shifted[0]                                     # next tokens, -100 at ends
    kw = packd.varlen_kwargs(r, style="te")                   # TransformerEngine THD + CP
    grpo = packd.Layout(shared_prefix=packd.SharedPrefix(group_ids, prompt_lengths, (0,)))
"""
import dataclasses
from typing import Any, Dict, Optional, Sequence, Tuple

from packd.v1 import pack_service_pb2 as pb


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """GRPO groups packed with their prompt once (docs/design.md §14). groups: one id per row,
    rows with equal ids sharing a prompt (any order); prefix_lengths: one per row, the prompt
    being the row's first P active positions (equal across a group); same_inputs: inputs whose
    prompt rows must agree across a group (checked by packd, naming the first difference);
    targets: for Scatter only, `packed` holds one row per target instead of the stream."""
    groups: Sequence[int]
    prefix_lengths: Sequence[int]
    same_inputs: Sequence[int] = ()
    targets: bool = False

    def to(self, message: pb.SharedPrefix) -> None:
        message.groups.extend(int(v) for v in self.groups)
        message.prefix_lengths.extend(int(v) for v in self.prefix_lengths)
        message.same_inputs.extend(int(v) for v in self.same_inputs)
        message.targets = bool(self.targets)


@dataclasses.dataclass(frozen=True)
class MRope:
    """Multimodal rotary positions (docs/design.md §17) of a vision-language family (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL): the result's mrope_position_ids, [3, rows], equal for every sequence
    (row, or document) to transformers' get_rope_index. image_token_id / video_token_id: the
    tokens a vision run is made of; grids: one (t, h, w) per run of vision tokens in order over
    the batch's rows (packd.hf.mrope_of builds it from a processor's output);
    spatial_merge_size: the vision tower's; vision_start_token_id: when nonzero, every run must
    follow it; tokens_per_second and seconds_per_grid (one per video): Qwen2.5-VL's temporal
    spacing; input: the input holding the token ids ([B, S], integers)."""
    image_token_id: int
    video_token_id: int
    grids: Sequence[Tuple[int, int, int]]
    spatial_merge_size: int = 2
    vision_start_token_id: int = 0
    tokens_per_second: float = 0
    seconds_per_grid: Sequence[float] = ()
    input: int = 0

    def to(self, message: pb.MRope) -> None:
        message.image_token_id = int(self.image_token_id)
        message.video_token_id = int(self.video_token_id)
        message.vision_start_token_id = int(self.vision_start_token_id)
        message.spatial_merge_size = int(self.spatial_merge_size)
        for t, h, w in self.grids:
            message.grids.add(t=int(t), h=int(h), w=int(w))
        message.tokens_per_second = float(self.tokens_per_second)
        message.seconds_per_grid.extend(float(v) for v in self.seconds_per_grid)
        message.input = int(self.input)


@dataclasses.dataclass(frozen=True)
class Layout:
    """pad_multiple: every sequence (a document with segment ids, else a row) padded to a
    multiple of it; pad_values: one per input (default zeros), in its dtype; cp_size / cp_rank:
    context parallelism, this rank's two chunks of every sequence (pad_multiple must be a
    multiple of 2 * cp_size); with_seq_idx: each output row's sequence; shifts: (input, fill)
    pairs, next-token views that stop at every sequence's end; fixed: (tokens, sequences,
    max_seqlen) for CUDA graphs, each 0 = not fixed; sp_size / sp_rank: Ulysses sequence
    parallelism, the rows padded to a multiple of sp_size by a trailing ghost and this rank's
    contiguous 1 / sp_size of them (not with cp_size); shared_prefix: a SharedPrefix, the
    stream of GRPO groups with their prompt once (then shifts are per target, with_seq_idx
    each row's group; not with padding, CP, SP, fixed or documents); with_token_mask: a 1/0
    byte per output row, 0 for padding and ghosts (for a router's auxiliary loss); mrope: an
    MRope, the rows' multimodal rotary positions. The last two are Pack's."""
    pad_multiple: int = 0
    pad_values: Optional[Sequence[float]] = None
    cp_size: int = 0
    cp_rank: int = 0
    with_seq_idx: bool = False
    shifts: Sequence[Tuple[int, float]] = ()
    fixed: Optional[Tuple[int, int, int]] = None
    sp_size: int = 0
    sp_rank: int = 0
    shared_prefix: Optional[SharedPrefix] = None
    with_token_mask: bool = False
    mrope: Optional[MRope] = None

    def __post_init__(self) -> None:
        # Lists given for shifts or fixed kept as tuples: a Layout is a value.
        object.__setattr__(self, "shifts", tuple(tuple(s) for s in self.shifts))
        if self.fixed is not None:
            object.__setattr__(self, "fixed", tuple(self.fixed))

    def for_scatter(self) -> "Layout":
        """This layout's fields that place rows, which Scatter reads to invert its Pack
        (pad_values, shifts, with_seq_idx, with_token_mask and mrope say what else the Pack
        returned)."""
        return Layout(pad_multiple=self.pad_multiple, cp_size=self.cp_size,
                      cp_rank=self.cp_rank, sp_size=self.sp_size, sp_rank=self.sp_rank,
                      fixed=self.fixed, shared_prefix=self.shared_prefix)

    def any(self) -> bool:
        return bool(self.pad_multiple or self.pad_values or self.cp_size or self.cp_rank
                    or self.sp_size or self.sp_rank or self.with_seq_idx or self.shifts
                    or (self.fixed and any(self.fixed)) or self.shared_prefix is not None
                    or self.with_token_mask or self.mrope is not None)

    def pack_kwargs(self) -> Dict[str, Any]:
        """The keywords Pack takes for this layout: {"layout": self}. Pass layout= instead."""
        return {"layout": self}

    def scatter_kwargs(self) -> Dict[str, Any]:
        """The keywords Scatter takes to invert this layout's Pack: {"layout": ...}."""
        return {"layout": self.for_scatter()}

    def _fixed(self, message: Any) -> None:
        if self.fixed:
            tokens, sequences, max_seqlen = (list(self.fixed) + [0, 0, 0])[:3]
            message.fixed.CopyFrom(pb.FixedLayout(tokens=int(tokens), sequences=int(sequences),
                                                  max_seqlen=int(max_seqlen)))

    def to_pack(self, message: pb.PackRequest) -> None:
        """Sets a PackRequest's layout fields."""
        message.pad_multiple = int(self.pad_multiple)
        if self.pad_values is not None:
            message.pad_values.extend(float(v) for v in self.pad_values)
        message.cp_size = int(self.cp_size)
        message.cp_rank = int(self.cp_rank)
        message.sp_size = int(self.sp_size)
        message.sp_rank = int(self.sp_rank)
        message.with_seq_idx = bool(self.with_seq_idx)
        for shift in self.shifts:
            source, fill = shift
            message.shifts.add(input=int(source), fill=float(fill))
        self._fixed(message)
        if self.shared_prefix is not None:
            self.shared_prefix.to(message.shared_prefix)
        message.with_token_mask = bool(self.with_token_mask)
        if self.mrope is not None:
            self.mrope.to(message.mrope)

    @classmethod
    def of(cls, message: pb.PackRequest) -> "Layout":
        """The layout a PackRequest's fields say (to_pack's inverse): what a streaming step's
        ranks read their micro-batches with."""
        fixed = message.fixed
        shared = message.shared_prefix if message.HasField("shared_prefix") else None
        mrope = message.mrope if message.HasField("mrope") else None
        return cls(
            pad_multiple=message.pad_multiple,
            pad_values=list(message.pad_values) or None,
            cp_size=message.cp_size, cp_rank=message.cp_rank,
            with_seq_idx=message.with_seq_idx,
            shifts=[(s.input, s.fill) for s in message.shifts],
            fixed=((fixed.tokens, fixed.sequences, fixed.max_seqlen)
                   if message.HasField("fixed") else None),
            sp_size=message.sp_size, sp_rank=message.sp_rank,
            shared_prefix=(SharedPrefix(list(shared.groups), list(shared.prefix_lengths),
                                        tuple(shared.same_inputs), shared.targets)
                           if shared is not None else None),
            with_token_mask=message.with_token_mask,
            mrope=(MRope(mrope.image_token_id, mrope.video_token_id,
                         [(g.t, g.h, g.w) for g in mrope.grids], mrope.spatial_merge_size,
                         mrope.vision_start_token_id, mrope.tokens_per_second,
                         tuple(mrope.seconds_per_grid), mrope.input)
                   if mrope is not None else None))

    def to_scatter(self, message: pb.ScatterRequest) -> None:
        """Sets a ScatterRequest's layout fields: those that place rows (for_scatter's), so that
        a Pack's own Layout inverts it; pad_values, shifts, with_seq_idx, with_token_mask and
        mrope say what else that Pack returned and are not sent."""
        message.pad_multiple = int(self.pad_multiple)
        message.cp_size = int(self.cp_size)
        message.cp_rank = int(self.cp_rank)
        message.sp_size = int(self.sp_size)
        message.sp_rank = int(self.sp_rank)
        self._fixed(message)
        if self.shared_prefix is not None:
            self.shared_prefix.to(message.shared_prefix)
