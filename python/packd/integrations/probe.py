"""The leak probe (docs/client.md, "The leak probe"): before packd trusts a model with packed
rows, it runs the model on a short packed row and on each of the row's documents alone, and
refuses the model, naming the first layer whose output differs, where the logits differ.

packd's tables of layer names (packd.integrations.stateful) are the fast route to each family's
per-document handling; the probe is what guarantees it. A layer that mixes tokens under a name
no table knows, or a table that misses a family's variant, shows here as a document's logits
that depend on the documents before it: refused, never trained wrong.

The row: documents of 5 and 1 tokens, and of 4, 1 and 6 (two and three documents, one of a
single token); with shared prefixes (packd.trl) also a prefix of 4 tokens with continuations
of 3 and 2, as packd's shared stream lays it out (the prefix once; each continuation attends
its prefix's rows, then its own). Token ids are drawn from a fixed seed (packd's own generator:
no draw from torch's global one). The model runs in eval mode without gradients, in its own
dtype and on its own device, with the kwargs packd.hf.packed_row gives; the result is cached
per model class, attention implementation and configuration, so each family is probed once per
process. TOLERANCE (relative to the documents' largest logit) is by dtype: float64 1e-6 (a
family that computes some layers in float32, as transformers' CPU scans do, rounds apart by
about 1e-7), float32 1e-4, bfloat16 3e-2, float16 1e-2; autocast is off inside the probe."""
import contextlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 3e-2,
             torch.float16: 1e-2}
ROWS = ((5, 1), (4, 1, 6))
SHARED = (4, (3, 2))  # a prefix, and its continuations

# (class, attention implementation, configuration, shared) -> None (equal) or the refusal.
_probed: Dict[Tuple[str, str, str, bool], Optional[str]] = {}


class LeakFound(ValueError):
    """The probe found a document whose logits depend on the documents packed before it."""


def probe(model: torch.nn.Module, shared: bool = False) -> None:
    """Runs the leak probe on `model` (once per class, attention implementation and
    configuration); LeakFound names the first layer whose output differs."""
    config = getattr(model, "config", None)
    implementation = str(getattr(config, "_attn_implementation", None))
    seen = model.__dict__.get("_packd_probed")
    if seen is not None and seen[0] == implementation and seen[1] == shared:
        return  # this model passed as it is now (packed_row calls this every forward)
    key = (type(model).__module__ + "." + type(model).__qualname__,
           str(getattr(config, "_attn_implementation", None)),
           config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else "",
           shared)
    if key not in _probed:
        _probed[key] = _run(model, shared)
    if _probed[key] is not None:
        raise LeakFound(_probed[key])
    model.__dict__["_packd_probed"] = (implementation, shared)


def forget() -> None:
    """Forgets every probe's result (a test that changes a model in place)."""
    _probed.clear()


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


@contextlib.contextmanager
def _recorded(model: torch.nn.Module, outputs: Dict[str, torch.Tensor], order: List[str]):
    """Each submodule's first tensor output of [1, tokens, ...], by name, in the order the
    modules finish (a layer's children before it)."""
    handles = []

    def hook(name):
        def record(module, args, output):
            tensor = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[0] == 1:
                if name not in outputs:
                    order.append(name)
                outputs[name] = tensor.detach()
        return record

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_hook(hook(name)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _vocab(model: torch.nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else (
        model.config)
    return int(getattr(config, "vocab_size", 0) or model.get_input_embeddings().num_embeddings)


def _rows_and_calls(model, shared: bool, generator: torch.Generator):
    """Each probe row: (its packed call's kwargs, [(its rows in the stream, the document alone's
    ids, the document's rows that are compared)])."""
    from packd.integrations.checks import position_offset
    vocab, offset = _vocab(model), position_offset(model)
    low = min(4, vocab - 1)

    def ids(n):
        return torch.randint(low, vocab, (n,), generator=generator)

    probes = []
    for lengths in ROWS:
        documents = [ids(n) for n in lengths]
        edges = [0]
        for d in documents:
            edges.append(edges[-1] + len(d))
        cu = torch.tensor(edges, dtype=torch.int32)
        call = {"input_ids": torch.cat(documents)[None],
                "position_ids": torch.cat([torch.arange(len(d)) for d in documents])[None]
                + offset,
                "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths),
                "max_length_k": max(lengths), "use_cache": False}
        probes.append((call, [(range(edges[i], edges[i + 1]), d, range(len(d)))
                              for i, d in enumerate(documents)], edges))
    if shared:
        prefix_length, continuations = SHARED
        prefix = ids(prefix_length)
        tails = [ids(n) for n in continuations]
        stream = torch.cat([prefix] + tails)
        cu_q, cu_k, keys = [0, prefix_length], [0, prefix_length], list(range(prefix_length))
        start = prefix_length
        checks = []
        for tail in tails:
            keys += list(range(prefix_length)) + list(range(start, start + len(tail)))
            cu_q.append(start + len(tail))
            cu_k.append(len(keys))
            document = torch.cat([prefix, tail])
            checks.append((range(start, start + len(tail)), document,
                           range(prefix_length, len(document))))
            start += len(tail)
        checks.insert(0, (range(prefix_length), torch.cat([prefix, tails[0]]),
                          range(prefix_length)))
        call = {"input_ids": stream[None],
                "position_ids": torch.cat([torch.arange(prefix_length)] + [
                    torch.arange(prefix_length, prefix_length + len(t)) for t in tails])[None]
                + offset,
                "cu_seq_lens_q": torch.tensor(cu_q, dtype=torch.int32),
                "cu_seq_lens_k": torch.tensor(cu_k, dtype=torch.int32),
                "max_length_q": max(prefix_length, *continuations),
                "max_length_k": prefix_length + max(continuations),
                "kv_index": torch.tensor(keys), "use_cache": False}
        probes.append((call, checks, None))
    return probes


def _run(model: torch.nn.Module, shared: bool) -> Optional[str]:
    """None when every probe row's documents equal themselves alone, else the refusal."""
    from packd.integrations.documents import declared_sequences
    try:
        parameter = next(model.parameters())
        device, dtype = parameter.device, parameter.dtype
    except StopIteration:
        device, dtype = torch.device("cpu"), torch.float32
    tolerance = TOLERANCE.get(dtype, 3e-2)
    generator = torch.Generator().manual_seed(0)
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            for call, checks, edges in _rows_and_calls(model, shared, generator):
                call = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                        for k, v in call.items()}
                packed, order = {}, []
                declared = (declared_sequences(list(zip(edges, edges[1:]))) if edges
                            else contextlib.nullcontext())
                with declared, _recorded(model, packed, order):
                    logits = _logits(model(**call))[0]
                for rows, document, compared in checks:
                    alone_outputs: Dict[str, torch.Tensor] = {}
                    with _recorded(model, alone_outputs, []):
                        alone = _logits(model(input_ids=document[None].to(device),
                                              use_cache=False))[0]
                    want = alone[list(compared)]
                    got = logits[list(rows)]
                    scale = float(want.abs().max().clamp_min(1e-30))
                    error = float((got - want).abs().max()) / scale
                    if error > tolerance:
                        layer = _first_difference(model, order, packed, alone_outputs, rows,
                                                  compared, tolerance)
                        return ("packd cannot train %s (%s) packed: its logits on a packed row "
                                "differ from the document alone by %.3g relative (tolerance "
                                "%.3g for %s; documents of %s tokens%s), first in %s. A layer "
                                "mixes tokens across the row's documents: is each attention on "
                                "packd_varlen, and each layer that carries state one packd runs "
                                "per document (packd.integrations.stateful)?"
                                % (type(model).__name__,
                                   getattr(model.config, "model_type", "?"), error, tolerance,
                                   str(dtype).replace("torch.", ""),
                                   "a prefix and continuations" if edges is None else
                                   ", ".join(str(b - a) for a, b in zip(edges, edges[1:])),
                                   "" if edges is not None else " (shared)", layer))
    finally:
        model.train(training)
    return None


def _first_difference(model: torch.nn.Module, order: Sequence[str],
                      packed: Dict[str, torch.Tensor],
                      alone: Dict[str, torch.Tensor], rows: range, compared: range,
                      tolerance: float) -> str:
    """The first module (in the order modules finished in the packed call) whose output on the
    document's rows differs from its output on the document alone."""
    for name in order:
        got, want = packed.get(name), alone.get(name)
        if got is None or want is None or got.dim() < 2 or want.dim() < 2:
            continue
        if got.shape[1] <= rows[-1] or want.shape[1] <= compared[-1]:
            continue
        a, b = got[0, list(rows)], want[0, list(compared)]
        if a.shape != b.shape or not a.is_floating_point():
            continue
        scale = float(b.abs().max().clamp_min(1e-30))
        if float((a - b).abs().max()) / scale > tolerance:
            return "%s (%s)" % (name, type(model.get_submodule(name)).__name__)
    return "the logits (no module's output differs alone)"
