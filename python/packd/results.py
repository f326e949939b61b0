"""What packd's calls return, as Python values and torch tensors: PackResult (a PackResponse),
Plan and PlannedMicroBatch (a PlanResponse), MicroBatch (one micro-batch of a step), and
varlen_kwargs, the keyword arguments varlen attention kernels take for a result. The live
stream of a step's micro-batches is packd/step_plan.py's StepPlan.

    r = client.pack(hidden, mask, segment_ids=doc_ids, layout=packd.Layout(pad_multiple=8))
    kw = packd.varlen_kwargs(r, style="te")     # or "flash_attn", "megatron"
"""
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy
import torch

from packd.layout import Layout
from packd.v1 import pack_service_pb2 as pb

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


@dataclasses.dataclass
class SharedResult:
    """A shared stream's attention metadata and targets (docs/design.md §14), int64 tensors:
    segment n's queries are stream rows cu_seqlens_q[n] .. cu_seqlens_q[n + 1], its keys the
    stream rows kv_index[cu_seqlens_k[n] .. cu_seqlens_k[n + 1]] (a prompt's own rows; a
    response's group prompt, then its own rows); segment_row[n] is its row. Target t (a
    predicted token, row by row) is predicted by stream row pred_index[t]; row b's targets are
    target_cu_seqlens[b] .. target_cu_seqlens[b + 1]."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    kv_index: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    pred_index: torch.Tensor
    target_cu_seqlens: torch.Tensor
    segment_row: torch.Tensor


@dataclasses.dataclass
class PackResult:
    """The wire contract's PackResponse as torch tensors."""
    packed: TensorOrList            # a tensor for a tensor input, a list for a list
    cu_seqlens: torch.Tensor        # [B + 1]
    total_active: int
    max_seqlen: int
    position_ids: Optional[torch.Tensor]  # [total_active] int64 when asked
    last_index: torch.Tensor        # [B] int64, -1 for an empty row
    # With segment_ids (documents within rows), else None / 0:
    doc_cu_seqlens: Optional[torch.Tensor] = None  # [D + 1], cu_seqlens_dtype
    doc_max_seqlen: int = 0
    doc_row: Optional[torch.Tensor] = None         # [D] int64
    doc_last_index: Optional[torch.Tensor] = None  # [D] int64
    # With a layout (docs/design.md §10): packed and position_ids hold the layout's rows, and
    # cu_seqlens (doc_cu_seqlens with documents) and the maxima are extended for `fixed`.
    cu_seqlens_padded: Optional[torch.Tensor] = None  # when the layout reshapes; cu dtype
    max_seqlen_padded: int = 0
    seq_idx: Optional[torch.Tensor] = None         # [rows] int64, with with_seq_idx
    shifted: Optional[list] = None                 # shifted[j] answers shifts[j]
    # With a shared prefix: packed holds the stream (total_active its rows, cu_seqlens and
    # max_seqlen its segments'), shifted[j] one row per target, and this the metadata.
    shared: Optional[SharedResult] = None
    # With with_token_mask: [rows] uint8, 1 for a token, 0 for padding and ghost rows.
    token_mask: Optional[torch.Tensor] = None
    # With mrope: [3, rows] int64 (temporal, height, width); a pad or ghost row holds its
    # position id in all three. packd.hf gives a model [4, 1, rows]: position_ids above these.
    mrope_position_ids: Optional[torch.Tensor] = None


def varlen_kwargs(result: PackResult, style: str = "flash_attn") -> Dict[str, Any]:
    """The keyword arguments varlen attention takes for a pack result, int32, per document
    when the pack had segment ids, per row otherwise.

    style "flash_attn" (flash_attn_varlen_func and the like): cu_seqlens_q/k and
    max_seqlen_q/k; a padded layout has pad rows inside the packed tensor, which flash
    attention cannot skip, so it is a ValueError there. style "te" (TransformerEngine's THD
    format, context parallelism included): cu_seqlens_q/kv, cu_seqlens_q/kv_padded (the real
    ones when the layout pads nothing) and max_seqlen_q/kv (the padded maximum). style
    "megatron": exactly the fields of Megatron-Core's PackedSeqParams, so that
    `PackedSeqParams(**kw)` works: "te"'s, qkv_format "thd" and total_tokens (the layout's
    rows over every CP or SP rank, cu_seqlens_q_padded[-1]); with `fixed` sequences the cu
    arrays have N + 1 entries, zero-length ghosts repeating the last value (Megatron RL's
    thd_max_num_seqs). style "shared" (a shared prefix's stream, for one
    `flash_attn_varlen_func(q, k[kv_index], v[kv_index], causal=True, **kw)` call, causal
    aligned bottom-right): cu_seqlens_q/k int32, max_seqlen_q/k and kv_index (int64)."""
    if style == "shared":
        s = result.shared
        if s is None:
            raise ValueError("style=\"shared\" is for a pack with shared_prefix")
        return {"cu_seqlens_q": s.cu_seqlens_q.to(torch.int32),
                "cu_seqlens_k": s.cu_seqlens_k.to(torch.int32),
                "max_seqlen_q": s.max_seqlen_q, "max_seqlen_k": s.max_seqlen_k,
                "kv_index": s.kv_index}
    docs = result.doc_cu_seqlens is not None
    cu = (result.doc_cu_seqlens if docs else result.cu_seqlens).to(torch.int32)
    longest = result.doc_max_seqlen if docs else result.max_seqlen
    padded = result.cu_seqlens_padded
    if style in ("te", "megatron"):
        padded = cu if padded is None else padded.to(torch.int32)
        longest = max(longest, result.max_seqlen_padded)
        kwargs = {"cu_seqlens_q": cu, "cu_seqlens_kv": cu, "cu_seqlens_q_padded": padded,
                  "cu_seqlens_kv_padded": padded, "max_seqlen_q": longest,
                  "max_seqlen_kv": longest}
        if style == "megatron":
            kwargs["qkv_format"] = "thd"
            kwargs["total_tokens"] = int(padded[-1]) if padded.numel() else 0
        return kwargs
    if style != "flash_attn":
        raise ValueError("style is \"flash_attn\", \"te\", \"megatron\" or \"shared\", not %r"
                         % (style,))
    if padded is not None and not torch.equal(padded.to(cu.device, torch.int64),
                                              cu.to(torch.int64)):
        raise ValueError("this layout puts pad rows between sequences, which flash attention "
                         "would attend to: use style=\"te\" (TransformerEngine) or "
                         "pad_multiple 0")
    return {"cu_seqlens_q": cu, "cu_seqlens_k": cu,
            "max_seqlen_q": longest, "max_seqlen_k": longest}


def joined(replies: Sequence[Tuple[pb.PackResponse, dict]],
           first_rows: Sequence[int]) -> pb.PackResponse:
    """The PackResponse of a whole batch from those of its row ranges ((message, tensors) pairs,
    starting at rows `first_rows`): offsets, maxima and row numbers joined; tensors apart."""
    out = pb.PackResponse()
    for (r, _), first_row in zip(replies, first_rows):
        tokens = out.total_active
        out.cu_seqlens.extend(v + tokens for v in r.cu_seqlens[1 if out.cu_seqlens else 0:])
        out.doc_cu_seqlens.extend(
            v + tokens for v in r.doc_cu_seqlens[1 if out.doc_cu_seqlens else 0:])
        out.position_ids.extend(r.position_ids)
        out.last_index.extend(r.last_index)
        out.doc_row.extend(v + first_row for v in r.doc_row)
        out.doc_last_index.extend(r.doc_last_index)
        out.total_active = tokens + r.total_active
        out.max_seqlen = max(out.max_seqlen, r.max_seqlen)
        out.doc_max_seqlen = max(out.doc_max_seqlen, r.doc_max_seqlen)
    return out


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """A repeated int64 field as an int64 tensor of its own: through numpy's array protocol
    where the protobuf runtime offers it (upb, PyPI's: a copy, ~7 us for 20,000 values), else
    through a list (~0.9 ms for as many)."""
    if hasattr(values, "__array__"):
        return torch.from_numpy(numpy.array(values, dtype=numpy.int64))
    return torch.tensor(list(values), dtype=torch.int64)


def pack_result(reply: pb.PackResponse, packed: list, shifted: list, single: bool,
                cu_seqlens_dtype: torch.dtype, docs: bool, with_position_ids: bool,
                layout: Layout, place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
                ) -> PackResult:
    """The PackResult of a PackResponse and its packed and shifted tensors; `place` puts the
    metadata tensors where the packed ones are."""
    def ints(values, dtype=torch.int64):
        return place(int64_tensor(values).to(dtype))

    return PackResult(
        doc_cu_seqlens=ints(reply.doc_cu_seqlens, cu_seqlens_dtype) if docs else None,
        doc_max_seqlen=reply.doc_max_seqlen,
        doc_row=ints(reply.doc_row) if docs else None,
        doc_last_index=ints(reply.doc_last_index) if docs else None,
        packed=packed[0] if single else packed,
        cu_seqlens=ints(reply.cu_seqlens, cu_seqlens_dtype),
        total_active=reply.total_active,
        max_seqlen=reply.max_seqlen,
        position_ids=ints(reply.position_ids) if with_position_ids else None,
        last_index=ints(reply.last_index),
        cu_seqlens_padded=(ints(reply.cu_seqlens_padded, cu_seqlens_dtype)
                           if reply.cu_seqlens_padded else None),
        max_seqlen_padded=reply.max_seqlen_padded,
        seq_idx=ints(reply.seq_idx) if layout.with_seq_idx else None,
        shifted=list(shifted) if layout.shifts else None,
        shared=_shared_result(reply.shared, ints) if reply.HasField("shared") else None,
        token_mask=place(_bytes_tensor(reply.token_mask)) if layout.with_token_mask else None,
        mrope_position_ids=(ints(reply.mrope_position_ids).view(3, -1)
                            if layout.mrope is not None else None))


def _bytes_tensor(data: bytes) -> torch.Tensor:
    """A bytes field as a uint8 tensor of its own."""
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _shared_result(shared: pb.SharedLayout, ints: Callable[..., torch.Tensor]) -> SharedResult:
    return SharedResult(
        cu_seqlens_q=ints(shared.cu_seqlens_q), cu_seqlens_k=ints(shared.cu_seqlens_k),
        kv_index=ints(shared.kv_index), max_seqlen_q=shared.max_seqlen_q,
        max_seqlen_k=shared.max_seqlen_k, pred_index=ints(shared.pred_index),
        target_cu_seqlens=ints(shared.target_cu_seqlens), segment_row=ints(shared.segment_row))


@dataclasses.dataclass
class PlannedMicroBatch:
    """One micro-batch of a plan: its rank, its samples (rows of the batch, in packing order),
    their tokens and loss tokens, cost, and padded tokens (what the budget counts)."""
    rank: int
    samples: List[int]
    tokens: int
    loss_tokens: int
    cost: float
    padded_tokens: int


@dataclasses.dataclass
class Plan:
    """The PlanResponse as Python values (docs/design.md §9, §11). Divide the summed per-token
    loss of every micro-batch of every rank by global_loss_tokens."""
    micro_batches: List[PlannedMicroBatch]  # by rank, then position in the rank
    micro_batches_per_rank: int
    global_loss_tokens: int
    imbalance: float
    cost_imbalance: float
    global_sequences: int

    @staticmethod
    def of(response: pb.PlanResponse) -> "Plan":
        return Plan([PlannedMicroBatch(m.rank, list(m.samples), m.tokens, m.loss_tokens, m.cost,
                                       m.padded_tokens) for m in response.micro_batches],
                    response.micro_batches_per_rank, response.global_loss_tokens,
                    response.imbalance, response.cost_imbalance, response.global_sequences)


@dataclasses.dataclass
class MicroBatch:
    """One packed micro-batch of a step: `result` is exactly Pack of the batch's rows
    `samples`, in that order, with the step's options."""
    rank: int
    index: int          # its position in its rank
    samples: List[int]  # rows of the batch
    result: PackResult
