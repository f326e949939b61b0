"""A varlen attention for transformers' models on packed batches (packd.hf re-exports it):
each sequence's attention alone, on any device and in any dtype; the sequences found by
packd.integrations.documents.

    from packd.hf import register_varlen_attention
    register_varlen_attention()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="packd_varlen")

Where the sequences come from, first found first:

1. `cu_seq_lens_q` (one packed row), as transformers' flash-attention kwargs carry it;
2. `position_ids` handed to the attention (a sequence starts wherever a position is not the one
   before plus 1, transformers' own rule);
3. transformers' mask for the layer: packd_varlen registers its mask function with transformers'
   mask interface, so the mask transformers builds from the model's position ids (its packed
   sequence detection), its sliding windows, chunks and non-causal layers reaches packd_varlen
   as a `VarlenMask`, even in families whose layers hand no position ids to their attention.
   The sequences are then the blocks no query sees past (found exactly, at a cost quadratic in
   the row's length, as transformers' own masks are made);
4. else the row is one sequence, unless `packd.hf.packed_row` declared it holds several: then a
   ValueError naming the module (packd_varlen never computes one long sequence over documents).

Within each sequence the pattern is transformers' mask for the layer, evaluated inside the
sequence only (chunked attention counted within each document, sliding windows per layer,
non-causal layers, padding), so packd_varlen computes what transformers' eager attention computes
on the documents padded. It honours grouped-query attention, the module's scaling, logit
soft-capping, attention sinks (`s_aux`) and dropout in training; any other option a family hands
its attention is refused by name (docs/client.md lists them). Sequences of one length and pattern
are computed together, through torch's fused scaled_dot_product_attention (torch 2.1 and later)
unless the family soft-caps its logits or has sinks (then the eager formula, as transformers');
flash-attn's varlen kernel runs causal sequences (windowed, soft-capped) where it is installed
and the tensors are half precision on a GPU.

A stream of shared prompts (docs/design.md §14) attends through its metadata: pass
packd.hf.shared_attention_kwargs(result) to the model (cu_seq_lens_q / _k and kv_index): each
segment's queries attend the keys kv_index names, causally aligned bottom-right (a response
sees its group's prompt, then itself)."""
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from packd.integrations.documents import (declaration, allowed_of, pattern, sequence_bounds,
                                          undeclared)

NAME = "packd_varlen"

# torch's fused attention takes `scale` from torch 2.1.
_FUSED = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 1)

# Keyword arguments that reach an attention function and change nothing it computes: the model's
# plumbing (caches, outputs asked for, the flash-attention kwargs' maxima). Any other keyword a
# family hands its attention with a value is an option packd_varlen refuses by name.
_PLUMBING = frozenset({
    "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "kv_index",
    "cache_position", "use_cache", "past_key_values", "past_key_value", "output_attentions",
    "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
    "deterministic", "seq_idx", "layer_idx", "token_type_ids"})

def _family(module: torch.nn.Module) -> str:
    config = getattr(module, "config", None)
    kind = getattr(config, "model_type", None)
    return "%s (%s)" % (type(module).__name__, kind) if kind else type(module).__name__


def _refuse(module: torch.nn.Module, what: str) -> ValueError:
    return ValueError("packd_varlen in %s: %s" % (_family(module), what))


class VarlenMask:
    """transformers' attention mask for one layer type of one forward, as packd_varlen's mask
    function hands it over instead of a tensor: the mask function transformers composed (causal or
    not, its packed sequences, sliding window, chunks, overlays) and the 2D padding mask,
    evaluated only where packd_varlen asks (inside each sequence), each answer kept for the
    forward's other layers. Not a tensor: a family that edits its mask itself is refused."""

    # Queries evaluated at once when the sequences are found from the mask (bounds the memory).
    _CHUNK_ELEMENTS = 1 << 24

    def __init__(self, batch_size: int, q_length: int, kv_length: int, q_offset: Any,
                 kv_offset: int, mask_function: Callable, attention_mask: Optional[torch.Tensor],
                 use_vmap: bool, device: Any) -> None:
        self.batch_size, self.q_length, self.kv_length = batch_size, q_length, kv_length
        self.q_offset, self.kv_offset = q_offset, kv_offset
        self.mask_function, self.attention_mask = mask_function, attention_mask
        self.use_vmap, self.device = use_vmap, device
        self._blocks: Dict[Tuple[Any, ...], Any] = {}
        self._sequences: Optional[List[List[Tuple[int, int]]]] = None

    _NOT_A_TENSOR = ("packd_varlen's mask is transformers' mask function, not a tensor (the "
                     "family asked for %s): this family edits its attention mask itself, which "
                     "packd_varlen cannot follow; use attn_implementation=\"eager\" or \"sdpa\"")

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(self._NOT_A_TENSOR % "an index of it")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(self._NOT_A_TENSOR % ("its ." + name))

    def rectangle(self, b: int, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """The mask of row b's queries [q0, q1) over its keys [k0, k1): bool [q1-q0, k1-k0],
        exactly as transformers' sdpa_mask computes those entries."""
        key = (b, q0, q1, k0, k1)
        if key not in self._blocks:
            from transformers.masking_utils import sdpa_mask
            function = self.mask_function

            def in_row(batch_idx, head_idx, q_idx, kv_idx):
                return function(batch_idx + b, head_idx, q_idx, kv_idx)

            padding = None if self.attention_mask is None else self.attention_mask[b:b + 1]
            mask = sdpa_mask(batch_size=1, q_length=q1 - q0, kv_length=k1 - k0,
                             q_offset=self.q_offset + q0, kv_offset=self.kv_offset + k0,
                             mask_function=in_row, attention_mask=padding,
                             allow_is_causal_skip=False, use_vmap=self.use_vmap,
                             device=self.device)
            self._blocks[key] = mask[0, 0]
        return self._blocks[key]

    def block(self, b: int, start: int, end: int,
              sliding_window: Optional[int]) -> Tuple[torch.Tensor, str, bool]:
        """Row b's sequence [start, end): its pattern (bool [n, n]), the pattern's kind
        (_kind) and whether its first token sees nothing before it (the mask knows the
        sequence starts there); worked out once a forward, for every layer of its type."""
        key = ("block", b, start, end, sliding_window)
        if key not in self._blocks:
            allowed = self.rectangle(b, start, end, start, end)
            separated = start == 0 or not bool(self.rectangle(b, start, start + 1, 0,
                                                              start).any())
            self._blocks[key] = (allowed, _kind(allowed, sliding_window), separated)
        return self._blocks[key]

    def sequences(self) -> List[List[Tuple[int, int]]]:
        """Each row's blocks: [start, end) such that no query of a block sees a key outside
        it. Exact for any mask (each query's first and last visible key bound what it sees),
        evaluated a few queries at a time."""
        if self._sequences is not None:
            return self._sequences
        length = self.q_length
        step = max(1, self._CHUNK_ELEMENTS // max(1, self.kv_length))
        rows = []
        for b in range(self.batch_size):
            first = torch.full((length,), length, dtype=torch.long)
            last = torch.full((length,), -1, dtype=torch.long)
            for q0 in range(0, length, step):
                q1 = min(length, q0 + step)
                seen = self.rectangle(b, q0, q1, 0, self.kv_length).cpu()
                self._blocks.pop((b, q0, q1, 0, self.kv_length))
                any_seen = seen.any(-1)
                index = torch.arange(self.kv_length)
                first[q0:q1] = torch.where(any_seen, torch.where(seen, index, length).amin(-1),
                                           first[q0:q1])
                last[q0:q1] = torch.where(any_seen, torch.where(seen, index, -1).amax(-1),
                                          last[q0:q1])
            # s is a boundary when nothing before it sees s or later, and nothing from s on
            # sees before s.
            reach = torch.maximum(last, torch.arange(length)).cummax(0).values  # up to q
            back = torch.minimum(first, torch.arange(length)).flip(0).cummin(0).values.flip(0)
            edges = [0] + [s for s in range(1, length)
                           if int(reach[s - 1]) < s and int(back[s]) >= s] + [length]
            rows.append(list(zip(edges, edges[1:])))
        self._sequences = rows
        return rows


def varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
                kv_offset: int = 0, mask_function: Optional[Callable] = None,
                attention_mask: Optional[torch.Tensor] = None, use_vmap: bool = False,
                device: Any = "cpu", **kwargs: Any) -> VarlenMask:
    """transformers' mask interface for packd_varlen: the mask's parts, unevaluated."""
    if mask_function is None:
        from transformers.masking_utils import causal_mask_function
        mask_function = causal_mask_function
    return VarlenMask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                      attention_mask, use_vmap, device)


def _shared_attention(query, key, value, kwargs, groups, scaling, causal, sliding_window, softcap,
                      dropout):
    """A shared stream's attention (one row): segment n's queries are rows cu_seq_lens_q[n] ..
    [n + 1], its keys rows kv_index[cu_seq_lens_k[n] .. [n + 1]], query i seeing key j when
    j <= i + (keys - queries) (bottom-right causal), within the sliding window."""
    if query.shape[0] != 1:
        raise ValueError("packd_varlen: a shared stream is one packed row, but the batch has "
                         "%d rows" % query.shape[0])
    cu_q = [int(v) for v in kwargs["cu_seq_lens_q"].tolist()]
    cu_k = [int(v) for v in kwargs["cu_seq_lens_k"].tolist()]
    kv_index = kwargs["kv_index"].to(key.device)
    length = query.shape[2]
    if cu_q[0] != 0 or cu_q[-1] != length or len(cu_k) != len(cu_q) or cu_k[-1] != len(kv_index):
        raise ValueError("packd_varlen: cu_seq_lens_q %s, cu_seq_lens_k and kv_index (%d keys) "
                         "do not describe the row's %d tokens" % (cu_q, len(kv_index), length))
    out = query.new_zeros(query.shape[2], query.shape[1], value.shape[-1])  # [T, Hq, Dv]
    for n in range(len(cu_q) - 1):
        q = query[0, :, cu_q[n]:cu_q[n + 1]]  # [Hq, Lq, D]
        rows = kv_index[cu_k[n]:cu_k[n + 1]]
        k, v = key[0][:, rows], value[0][:, rows]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=0)
            v = v.repeat_interleave(groups, dim=0)
        allowed = pattern(q.shape[1], k.shape[1], causal, sliding_window, query.device)
        out[cu_q[n]:cu_q[n + 1]] = _eager(q[None], k[None], v[None], allowed, scaling, softcap,
                                          None, dropout)[0]
    return out.unsqueeze(0), None


def shared_attention_kwargs(result: Any) -> Dict[str, Any]:
    """The keyword arguments a model takes to attend over a Pack's shared stream through
    packd_varlen: cu_seq_lens_q / cu_seq_lens_k (int32), max_length_q / max_length_k and
    kv_index, from result.shared."""
    s = result.shared
    if s is None:
        raise ValueError("shared_attention_kwargs is for a Pack with shared_prefix")
    return {"cu_seq_lens_q": s.cu_seqlens_q.to(torch.int32),
            "cu_seq_lens_k": s.cu_seqlens_k.to(torch.int32),
            "max_length_q": int(s.max_seqlen_q), "max_length_k": int(s.max_seqlen_k),
            "kv_index": s.kv_index}


def _eager(q, k, v, allowed, scaling, softcap, sinks, dropout):
    """transformers' eager formula: q [m, H, Lq, D], k and v [m, H, Lk, D] (heads repeated),
    allowed bool [Lq, Lk] or [m, 1, Lq, Lk] (None: all), sinks [H] or None; out [m, Lq, H, Dv].
    The softmax runs in float32 at least (float64 stays float64); a query that sees no key
    gets zeros."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    empty = None
    if allowed is not None:
        empty = ~allowed.any(-1, keepdim=True)
        scores = scores.masked_fill(~(allowed | empty), float("-inf"))
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        combined = torch.cat([scores, sink.to(scores.dtype)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=dtype)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=dtype).to(q.dtype)
    if empty is not None:
        probs = probs.masked_fill(empty, 0)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v).transpose(1, 2)


def _fused(q, k, v, kind, allowed, scaling, dropout):
    """torch's fused attention over one group: kind "causal", "full", or "window" / "masked"
    (allowed [m, 1, L, L]); out [m, L, H, Dv]. A masked query that sees no key gets zeros."""
    if allowed is not None:
        empty = ~allowed.any(-1, keepdim=True)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed | empty, dropout_p=dropout, scale=scaling)
        return out.masked_fill(empty, 0).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, is_causal=kind == "causal", scale=scaling).transpose(1, 2)


def _flash_varlen(query, key, value, bounds, dropout, scaling, sliding_window, softcap):
    """flash-attn's varlen kernel over one row of causal sequences (within the sliding window),
    or None where it cannot run."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    if (not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16)
            or query.shape[0] != 1):
        return None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    lengths = [e - s for s, e in bounds[0]]
    cu = torch.tensor([0] + lengths, device=query.device, dtype=torch.int32).cumsum(
        0, dtype=torch.int32)
    window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), dropout_p=dropout,
                                 softmax_scale=scaling, causal=True, window_size=window,
                                 softcap=softcap or 0.0)
    return out.unsqueeze(0)


def _kind(allowed: torch.Tensor, sliding_window: Optional[int]) -> str:
    """"full", "causal", "window" (causal within the layer's sliding window) or "masked"."""
    n = allowed.shape[-1]
    if bool(allowed.all()):
        return "full"
    causal = pattern(n, n, True, None, allowed.device)
    if torch.equal(allowed, causal):
        return "causal"
    if sliding_window and torch.equal(allowed, pattern(n, n, True, sliding_window,
                                                        allowed.device)):
        return "window"
    return "masked"


def _check_options(module, kwargs):
    for name, value in kwargs.items():
        if value is None or value is False or name in _PLUMBING:
            continue
        raise _refuse(module, "its attention takes %s=, which packd_varlen does not compute; "
                      "use attn_implementation=\"eager\"" % name)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                     scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                     softcap: Optional[float] = None, is_causal: Optional[bool] = None,
                     s_aux: Optional[torch.Tensor] = None,
                     **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, Hq, T, D], key and value [B, Hkv, S, Dv]
    in, [B, T, Hq, Dv] out (the module docstring says where the sequences come from)."""
    _check_options(module, kwargs)
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    scaling = dim ** -0.5 if scaling is None else scaling
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    dropout = dropout if module.training else 0.0
    sinks = s_aux
    if kwargs.get("kv_index") is not None:
        if sinks is not None:
            raise _refuse(module, "a shared stream with attention sinks (s_aux) is not "
                          "computed; use attn_implementation=\"eager\"")
        return _shared_attention(query, key, value, kwargs, groups, scaling, causal,
                                 sliding_window, softcap, dropout)
    mask = attention_mask if isinstance(attention_mask, VarlenMask) else None
    dense = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    if dense is not None and dense.dim() != 4:
        raise _refuse(module, "its attention mask has %d dimensions, not 4" % dense.dim())
    if key.shape[2] != length:
        # A cache's keys: each row whole, under the layer's mask.
        return _whole_rows(module, query, key, value, mask, dense, groups, scaling, causal,
                           sliding_window, softcap, sinks, dropout)

    bounds = sequence_bounds(batch, length, kwargs)
    source = "cu_seq_lens_q" if kwargs.get("cu_seq_lens_q") is not None else "position_ids"
    if bounds is None and mask is not None:
        bounds, source = mask.sequences(), "transformers' mask"
    if bounds is None:
        bounds, source = [[(0, length)] for _ in range(batch)], None
    declared = declaration()
    if declared is not None and batch == 1 and declared.bounds[-1][1] == length:
        declared.sources.append(source or "none")
        missing = undeclared(bounds[0], length)
        if missing:
            raise _refuse(module, "the row holds %d sequences (packd.hf.packed_row), but %s; "
                          "the sequence starting at token %d would attend to the ones before "
                          "it. Pass the model position_ids with use_cache=False and no "
                          "attention_mask, so that transformers' mask finds them (packd.hf."
                          "packed_row's kwargs), or cu_seq_lens_q if the family hands its "
                          "attention **kwargs"
                          % (len(declared.bounds), "no source of sequences reached its attention"
                             if source is None else "its %s finds %d" % (source, len(bounds[0])),
                             missing[0]))

    # Each sequence's pattern: transformers' mask inside it, else the layer's own options.
    blocks = []  # (b, start, end, kind, allowed)
    for b, row in enumerate(bounds):
        for s, e in row:
            if mask is not None:
                allowed, kind, separated = mask.block(b, s, e, sliding_window)
                if s > 0 and source != "transformers' mask" and not separated:
                    # transformers' mask does not know this sequence: only a pattern that does
                    # not depend on where the row starts can be read from it.
                    plain = pattern(e - s, e - s, causal, sliding_window, allowed.device)
                    if mask.attention_mask is not None:
                        plain = plain & mask.attention_mask[b, s:e].to(plain.device)[None, :]
                    if not torch.equal(allowed, plain):
                        raise _refuse(module, "transformers' mask for this layer does not know "
                                      "the sequence at tokens %d-%d (its position ids do not "
                                      "restart there) and is not plain causal within it "
                                      "(chunked attention or another pattern counted from the "
                                      "row's start); pass position_ids that restart at every "
                                      "sequence" % (s, e))
            else:
                if dense is not None:
                    sub = dense[b if dense.shape[0] > 1 else 0, 0, s:e, s:e]
                    allowed = allowed_of(sub)
                else:
                    allowed = pattern(e - s, e - s, causal, sliding_window, query.device)
                kind = _kind(allowed, sliding_window)
            blocks.append((b, s, e, kind, allowed))

    eager = bool(softcap) or sinks is not None or not _FUSED
    if sinks is None and all(k in ("causal", "window") for *_, k, _ in blocks):
        fast = _flash_varlen(query, key, value, bounds, dropout, scaling, sliding_window, softcap)
        if fast is not None:
            return fast, None
    groups_of = defaultdict(list)
    for b, s, e, kind, allowed in blocks:
        groups_of[(e - s, kind)].append((b, s, allowed))
    pieces = {}
    for (n, kind), members in groups_of.items():
        q = torch.stack([query[b, :, s:s + n] for b, s, _ in members])  # [m, Hq, n, D]
        k = torch.stack([key[b, :, s:s + n] for b, s, _ in members])
        v = torch.stack([value[b, :, s:s + n] for b, s, _ in members])
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        allowed = (torch.stack([a for _, _, a in members])[:, None].to(query.device)
                   if kind in ("masked", "window") else None)
        if eager:
            if kind == "causal":
                allowed = pattern(n, n, True, None, query.device)
            out = _eager(q, k, v, allowed, scaling, softcap, sinks, dropout)
        else:
            out = _fused(q, k, v, kind, allowed, scaling, dropout)
        for j, (b, s, _) in enumerate(members):
            pieces[(b, s)] = out[j]
    rows = [torch.cat([pieces[(b, s)] for s, _ in row]) for b, row in enumerate(bounds)]
    return torch.stack(rows), None


def _whole_rows(module, query, key, value, mask, dense, groups, scaling, causal, sliding_window,
                softcap, sinks, dropout):
    """Queries that are not the whole row (a cache's keys before them): each row attends under
    its whole mask, as eager attention does."""
    batch, _, length, _ = query.shape
    kv = key.shape[2]
    if mask is not None:
        allowed = torch.stack([mask.rectangle(b, 0, length, 0, kv) for b in range(batch)])
    elif dense is not None:
        d = dense[:, 0, :, :kv]
        allowed = allowed_of(d)
    else:
        allowed = pattern(length, kv, causal, sliding_window, query.device).expand(
            batch, length, kv)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    allowed = allowed.to(query.device).reshape(batch, 1, length, kv)
    return _eager(query, key, value, allowed, scaling, softcap, sinks, dropout), None


def register_varlen_attention() -> str:
    """Registers varlen_attention with transformers as "packd_varlen", with its mask function
    (varlen_mask: transformers hands it the layer's mask unevaluated). Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from packd.integrations.compat import check_transformers
    check_transformers()  # the private names packd touches, where the tested release has them
    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, varlen_mask)
    return NAME
