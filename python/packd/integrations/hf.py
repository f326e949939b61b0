"""Hugging Face drop-ins run by packd.

    from packd.hf import DataCollatorWithFlattening   # instead of transformers'
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [9, 8]}])

`DataCollatorWithFlattening` behaves as transformers' collator of that name (5.x, tested against
it side by side): the features with tokens (empty ones are left out) are concatenated into one
row, `input_ids`, `labels` and `position_ids` (from `position_ids_start`) int64 `[1, N]`,
`seq_idx` int32 `[1, N]`, `cu_seq_lens_q` / `cu_seq_lens_k` int32 `[features + 1]` and
`max_length_q` / `max_length_k` Python ints; with `return_tensors="np"` (in the constructor or
the call) the same as numpy arrays. The features are packed by packd: one Pack of the padded
batch, whose rows are the features. One difference, on purpose: a feature whose `labels` are not
as long as its `input_ids` is a ValueError, where transformers' would misalign the two rows.

Extensions (docs/design.md §10): `pad_multiple=` pads each feature to a multiple of it (pad
tokens carry `pad_token_id` in input_ids, `separator_id` in labels, and positions that go on
counting through the padding), `cp_size=` / `cp_rank=` keep the context-parallel rank's slices;
`cu_seq_lens_q/k` are then the padded whole sequences' (with CP too, as Transformer Engine's
context-parallel attention takes them) and `max_length_q/k` the longest padded one.

`register_varlen_attention()` registers `attn_implementation="packd_varlen"`: each packed
sequence's attention alone, on any device, without flash-attn (packd/integrations/varlen.py says
where it finds the sequences and what it refuses). `packed_row(result)` gives a model call a Pack's (or a
micro-batch's) position ids and transformers' flash-attention kwargs, and declares the row's
sequences while it is open, so that packd_varlen refuses a family through which neither
reaches it instead of attending across documents. `mrope_of()` gives a vision-language batch's
packd.MRope, and `mrope_position_ids()` a Pack's [4, 1, rows] position ids for the model (packd/_mrope.py)."""
import contextlib
import dataclasses
from typing import Any, Dict, Iterator, Optional, Sequence

import torch

from packd import _default
from packd._mrope import mrope_of, mrope_position_ids
from packd.integrations.checks import check_model, position_offset
from packd.integrations.documents import declared_sequences
from packd.integrations.probe import LeakFound, probe as _probe
from packd.integrations.stateful import bound_states
from packd.integrations.varlen import (register_varlen_attention, shared_attention_kwargs,
                                       varlen_attention)
from packd.client import Client
from packd.layout import Layout

__all__ = ["DataCollatorWithFlattening", "LeakFound", "bound_states", "check_model", "mrope_of",
           "mrope_position_ids", "packed_row", "probe_model",
           "register_varlen_attention", "shared_attention_kwargs", "varlen_attention"]


def probe_model(model: torch.nn.Module, shared: bool = False) -> None:
    """The leak probe (packd.integrations.probe): `model` on a short packed row (with `shared`,
    also a prefix with two continuations, as packd.trl packs groups) against each document alone, once
    per family and configuration; LeakFound names the first layer whose output differs. Run it
    with the model as it will train (its attention implementation set, bound_states done)."""
    _probe(model, shared)


@contextlib.contextmanager
def packed_row(result: Any, model: Optional[torch.nn.Module] = None, *,
               probe: bool = True) -> Iterator[Dict[str, Any]]:
    """A Pack's (or a step's micro-batch's) one packed row as a transformers model takes it:
    yields the keyword arguments position_ids ([1, rows] int64; [4, 1, rows] with mrope),
    cu_seq_lens_q / cu_seq_lens_k (int32), max_length_q / max_length_k and use_cache=False
    (transformers finds packed sequences from the position ids only without a cache; a packed
    row is not generation), and, while open,
    tells packd_varlen the row's sequences, so that it refuses (ValueError naming the module) a
    forward in which neither the position ids nor the kwargs reached it:

        with packd.hf.packed_row(r, model) as kwargs:
            logits = model(input_ids=r.packed[0][None], **kwargs).logits

    Given the model, it first refuses a family packd_varlen
    cannot train packed (packd.integrations.checks.check_model: attention outside transformers'
    attention interface, layers that mix tokens outside attention, a forward without position
    ids), then runs the leak probe once per family and configuration (packd.integrations.probe:
    a short packed row against each document alone; LeakFound names the first layer that differs; probe=False
    skips it).
    A family whose embeddings number positions from padding_idx + 1 (RoBERTa and its kin, as
    decoders) gets its position ids from there.

    The sequences are the documents with segment ids, else the rows; with a padded layout
    (pad_multiple, cp_size) the padded ones, whose position ids go on through their padding.
    The Pack must have asked for position ids; a shared prompts' stream attends through
    shared_attention_kwargs instead."""
    if getattr(result, "shared", None) is not None:
        raise ValueError("packed_row is for a packed row; a shared prompts' stream attends "
                         "through packd.hf.shared_attention_kwargs(result)")
    if result.position_ids is None:
        raise ValueError("packed_row needs a Pack with with_position_ids=True")
    offset = 0
    if model is not None:
        check_model(model, offset_positions=True)
        bound_states(model)
        offset = position_offset(model)
        if probe:
            probe_model(model)
    if result.cu_seqlens_padded is not None:
        cu, longest = result.cu_seqlens_padded, result.max_seqlen_padded
    elif result.doc_cu_seqlens is not None:
        cu, longest = result.doc_cu_seqlens, result.doc_max_seqlen
    else:
        cu, longest = result.cu_seqlens, result.max_seqlen
    cu = cu.to(torch.int32)
    positions = (mrope_position_ids(result) if result.mrope_position_ids is not None
                 else result.position_ids.to(torch.int64).view(1, -1) + offset)
    kwargs = {"position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
              "max_length_q": int(longest), "max_length_k": int(longest), "use_cache": False}
    edges = [int(v) for v in cu.tolist()]
    with declared_sequences(list(zip(edges, edges[1:]))):
        yield kwargs


class DataCollatorWithFlattening:
    """Features (mappings with `input_ids`, optionally `labels`: sequences of ints) to one
    flattened batch. labels: per feature `[separator_id] + labels[1:]`, or `[separator_id] +
    input_ids[1:]` without labels."""

    def __init__(self, return_position_ids: bool = True, separator_id: int = -100,
                 return_flash_attn_kwargs: bool = False, return_seq_idx: bool = False,
                 client: Optional[Client] = None, *, pad_multiple: int = 0, cp_size: int = 0,
                 cp_rank: int = 0, pad_token_id: int = 0, position_ids_start: int = 0,
                 return_tensors: str = "pt") -> None:
        _check_return_tensors(return_tensors)
        self.return_tensors = return_tensors
        self.return_position_ids = return_position_ids
        self.separator_id = separator_id
        self.return_flash_attn_kwargs = return_flash_attn_kwargs
        self.return_seq_idx = return_seq_idx
        self.client = client
        self.pad_multiple = pad_multiple
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.pad_token_id = pad_token_id
        self.position_ids_start = position_ids_start

    def __call__(self, features: Sequence[Dict[str, Any]], return_tensors: Optional[str] = None,
                 separator_id: Optional[int] = None) -> Dict[str, Any]:
        return_tensors = self.return_tensors if return_tensors is None else return_tensors
        _check_return_tensors(return_tensors)
        # As transformers does: features without tokens are left out, seq_idx counts the rest.
        kept = [i for i, f in enumerate(features) if len(f["input_ids"]) > 0]
        if not kept:
            raise ValueError("DataCollatorWithFlattening received a batch where every example "
                             "is empty.")
        with_labels = "labels" in features[kept[0]]
        for i in kept:
            f = features[i]
            if with_labels and len(f["labels"]) != len(f["input_ids"]):
                raise ValueError(f"feature {i}: {len(f['labels'])} labels for "
                                 f"{len(f['input_ids'])} input_ids")
        features = [features[i] for i in kept]
        separator = self.separator_id if separator_id is None else separator_id
        lengths = [len(f["input_ids"]) for f in features]
        F, S = len(features), max(max(lengths), 1)
        input_ids = torch.full((F, S), self.pad_token_id, dtype=torch.int64)
        labels = torch.full((F, S), separator, dtype=torch.int64)
        mask = torch.zeros(F, S, dtype=torch.bool)
        for i, f in enumerate(features):
            n = lengths[i]
            input_ids[i, :n] = torch.as_tensor(f["input_ids"], dtype=torch.int64)
            source = f["labels"] if with_labels else f["input_ids"]
            labels[i, 1:n] = torch.as_tensor(source[1:n], dtype=torch.int64)
            mask[i, :n] = True
        # seq_idx is the layout's: each output row's feature, padding included, so that it
        # never decreases along the batch (Mamba's kernels need that).
        padded = bool(self.pad_multiple or self.cp_size)
        layout = Layout(with_seq_idx=self.return_seq_idx)
        if padded:
            layout = dataclasses.replace(
                layout, pad_multiple=self.pad_multiple,
                pad_values=[float(self.pad_token_id), float(separator)], cp_size=self.cp_size,
                cp_rank=self.cp_rank)
        result = _default.resolve(self.client).pack(
            [input_ids, labels], mask, with_position_ids=self.return_position_ids,
            cu_seqlens_dtype=torch.int32, layout=layout)
        batch: Dict[str, Any] = {"input_ids": result.packed[0].view(1, -1),
                                 "labels": result.packed[1].view(1, -1)}
        if self.return_position_ids:
            batch["position_ids"] = (result.position_ids.to(torch.int64).view(1, -1)
                                     + self.position_ids_start)
        if self.return_seq_idx:
            batch["seq_idx"] = result.seq_idx.to(torch.int32).view(1, -1)
        if self.return_flash_attn_kwargs:
            cu = result.cu_seqlens_padded if padded else result.cu_seqlens
            longest = result.max_seqlen_padded if padded else result.max_seqlen
            cu = cu.to(torch.int32)
            batch["cu_seq_lens_q"] = cu
            batch["cu_seq_lens_k"] = cu.clone()
            batch["max_length_q"] = batch["max_length_k"] = int(longest)
        if return_tensors == "np":
            # numpy arrays of the same dtypes; the maxima stay Python ints.
            batch = {k: v.numpy() if isinstance(v, torch.Tensor) else v
                     for k, v in batch.items()}
        return batch


def _check_return_tensors(return_tensors: str) -> None:
    """transformers' rule and message: "pt" (torch) or "np" (numpy)."""
    if return_tensors not in ("pt", "np"):
        raise ValueError(f'return_tensors must be one of ("pt", "np"), {return_tensors=} '
                         f'not supported')
