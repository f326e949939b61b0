"""Every document its own state in the layers that carry state across tokens (docs/client.md,
"Hybrid families"): transformers' gated delta nets (Qwen 3.5, Qwen3-Next, OLMo hybrid), Mamba 1
and 2 mixers (Mamba, Falcon-H1, Falcon-Mamba, Jamba, Bamba, Nemotron-H, Zamba), short
convolutions (LFM), lightning attention (MiniMax), delta attention (Kimi Linear) and recurrent
blocks (recurrent Gemma); and attention that mixes tokens besides its attention (an indexer
that picks its keys, a compressor of key blocks, a convolution over queries and keys, relative
logits: DeepSeek V3.2 and V4, GLM DSA, HY v4, AXK2, Qwen4-Exp, ZAYA, Inkling), run through
transformers' eager attention under each document's causal mask.

transformers' own CPU implementations of these layers ignore where a packed row's documents
start: the recurrent and convolution states run on from one document into the next. On a packed
row, each such layer here runs the row's documents as the rows of right-padded batches (one per
group of similar lengths, _length_groups), each from a zero state, through the layer's own
implementation (its kernels where installed), and the results are packed back in order: what
the layer computes on each document alone. Right padding changes nothing a causal layer
computes before it.

The documents are found as packd_varlen finds them (packd.integrations.documents), first found
first: `cu_seq_lens_q`, then position ids that restart at every document, from the model's call or the
layer's own; a row declared by packd.hf.packed_row must be found so, else the layer refuses
(ValueError naming it). A layer handed a cache (generation) or a mask of another shape is
refused by name, never run across documents.

bound_states(model) installs this on a model's stateful layers (packd.hf.packed_row(r, model)
does it) and returns their names; check_model refuses a family with layer types no installed
layer covers."""
import contextvars
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from packd.integrations.documents import (declaration, additive_of, allowed_of, pattern,
                                          restarts, sequence_bounds, undeclared)

# transformers' classes of causal layers that carry state across tokens, by name.
STATEFUL = re.compile(r"(GatedDeltaNet|MambaMixer|Mamba2Mixer|FalconH1Mixer|BambaMixer|MambaLayer"
                      r"|ShortConv|ShortConvolution|LightningAttention|RecurrentBlock"
                      r"|DeltaAttention)$")
# What an attention holds that mixes tokens besides its attention, by the class's name's end:
# an indexer that picks keys (DeepSeek V3.2, GLM DSA, HY v4, AXK2, Qwen4-Exp), a compressor of
# key blocks (DeepSeek V4), a convolution over its queries and keys (ZAYA's CCA, Inkling's),
# relative logits by distance (Inkling, Inkling 2). Such an attention runs per document, through
# transformers' eager attention.
_MIXED_ATTENTION = ("Indexer", "Compressor", "CCAProjection", "ShortConvolution",
                    "RelativeLogits", "RelativePositionBias")
# Keyword arguments that describe the packed row itself: dropped for the padded documents.
_ROW_ONLY = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
             "kv_index", "cu_seqlens")
_CACHES = ("cache", "cache_params", "past_key_values", "past_key_value")
# Documents of at most this many tokens share one padded batch whatever their lengths (the
# chunked scans' chunk: a shorter document costs a whole chunk anyway).
_GROUP_FLOOR = 64

# The model call's keyword arguments while its forward runs (innermost call last).
_calls: contextvars.ContextVar[Tuple[Dict[str, Any], ...]] = contextvars.ContextVar(
    "packd_model_calls", default=())
# How many layers around this one run their documents as a padded batch now: a layer inside one
# (Inkling's convolutions inside its attention) runs on that batch as it is.
_split_depth: contextvars.ContextVar[int] = contextvars.ContextVar("packd_split_depth",
                                                                  default=0)


# The config views (LayerConfig, by id) of the layers that run their documents through eager
# attention now: each says "eager" to its layer for the call, and nothing else changes.
_eager_layers: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "packd_eager_layers", default=frozenset())


class LayerConfig:
    """A layer's view of its model's config (installed by bound_states on the layers that run
    per document through eager attention): every attribute is the shared config's, read and
    written through, except that `_attn_implementation` reads "eager" while packd runs that
    layer's documents. So the per-document attention is chosen per call, and the model's config,
    which every other layer shares, is never changed."""

    def __init__(self, shared: Any) -> None:
        object.__setattr__(self, "_packd_shared", shared)

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("_packd_", "__")):  # its own, and copy's and pickle's protocols
            raise AttributeError(name)
        if name == "_attn_implementation" and id(self) in _eager_layers.get():
            return "eager"
        return getattr(object.__getattribute__(self, "_packd_shared"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_packd_shared"), name, value)

    def __repr__(self) -> str:
        return repr(object.__getattribute__(self, "_packd_shared"))


def sparse_attention(module: torch.nn.Module) -> bool:
    """An attention that mixes tokens besides its attention (_MIXED_ATTENTION: an indexer's
    top-k, compressed key blocks, a convolution, relative logits): it runs per document too,
    through transformers' eager attention under each document's causal mask, which applies
    what packd_varlen cannot (`indices=`, keys beyond the queries, `position_bias=`). A layer
    that reuses the previous layer's top-k instead of an indexer of its own (`skip_topk`: GLM
    DSA's, HY v4's and Mistral Large 4's "shared" layers) is one too: it is handed that layer's
    choice, packed, and gets it per document."""
    parts = [type(c).__name__ for c in module.children()]
    return (type(module).__name__.endswith("Attention")
            and (any(p.endswith(_MIXED_ATTENTION) for p in parts)
                 or getattr(module, "skip_topk", None) is True))


def stateful_layers(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """The model's layers that carry state across tokens or pick keys across them (a vision
    tower's left out)."""
    return [(name, m) for name, m in model.named_modules()
            if (STATEFUL.search(type(m).__name__) and "Vision" not in type(m).__name__)
            or sparse_attention(m)]


def bound_states(model: torch.nn.Module) -> List[str]:
    """Makes every stateful layer of `model` run each packed document from a zero state (once
    per model; a deep copy keeps it): returns the layers' names."""
    layers = stateful_layers(model)
    if layers and not getattr(model, "_packd_states_bound", False):
        model.register_forward_pre_hook(_enter_call, with_kwargs=True)
        model.register_forward_hook(_leave_call, always_call=True)
        for _, layer in layers:
            layer.register_forward_pre_hook(_split_documents, with_kwargs=True)
            layer.register_forward_hook(_join_documents, always_call=True)
            if sparse_attention(layer) and not isinstance(getattr(layer, "config", None),
                                                          (LayerConfig, type(None))):
                layer.config = LayerConfig(layer.config)
        model._packd_states_bound = True
    return [name for name, _ in layers]


def _enter_call(module: torch.nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
    _calls.set(_calls.get() + (dict(kwargs),))


def _leave_call(module: torch.nn.Module, args: Any, output: Any) -> None:
    calls = _calls.get()
    _calls.set(calls[:-1])


def _refuse(layer: torch.nn.Module, what: str) -> ValueError:
    return ValueError("packd cannot run %s on a packed row: %s" % (type(layer).__name__, what))


def _documents(layer: torch.nn.Module, length: int,
               sources: Dict[str, Any]) -> Optional[List[Tuple[int, int]]]:
    """The row's documents, as packd_varlen finds a row's sequences (its sources: the model
    call's keyword arguments and the layer's, its order, its check against
    packd.hf.packed_row's declaration)."""
    found = sequence_bounds(1, length, {k: sources.get(k) for k in ("cu_seq_lens_q",
                                                                    "cu_seq_lens_k",
                                                                    "position_ids")})
    bounds = found[0] if found is not None else None
    missing = undeclared(bounds, length)
    if missing:
        raise _refuse(layer, "the row holds %d documents (packd.hf.packed_row), but %s; the "
                      "document at token %d would start from the state of the ones before it. "
                      "Pass the model position_ids that restart at every document, or "
                      "cu_seq_lens_q"
                      % (len(declaration().bounds), "neither cu_seq_lens_q nor position ids "
                         "reached it" if bounds is None else "it finds %d" % len(bounds),
                         missing[0]))
    return bounds


def _shared_documents(layer: torch.nn.Module, length: int, sources: Dict[str, Any]):
    """A shared prompts' stream (packd.hf.shared_attention_kwargs): each segment's document is
    the rows its keys name (a response: its prompt's, then its own), of which the segment's
    own are the last. (rows per document, how many of its last rows are the segment's)."""
    try:
        cu_q = [int(v) for v in sources["cu_seq_lens_q"].tolist()]
        cu_k = [int(v) for v in sources["cu_seq_lens_k"].tolist()]
        kv_index = sources["kv_index"].long()
    except (KeyError, AttributeError):
        raise _refuse(layer, "a shared prompts' stream (kv_index) needs cu_seq_lens_q and "
                      "cu_seq_lens_k too: pass packd.hf.shared_attention_kwargs(r)") from None
    if (not cu_q or cu_q[0] != 0 or cu_q[-1] != length or len(cu_k) != len(cu_q)
            or cu_k[-1] != len(kv_index)):
        raise _refuse(layer, "cu_seq_lens_q, cu_seq_lens_k and kv_index (%d keys) do not "
                      "describe the stream's %d tokens" % (len(kv_index), length))
    rows, takes = [], []
    for n in range(len(cu_q) - 1):
        keys, take = kv_index[cu_k[n]:cu_k[n + 1]], cu_q[n + 1] - cu_q[n]
        own = torch.arange(cu_q[n], cu_q[n + 1], device=keys.device)
        if take == 0 or len(keys) < take or not torch.equal(keys[len(keys) - take:], own):
            raise _refuse(layer, "segment %d of the shared stream does not end its keys with "
                          "its own tokens" % n)
        rows.append(keys)
        takes.append(take)
    return rows, takes


def _index(rows: Sequence[Any], takes: Sequence[int], device: torch.device):
    """The padded batch of documents given by their rows of the packed row (each a range, or a
    tensor of rows on a shared stream): index [documents, longest] (0 past a document's end),
    valid (inside a document) and keep (the rows whose outputs are the packed row's, in its
    order)."""
    lengths = torch.tensor([len(r) for r in rows], device=device)[:, None]
    offsets = torch.arange(int(lengths.max()), device=device)[None, :]
    valid = offsets < lengths
    if all(isinstance(r, range) for r in rows):  # a packed row's documents, one after another
        starts = torch.tensor([r.start for r in rows], device=device)[:, None]
        index = torch.where(valid, starts + offsets, torch.zeros_like(starts))
    else:
        index = torch.nn.utils.rnn.pad_sequence([r.to(device) for r in rows], batch_first=True)
    keep = valid & (offsets >= lengths - torch.tensor(takes, device=device)[:, None])
    return index, valid, keep


def _padded(t: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[1, T, ...] as [documents, longest, ...], zero after each document."""
    out = t[0][index]
    return out * valid.view(*valid.shape, *([1] * (out.dim() - 2))).to(out.dtype)


def _causal(rows, index, dtype, device, window=None) -> torch.Tensor:
    """Each document's causal mask over its own tokens (within `window` tokens of the query
    when given, transformers' sliding window), additive [documents, 1, L, L] (a padding query
    sees itself)."""
    longest = index.shape[1]
    lengths = torch.tensor([len(r) for r in rows], device=device)[:, None, None]
    k = torch.arange(longest, device=device)[None, None, :]
    allowed = pattern(longest, longest, True, window, device)[None] & (k < lengths)
    allowed |= torch.eye(longest, dtype=torch.bool, device=device)
    return additive_of(allowed, dtype)[:, None]


def _padded_mask(layer: torch.nn.Module, mask: Any, rows, index, valid, dtype) -> Any:
    if isinstance(mask, dict):  # by use (ZAYA: "causal", and "conv", a padding mask or None)
        return {k: _padded_mask(layer, v, rows, index, valid, dtype)
                if v is not None or k == "causal" else None for k, v in mask.items()}
    if sparse_attention(layer) and not isinstance(mask, torch.Tensor):
        window = getattr(layer, "sliding_window", None)
        return _causal(rows, index, dtype, index.device,
                       window if isinstance(window, int) else None)
    if mask is None or not isinstance(mask, torch.Tensor):
        return None  # transformers' mask function (packd_varlen's): each document is one row
    if mask.dim() == 2:
        return _padded(mask, index, valid)
    if mask.dim() == 4 and mask.shape[0] == 1:
        longest = index.shape[1]
        allowed = allowed_of(mask)
        out = torch.eye(longest, dtype=torch.bool, device=mask.device).repeat(
            len(rows), mask.shape[1], 1, 1)
        for d, r in enumerate(rows):
            if isinstance(r, range):
                out[d, :, :len(r), :len(r)] = allowed[0, :, r.start:r.stop, r.start:r.stop]
            else:
                r = r.to(mask.device)
                out[d, :, :len(r), :len(r)] = allowed[0][:, r][:, :, r]
        return out if mask.dtype == torch.bool else additive_of(out, mask.dtype)
    raise _refuse(layer, "its attention mask has shape %s" % (tuple(mask.shape),))


def _split_documents(layer: torch.nn.Module, args: Tuple[Any, ...],
                     kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    stack = layer.__dict__.setdefault("_packd_documents", [])
    hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_states"))
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or _split_depth.get():
        stack.append(None)
        return None
    batch, length = hidden.shape[:2]
    named = dict(zip(("hidden_states",), args[:1]), **kwargs)
    if batch != 1:
        rows = _multi_row(named, batch, length)
        if rows:
            raise _refuse(layer, "row %d of a %d-row batch holds several documents; pack them "
                          "into one row" % (rows[0], batch))
        stack.append(None)
        return None
    calls = _calls.get()
    sources = dict(calls[-1]) if calls else {}
    sources.update({k: v for k, v in kwargs.items() if v is not None})
    sparse = sparse_attention(layer)
    if sources.get("kv_index") is not None:
        # A shared stream: each response its prompt's rows then its own, from a zero state
        # (the prompt computed again in this layer for each member, as the unshared batch does).
        rows, takes = _shared_documents(layer, length, sources)
    else:
        bounds = _documents(layer, length, sources)
        if sparse and bounds is None:
            bounds = [(0, length)]
        if bounds is None or (len(bounds) <= 1 and not sparse):
            stack.append(None)
            # One document: the layer runs the row as it is, without the packed row's
            # metadata (a gated delta net handed cu_seq_lens_q asks for kernels it may lack).
            row_only = [k for k in _ROW_ONLY if kwargs.get(k) is not None]
            if not row_only:
                return None
            return args, {k: v for k, v in kwargs.items() if k not in row_only}
        rows = [range(s, e) for s, e in bounds]
        takes = [e - s for s, e in bounds]
    for name in _CACHES:
        if kwargs.get(name) is not None:
            raise _refuse(layer, "it was handed a cache (%s): a packed row is not generation; "
                          "call the model with use_cache=False" % name)
    if sparse and "attention_mask" not in kwargs:
        raise _refuse(layer, "its attention mask was not handed by name, so packd cannot give "
                      "each document its own")
    groups = _length_groups([len(r) for r in rows])
    batches = [_padded_call(layer, args, kwargs, [rows[d] for d in g], [takes[d] for d in g],
                            length, hidden) for g in groups]
    inverse = None
    if len(groups) > 1:  # the groups' kept rows, in the packed row's order again
        ends = torch.tensor(takes).cumsum(0).tolist()
        order = torch.cat([torch.arange(ends[d] - takes[d], ends[d]) for g in groups for d in g])
        inverse = torch.argsort(order).to(hidden.device)
    eager = None
    if sparse:  # transformers' eager attention, which applies the indexer's choice as a mask
        view = layer.__dict__.get("config")
        if not isinstance(view, LayerConfig):
            raise _refuse(layer, "its config is not packd's view of it (bound_states installs "
                          "one): packd would have to change the model's shared config")
        eager = _eager_layers.set(_eager_layers.get() | {id(view)})
    stack.append(([keep for _, _, keep in batches], batches[1:], inverse, eager))
    _split_depth.set(_split_depth.get() + 1)
    new_args, new_kwargs, _ = batches[0]
    return new_args, new_kwargs


def _length_groups(lengths: Sequence[int]) -> List[List[int]]:
    """The documents in groups of similar length, each group one padded batch (its documents in
    the row's order): longest first, a group takes the next longest document while that has at
    least half the group's longest tokens, or the longest is at most _GROUP_FLOOR tokens. So no
    document is padded to more than twice its length (or the floor), and a row of similar
    documents is one batch."""
    groups: List[List[int]] = []
    for d in sorted(range(len(lengths)), key=lambda d: -lengths[d]):
        longest = lengths[groups[-1][0]] if groups else 0
        if groups and (2 * lengths[d] >= longest or longest <= _GROUP_FLOOR):
            groups[-1].append(d)
        else:
            groups.append([d])
    return [sorted(g) for g in groups]


def _padded_call(layer: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], rows,
                 takes, length: int, hidden: torch.Tensor):
    """The layer's arguments for the padded batch of the documents `rows` (of the packed row's
    `length` tokens), and which of its outputs' rows are the packed row's."""
    index, valid, keep = _index(rows, takes, hidden.device)

    def per_document(name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(
                value.shape[:2]) == (1, length):
            return _padded(value, index, valid)
        if isinstance(value, tuple) and value and all(
                isinstance(v, torch.Tensor) and tuple(v.shape[:2]) == (1, length)
                for v in value):
            return tuple(_padded(v, index, valid) for v in value)  # rotary (cos, sin)
        if isinstance(value, dict) and name == "position_embeddings":
            return {k: per_document(name, v) for k, v in value.items()}  # by rotary kind
        if (name == "relative_distance" and isinstance(value, torch.Tensor)
                and tuple(value.shape) == (length, length)):
            # Inkling 2's query - key distances over the row: the same for every document's
            # own positions, from 0.
            return value[:index.shape[1], :index.shape[1]]
        if name == "cache_position" and isinstance(value, torch.Tensor):
            return torch.arange(index.shape[1], device=value.device)
        return value

    new_args = tuple(per_document("", a) for a in args)
    new_kwargs = {}
    for name, value in kwargs.items():
        if name in _ROW_ONLY:
            continue
        if name == "attention_mask":
            new_kwargs[name] = _padded_mask(layer, value, rows, index, valid, hidden.dtype)
        else:
            new_kwargs[name] = per_document(name, value)
    return new_args, new_kwargs, keep


def _multi_row(named: Dict[str, Any], batch: int, length: int) -> List[int]:
    """The rows of a batch whose position ids restart inside them."""
    positions = named.get("position_ids")
    calls = _calls.get()
    if positions is None and calls:
        positions = calls[-1].get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.shape[-1] != length:
        return []
    starts = restarts(positions.reshape(-1, length))
    return starts[:, 1:].any(-1).nonzero().flatten().tolist()


def _join_documents(layer: torch.nn.Module, args: Any, output: Any) -> Any:
    stack = layer.__dict__.get("_packd_documents")
    split = stack.pop() if stack else None  # none when its pre-hook refused the call
    if split is None:
        return None
    keeps, rest, inverse, eager = split
    try:
        # The other length groups, through the layer again (its hooks pass them through: the
        # split depth is still raised); none when the first raised (output None).
        outputs = [output] + [layer(*a, **k) for a, k, _ in rest if output is not None]
    finally:
        _split_depth.set(_split_depth.get() - 1)
        if eager is not None:
            _eager_layers.reset(eager)

    def packed(values: List[Any]) -> Any:
        parts = [v[keep] for v, keep in zip(values, keeps)
                 if isinstance(v, torch.Tensor) and tuple(v.shape[:2]) == tuple(keep.shape)]
        if len(parts) != len(values):
            return values[0]  # not the row's
        parts = _same_width(parts)
        if parts is None:
            return values[0]
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        return (out if inverse is None else out.index_select(0, inverse))[None]

    if isinstance(output, tuple):
        return tuple(packed([o[i] for o in outputs]) for i in range(len(output)))
    return packed(outputs)


def _same_width(parts: List[torch.Tensor]) -> Optional[List[torch.Tensor]]:
    """The length groups' packed outputs with one shape past the tokens, or None. An indexer's
    top-k indices (GLM DSA, HY v4, Mistral Large 4 hand them to the next layer) are
    min(top-k, longest) wide in each group: a narrower group picked every key of its
    documents, so its first index repeated widens it and names the same keys."""
    widths = {p.shape[1:] for p in parts}
    if len(widths) == 1:
        return parts
    widest = max(p.shape[-1] for p in parts)
    if any(p.is_floating_point() or p.dim() < 2 or p.shape[1:-1] != parts[0].shape[1:-1]
           for p in parts):
        return None
    return [torch.cat([p, p[..., :1].expand(*p.shape[:-1], widest - p.shape[-1])], -1)
            for p in parts]
