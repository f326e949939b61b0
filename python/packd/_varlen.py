"""A varlen attention for transformers' models on packed batches (packd.hf re-exports it):
each sequence's causal attention alone, from `cu_seq_lens_q` or from position ids that restart
at every document, on any device and in any dtype.

    from packd.hf import register_varlen_attention
    register_varlen_attention()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="packd_varlen")

It honours what transformers' families use: grouped-query attention, sliding windows, logit
soft-capping, the module's scaling, and dropout only in training. Sequences of equal length are
computed together, through torch's fused scaled_dot_product_attention (torch 2.1 and later)
unless the family soft-caps its logits (then the eager formula, as transformers'); flash-attn's
varlen kernel runs them where it is installed and the tensors are half precision on a GPU.

A stream of shared prompts (docs/design.md §14) attends through its metadata: pass
packd.hf.shared_attention_kwargs(result) to the model (cu_seq_lens_q / _k and kv_index): each
segment's queries attend the keys kv_index names, causally aligned bottom-right (a response
sees its group's prompt, then itself)."""
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import torch

NAME = "packd_varlen"

# torch's fused attention takes `scale` from torch 2.1.
_FUSED = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 1)


def sequence_bounds(batch: int, length: int, kwargs: Dict[str, Any]) -> List[List[Tuple[int, int]]]:
    """Each row's sequences as [start, end) in order, covering the row: from `cu_seq_lens_q`
    (one row), else from `position_ids` (a sequence starts wherever a position is not the one
    before it plus 1, as transformers finds packed sequences), else the whole row."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu_k = None if kwargs.get("kv_index") is not None else kwargs.get("cu_seq_lens_k")
        if cu_k is not None and not torch.equal(cu_k.cpu(), cu.cpu()):
            raise ValueError("packd_varlen: cu_seq_lens_k differs from cu_seq_lens_q; queries "
                             "and keys of one sequence must be the same tokens")
        if batch != 1:
            raise ValueError("packd_varlen: cu_seq_lens_q describes one packed row, but the "
                             "batch has %d rows" % batch)
        edges = [int(v) for v in cu.tolist()]
        if edges[0] != 0 or edges[-1] != length or any(b < a for a, b in zip(edges, edges[1:])):
            raise ValueError("packd_varlen: cu_seq_lens_q %s does not cover the row's %d tokens "
                             "in order" % (edges, length))
        return [[(a, b) for a, b in zip(edges, edges[1:]) if b > a]]
    positions = kwargs.get("position_ids")
    if positions is None:
        return [[(0, length)] for _ in range(batch)]
    if positions.dim() == 3:  # multimodal rotary positions [3 or 4, B, T]: the text row
        positions = positions[0]
    positions = positions.reshape(-1, length).expand(batch, length).cpu()
    starts = torch.ones(batch, length, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    rows = []
    for b in range(batch):
        edges = starts[b].nonzero().flatten().tolist() + [length]
        rows.append(list(zip(edges, edges[1:])))
    return rows


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
        lq, lk = q.shape[1], k.shape[1]
        scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        i = torch.arange(lq, device=query.device)[:, None] + (lk - lq)
        j = torch.arange(lk, device=query.device)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=query.device)
        if causal:
            allowed &= j <= i
        if sliding_window:
            allowed &= j > i - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float64 if query.dtype ==
                              torch.float64 else torch.float32).to(query.dtype)
        probs = torch.nn.functional.dropout(probs, p=dropout, training=dropout > 0)
        out[cu_q[n]:cu_q[n + 1]] = torch.matmul(probs, v).transpose(0, 1)
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


def _flash_varlen(query, key, value, bounds, dropout, scaling, causal, sliding_window, softcap):
    """flash-attn's varlen kernel over one row's sequences, or None where it cannot run."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    if (not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16)
            or query.shape[0] != 1):
        return None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    lengths = [e - s for s, e in bounds[0]]
    cu = torch.tensor([0] + lengths, device=query.device, dtype=torch.int32).cumsum(0,
                                                                             dtype=torch.int32)
    window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), dropout_p=dropout,
                                 softmax_scale=scaling, causal=causal, window_size=window,
                                 softcap=softcap or 0.0)
    return out.unsqueeze(0)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                     dropout: float = 0.0, scaling: Optional[float] = None,
                     sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                     is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None,
                     **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, Hq, T, D], key and value [B, Hkv, T, Dv]
    in, [B, T, Hq, Dv] out. attention_mask is ignored: a packed batch's sequences come from
    kwargs (sequence_bounds)."""
    if s_aux is not None:
        raise NotImplementedError("packd_varlen has no attention sinks (s_aux); use eager")
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    scaling = dim ** -0.5 if scaling is None else scaling
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    dropout = dropout if module.training else 0.0
    if kwargs.get("kv_index") is not None:
        return _shared_attention(query, key, value, kwargs, groups, scaling, causal,
                                 sliding_window, softcap, dropout)
    bounds = sequence_bounds(batch, length, kwargs)
    fast = _flash_varlen(query, key, value, bounds, dropout, scaling, causal, sliding_window,
                         softcap)
    if fast is not None:
        return fast, None
    by_length = defaultdict(list)
    for b, row in enumerate(bounds):
        for s, e in row:
            by_length[e - s].append((b, s))
    pieces = {}
    for n, starts in by_length.items():
        q = torch.stack([query[b, :, s:s + n] for b, s in starts])  # [m, Hq, n, D]
        k = torch.stack([key[b, :, s:s + n] for b, s in starts])
        v = torch.stack([value[b, :, s:s + n] for b, s in starts])
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        i = torch.arange(n, device=query.device)
        allowed = torch.ones(n, n, dtype=torch.bool, device=query.device)
        if causal:
            allowed &= i[None, :] <= i[:, None]
        if sliding_window:
            allowed &= i[None, :] > i[:, None] - sliding_window
        if _FUSED and not softcap:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed if sliding_window else None, dropout_p=dropout,
                is_causal=causal and not sliding_window, scale=scaling).transpose(1, 2)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~allowed, float("-inf"))
            # In float32 at least, as transformers' eager attention; float64 stays float64.
            probs = torch.softmax(scores, dim=-1, dtype=torch.float64 if query.dtype ==
                                  torch.float64 else torch.float32).to(query.dtype)
            probs = torch.nn.functional.dropout(probs, p=dropout, training=dropout > 0)
            out = torch.matmul(probs, v).transpose(1, 2)  # [m, n, Hq, Dv]
        for j, (b, s) in enumerate(starts):
            pieces[(b, s)] = out[j]
    rows = [torch.cat([pieces[(b, s)] for s, _ in row]) for b, row in enumerate(bounds)]
    return torch.stack(rows), None


def register_varlen_attention() -> str:
    """Registers varlen_attention with transformers as "packd_varlen" (no mask is built for it:
    the sequences come from cu_seq_lens_q or position_ids). Returns the name."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, varlen_attention)
    return NAME
