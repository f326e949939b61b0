"""packd.Client: Pack and Scatter through a packd server, with torch tensors in and out.

The client's parts: the connection (packd/_connection.py: channels, TLS, retries), its regions
(packd/_regions.py: the shared-memory scratch pool, registering again what the server lost),
the GPU path (packd/_gpu.py), the requests every path builds alike (packd/_requests.py) and
the results (packd/results.py). This module is the public calls."""
import dataclasses
import threading
from typing import Any, Optional, Sequence, Tuple, Union

import grpc
import torch

from packd import _device, _memory, _requests, _wire, streaming
from packd._gpu import device_slice
from packd._requests import by_rows, part_bounds, rows_of
from packd._connection import Connection, Interceptor, PackdError, PackdValueError
from packd._gpu import Gpu
from packd._regions import Regions
from packd.layout import Layout, MRope, SharedPrefix
from packd.options import (ConnectionOptions, GpuOptions, PlanOptions, SharedMemoryOptions,
                           TlsOptions, TokenOptions, same_names, split_deprecated,
                           with_deprecated)
from packd.results import (MicroBatch, PackResult, Plan, PlannedMicroBatch, SharedResult,
                           joined, pack_result, varlen_kwargs)
from packd.step_plan import StepPlan
from packd.v1 import pack_service_pb2 as pb

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]
Number = Union[int, float]
# shifts=[(input, fill)]: a next-token view of inputs[input], `fill` where a sequence ends.
Shifts = Sequence[Tuple[int, Number]]
# fixed=(tokens, sequences, max_seqlen): the shapes every call of a compiled graph sees.
Fixed = Optional[Sequence[int]]

__all__ = ["Client", "MRope", "MicroBatch", "PackResult", "PackdError", "PackdValueError", "Plan",
           "PlannedMicroBatch", "SharedPrefix", "SharedResult", "StepPlan", "device_slice",
           "varlen_kwargs"]


# The keywords that the option objects replace, each with its field there.
_LAYOUT = same_names([f.name for f in dataclasses.fields(Layout)])
_SCATTER_LAYOUT = same_names(["pad_multiple", "cp_size", "cp_rank", "fixed", "sp_size",
                              "sp_rank", "shared_prefix"])
_PLAN = same_names(["num_ranks", "micro_batch_multiple", "cost", "groups", "pipeline_order"])
_CLIENT = {
    "connection": same_names(["max_message_bytes", "load_balancing_policy", "connections",
                              "split_threshold_bytes", "keep_freed_memory"]),
    "tls": {"tls_ca_file": "ca_file", "tls_cert_file": "cert_file",
            "tls_key_file": "key_file", "tls_server_name": "server_name"},
    "token": {"token_file": "file", "token_env": "env"},
    "shared_memory": {"shm_threshold_bytes": "threshold_bytes", "shm_key_prefix": "key_prefix",
                      "lease_seconds": "lease_seconds",
                      "idle_scratch_segments": "idle_segments",
                      "step_results_in_shared_memory": "step_results"},
    "gpu": {"gpu_lease_seconds": "lease_seconds", "device_memory": "device_memory"},
}


class Client(streaming.StepCalls):
    """A connection to packd. Safe to share across threads, as gRPC stubs are: calls from many
    threads at once each get their own scratch memory, parts and results.

    address: "HOST:PORT", "unix:PATH", or "dns:///NAME:PORT" for a headless Kubernetes Service
    (calls spread over every address the name resolves to). timeout: seconds per call, all of
    its attempts together. retries: extra attempts for calls answered UNAVAILABLE (a draining
    or restarting server) or cancelled by a server going away (CANCELLED: gRPC cancels the
    calls that reach a server while it shuts down), with exponential backoff from 50 ms to 2 s
    (the channels reconnect on the same schedule). interceptors: gRPC client interceptors
    applied to every connection (tracing, or faults a test injects).

    The rest come grouped (packd/options.py): connection (packd.ConnectionOptions: message
    size, load balancing, connections and splitting, malloc tuning), tls (packd.TlsOptions;
    default: plaintext), token (packd.TokenOptions: a bearer token from a file or the
    environment, PACKD_TOKEN by default), shared_memory (packd.SharedMemoryOptions: when calls
    travel through shared memory, the regions' lease, a step's results in shared memory) and
    gpu (packd.GpuOptions). The flat keywords they replace (tls_ca_file=, shm_threshold_bytes=,
    ...) still work for a release, with a PackdDeprecationWarning naming the replacement.

    GPU tensors stay on their GPU: a call whose tensors are all on one GPU registers the
    allocations holding them as device regions (once each, with the lease, again when the
    server lost them), allocates its results on that GPU and has packd write them there; no
    tensor byte crosses the host, and the results are tensors on that GPU (docs/gpu.md).
    """

    def __init__(self, address: str = "127.0.0.1:50051", *, timeout: float = 60.0,
                 retries: int = 7, connection: Optional[ConnectionOptions] = None,
                 tls: Optional[TlsOptions] = None, token: Optional[TokenOptions] = None,
                 shared_memory: Optional[SharedMemoryOptions] = None,
                 gpu: Optional[GpuOptions] = None, interceptors: Sequence[Interceptor] = (),
                 **deprecated: Any) -> None:
        old = split_deprecated(deprecated, *_CLIENT.values())
        if old[-1]:
            raise TypeError("Client() got an unexpected keyword argument %r"
                            % sorted(old[-1])[0])
        given = {"connection": connection, "tls": tls, "token": token,
                 "shared_memory": shared_memory, "gpu": gpu}
        defaults = {"connection": ConnectionOptions(), "tls": TlsOptions(),
                    "token": TokenOptions(), "shared_memory": SharedMemoryOptions(),
                    "gpu": GpuOptions()}
        chosen = {}
        for name, part in zip(_CLIENT, old):
            chosen[name] = with_deprecated("Client", name, given[name], defaults[name], part,
                                           _CLIENT[name])
        connection, tls, token = chosen["connection"], chosen["tls"], chosen["token"]
        shared_memory, gpu = chosen["shared_memory"], chosen["gpu"]
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self.split_threshold_bytes = connection.split_threshold_bytes
        if connection.keep_freed_memory:
            _memory.keep_freed_memory()
        self._connection = Connection(address, timeout=timeout, retries=retries,
                                      connection=connection, tls=tls, token=token,
                                      interceptors=interceptors)
        self.load_balancing_policy = self._connection.load_balancing_policy
        self._regions = Regions(self._connection, shared_memory)
        self._gpu = Gpu(self._connection, self._regions,
                        gpu.device_memory or _device.TorchCuda(), gpu.lease_seconds)
        self.device_memory = self._gpu.memory
        # The last step's output_bytes: the arena the next step asks its results in.
        self._lock = threading.Lock()
        self._step_output_bytes = 0
        self.step_results_in_shared_memory = shared_memory.step_results
        # The stub and the retried call, for what the client's parts do not cover.
        self._stub = self._connection.stub
        self._call = self._connection.call

    def _parts(self, nbytes, scratch, rows):
        """Into how many parts of the rows an inline call goes: one per connection (at most one
        per row) when it is large, else 1."""
        if (scratch is not None or self.split_threshold_bytes <= 0
                or nbytes < self.split_threshold_bytes):
            return 1
        return max(1, min(len(self._connection.channels), rows))

    def to_device_of(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`t` on the GPU that holds `like`, when `t` is not there (a gradient autograd left in
        host memory); `t` itself otherwise."""
        return self._gpu.to_device_of(t, like)

    # -- the API ----------------------------------------------------------------------------

    def _pack_in_parts(self, tensors, mask, segment_ids, scratch, nbytes, device,
                       with_position_ids, layout):
        """The PackResponse, packed and shifted tensors of a Pack: one call (through `scratch`
        when given), or parts of the rows on their own connections, joined. A layout's rows
        (padded, CP slices) are the whole batch's: such a call goes whole, its results inline."""
        laid_out = layout.any()
        regions = self._regions
        encode = lambda t, number, out: regions.encode(t, number, out, scratch)

        sizes = None if laid_out else [t.numel() * t.element_size() for t in tensors]

        def request(rows):
            return regions.request_in(scratch, lambda: _requests.pack_request(
                encode, device, with_position_ids, layout, rows_of(mask, rows),
                [rows_of(t, rows) for t in tensors],
                None if segment_ids is None else rows_of(segment_ids, rows)), sizes)

        extra = [] if segment_ids is None else [segment_ids]
        parts = (self._parts(nbytes, scratch, mask.shape[0])
                 if by_rows(mask, tensors + extra) and not laid_out else 1)
        pack = self._connection.pack
        if parts == 1:
            reply, results = regions.with_regions(
                lambda: self._call(pack[0], request(None)), scratch)
            return (reply, [regions.decode(m, t, scratch)
                            for m, t in zip(reply.packed, results.get(1, []))],
                    results.get(14, []))
        bounds = part_bounds(mask.shape[0], parts)
        replies = self._connection.in_parts(
            pack, [request(slice(bounds[k], bounds[k + 1])) for k in range(parts)])
        packed = [torch.cat([r[1][1][i] for r in replies]) for i in range(len(tensors))]
        return joined(replies, bounds[:-1]), packed, []

    def pack(self, x_or_tensors: TensorOrList, mask: torch.Tensor,
             with_position_ids: bool = False, cu_seqlens_dtype: torch.dtype = torch.int64,
             device: str = "", segment_ids: Optional[torch.Tensor] = None, *,
             layout: Optional[Layout] = None, **deprecated: Any) -> PackResult:
        """Packs each [B, S, *tail] tensor with one scan of the [B, S] mask (nonzero is active):
        packed[i] = tensors[i][mask != 0]. With segment_ids ([B, S], an integer dtype), the
        active tokens of each row are also cut into documents where the id changes: the doc_*
        fields describe them and position_ids restart at each (docs/design.md §8).

        layout (packd.Layout, docs/operation.md): how the rows are laid out for parallel
        attention: pad_multiple, pad_values, cp_size / cp_rank, sp_size / sp_rank (Ulysses),
        with_seq_idx, shifts ([(input, fill)]: next-token views in `shifted`) and fixed
        ((tokens, sequences, max_seqlen)); shared_prefix (packd.SharedPrefix): GRPO groups with
        their prompt once, the result's `shared` their attention metadata and targets
        (docs/operation.md, "Shared prompts"); with_token_mask: the result's token_mask, 1 for
        each output row holding a token, 0 for padding and ghosts; mrope (packd.MRope): its
        mrope_position_ids, [3, rows] (docs/design.md §17). The layout's fields as keywords
        (pad_multiple=8, ...) still work for a release, with a PackdDeprecationWarning. Raises
        PackdValueError (a ValueError) for malformed input, PackdError for the rest."""
        layout = with_deprecated("pack", "layout", layout, Layout(), deprecated, _LAYOUT)
        single = isinstance(x_or_tensors, torch.Tensor)
        tensors = [x_or_tensors] if single else list(x_or_tensors)
        gpu = self._gpu.device_of([("mask", mask), ("segment_ids", segment_ids)]
                                  + [("inputs[%d]" % i, t) for i, t in enumerate(tensors)])
        if gpu is not None:
            self._gpu.check_device_argument(device, gpu)
            reply, packed, shifted = self._gpu.pack(gpu, tensors, mask, segment_ids,
                                                    with_position_ids, layout)
            place = lambda t: self.device_memory.to_device(t, gpu)
        else:
            nbytes = mask.numel() * mask.element_size() + sum(
                2 * t.numel() * t.element_size() for t in tensors)
            scratch = self._regions.scratch_for(nbytes)
            try:
                reply, packed, shifted = self._pack_in_parts(
                    tensors, mask, segment_ids, scratch, nbytes, device, with_position_ids,
                    layout)
            finally:
                self._regions.give_back(scratch)
            place = lambda t: t
        return pack_result(reply, packed, shifted, single, cu_seqlens_dtype,
                           segment_ids is not None, with_position_ids, layout, place)

    def scatter(self, packed_or_tensors: TensorOrList, mask: torch.Tensor,
                tail_shape: Optional[Sequence[int]] = None, device: str = "",
                segment_ids: Optional[torch.Tensor] = None, *, layout: Optional[Layout] = None,
                targets: bool = False, **deprecated: Any) -> TensorOrList:
        """The inverse of pack: each [total_active, *tail] back to [B, S, *tail], zeros at
        inactive positions. tail_shape, when given, must equal every packed[i].shape[1:].
        With the segment_ids and layout (packd.Layout) of a Pack, the packed rows are that
        layout's: pad rows, ghost rows and other CP or SP ranks' positions are dropped (the
        gradient of that Pack); of the layout, Scatter reads pad_multiple, cp_size / cp_rank,
        sp_size / sp_rank, fixed and shared_prefix, the fields that place rows (the others say
        what else that Pack returned). With shared_prefix, the packed rows are its stream
        (prompt rows go to each group's first row: the Pack's gradient), or with targets=True
        one row per target, each put at its token (how per-token outputs such as log-probs
        come back to [B, S]). Scatter's layout fields as keywords still work for a release,
        with a PackdDeprecationWarning."""
        layout = with_deprecated("scatter", "layout", layout, Layout(), deprecated,
                                 _SCATTER_LAYOUT).for_scatter()
        if layout.shared_prefix is not None and targets:
            layout = dataclasses.replace(
                layout, shared_prefix=dataclasses.replace(layout.shared_prefix, targets=True))
        elif targets:
            raise ValueError("targets=True is for a scatter with shared_prefix")
        single = isinstance(packed_or_tensors, torch.Tensor)
        tensors = [packed_or_tensors] if single else list(packed_or_tensors)
        gpu = self._gpu.device_of([("mask", mask), ("segment_ids", segment_ids)]
                                  + [("packed[%d]" % i, t) for i, t in enumerate(tensors)])
        if gpu is not None:
            self._gpu.check_device_argument(device, gpu)
            dense = self._gpu.scatter(gpu, tensors, mask, tail_shape, segment_ids, layout)
            return dense[0] if single else dense
        laid_out = layout.any() or segment_ids is not None
        positions = mask.numel()
        dense_sizes = [positions * (t[0].numel() if t.dim() > 0 and t.shape[0] > 0 else 0)
                       * t.element_size() for t in tensors]
        nbytes = mask.numel() * mask.element_size() + sum(
            t.numel() * t.element_size() for t in tensors) + sum(dense_sizes)
        regions = self._regions
        scratch = regions.scratch_for(nbytes)
        encode = lambda t, number, out: regions.encode(t, number, out, scratch)

        sizes = dense_sizes if all(n > 0 for n in dense_sizes) else None

        def request(mask_rows, packed_rows):
            return regions.request_in(scratch, lambda: _requests.scatter_request(
                encode, device, layout, tail_shape, rows_of(mask, mask_rows),
                [rows_of(t, packed_rows) for t in tensors],
                None if segment_ids is None else rows_of(segment_ids, mask_rows)), sizes)

        scatter = self._connection.scatter
        try:
            parts = (self._parts(nbytes, scratch, mask.shape[0])
                     if mask.dim() == 2 and not laid_out else 1)
            if parts > 1:
                # Part k's packed rows start at the active count before its first row.
                bounds = part_bounds(mask.shape[0], parts)
                before = [0] + (mask != 0).sum(1).cumsum(0).tolist()
                first = [before[b] for b in bounds]
                if all(t.dim() >= 1 and t.shape[0] == first[-1] for t in tensors):
                    replies = self._connection.in_parts(scatter, [
                        request(slice(bounds[k], bounds[k + 1]), slice(first[k], first[k + 1]))
                        for k in range(parts)])
                    dense = [torch.cat([r[1][1][i] for r in replies])
                             for i in range(len(tensors))]
                    return dense[0] if single else dense
            reply, results = regions.with_regions(
                lambda: self._call(scatter[0], request(None, None)), scratch)
            dense = [regions.decode(m, t, scratch) for m, t in zip(reply.dense, results.get(1, []))]
        finally:
            regions.give_back(scratch)
        return dense[0] if single else dense

    def plan_micro_batches(self, lengths: Sequence[int], max_tokens: int, *,
                           plan: Optional[PlanOptions] = None,
                           loss_tokens: Optional[Sequence[int]] = None,
                           costs: Optional[Sequence[Number]] = None, pad_multiple: int = 0,
                           **deprecated: Any) -> pb.PlanResponse:
        """Plans micro-batches of at most max_tokens tokens over data-parallel ranks
        (docs/design.md §9, §11), one sample per length, with `plan` (packd.PlanOptions, as
        pack_micro_batches': num_ranks, micro_batch_multiple, cost, groups, pipeline_order).

        plan.cost=(a, b) balances ranks by a * P + b * P**2 for each sample (P: its length padded
        to pad_multiple), e.g. (24576, 1) for a 7B-class model, (0, 1) for attention alone; or
        costs= gives one cost per sample. Without either, the cost is P. plan.groups gives a
        group id per sample: a group's samples share one micro-batch. The budget counts padded
        tokens. loss_tokens= gives each sample's loss tokens (default: its length). The plan's
        fields as keywords still work for a release, with a PackdDeprecationWarning.

        Returns the PlanResponse: micro_batches (rank, samples, tokens, loss_tokens, cost,
        padded_tokens; by rank, then position), micro_batches_per_rank, imbalance (tokens),
        cost_imbalance, global_loss_tokens (divide the summed per-token loss of all micro-batches
        of all ranks by it) and global_sequences (divide a sum of per-sequence mean losses by it).
        """
        plan = with_deprecated("plan_micro_batches", "plan", plan, PlanOptions(), deprecated,
                               _PLAN)
        if plan.cost is not None and costs is not None:
            raise ValueError("give plan.cost=(a, b) or costs=, not both")
        request = pb.PlanRequest(lengths=[int(v) for v in lengths],
                                 max_tokens_per_micro_batch=int(max_tokens),
                                 pad_multiple=int(pad_multiple))
        plan.to(request)
        if loss_tokens is not None:
            request.loss_tokens.extend(int(v) for v in loss_tokens)
        if costs is not None:
            request.costs.extend(float(v) for v in costs)
        return self._call(self._stub.PlanMicroBatches, request)

    def pack_micro_batches(self, x_or_tensors: TensorOrList, mask: torch.Tensor,
                           max_tokens: int, *, plan: Optional[PlanOptions] = None,
                           layout: Optional[Layout] = None,
                           ranks: Optional[Sequence[int]] = None,
                           loss_mask: Optional[torch.Tensor] = None,
                           segment_ids: Optional[torch.Tensor] = None,
                           with_position_ids: bool = False,
                           cu_seqlens_dtype: torch.dtype = torch.int64, device: str = "",
                           **deprecated: Any) -> StepPlan:
        """A training step in one call (docs/design.md §12): the batch's rows planned into
        micro-batches of at most max_tokens tokens over num_ranks data-parallel ranks, each
        micro-batch packed with the layout, from one upload of the batch.

        plan (packd.PlanOptions): num_ranks, micro_batch_multiple, cost, groups (rows that must
        share a micro-batch) and pipeline_order. A row's length for the plan is its rows in the
        layout (its sequences padded to pad_multiple) on one GPU: divided by cp_size, or by
        sp_size rounded up, so max_tokens is a per-GPU budget; its cost is cost=(a, b)'s
        a * P + b * P**2 summed over its sequences (documents, with segment_ids), by default P;
        its loss tokens are the positions active in both mask and loss_mask ([B, S], default:
        mask), counted whole (every CP or SP rank gets the same plan and global_loss_tokens).
        ranks= chooses the ranks whose micro-batches are sent (default: all). layout
        (packd.Layout) and with_position_ids are Pack's (mrope: the batch's grids, each
        micro-batch gets its rows'), and the layout's `fixed` applies to every micro-batch. The
        plan's and the layout's fields as keywords still work for a release, with a
        PackdDeprecationWarning.

        Returns a StepPlan: `.plan` at once (global_loss_tokens is the one denominator of the
        summed token loss), then iterate it for MicroBatch(rank, index, samples, result), each
        result exactly pack() of the batch's rows `samples` in that order. Tensors all in host
        memory, or all on one GPU: then packd reads them there, gathers and packs each
        micro-batch on that GPU and writes its results into an arena on it (from the second
        step of a shape on; the first's come inline and are copied there), and every result is
        a tensor on that GPU, a view of the step's arena (docs/gpu.md). With shared_prefix a group is one planning unit (groups= must be
        empty), its length its stream rows and its cost over its segments' queries and keys;
        its loss tokens are its targets active in loss_mask. Raises PackdValueError (a
        ValueError) for malformed input."""
        old_plan, old_layout = split_deprecated(deprecated, _PLAN)
        plan = with_deprecated("pack_micro_batches", "plan", plan, PlanOptions(), old_plan, _PLAN)
        layout = with_deprecated("pack_micro_batches", "layout", layout, Layout(), old_layout,
                                 _LAYOUT)
        single = isinstance(x_or_tensors, torch.Tensor)
        tensors = [x_or_tensors] if single else list(x_or_tensors)
        named = ([("mask", mask), ("segment_ids", segment_ids), ("loss_mask", loss_mask)]
                 + [("inputs[%d]" % i, t) for i, t in enumerate(tensors)])
        gpu = self._gpu.device_of(named)
        if gpu is not None:
            self._gpu.check_device_argument(device, gpu)
        plan_request = pb.PlanRequest(max_tokens_per_micro_batch=int(max_tokens))
        plan.to(plan_request)
        nbytes = sum(t.numel() * t.element_size() for _, t in named if t is not None)
        regions = self._regions
        # The results' arena (after the inputs in the call's segment, or on the tensors' GPU):
        # as large as the last step's results, and a margin (the server sends them inline when
        # it is too small).
        with self._lock:
            arena = self._step_output_bytes if self.step_results_in_shared_memory else 0
        arena += arena // 8 + (64 << 10) if arena else 0
        scratch = regions.scratch_for(nbytes + arena) if gpu is None else None

        def build(encode, on):
            out = _wire.Outgoing(pb.PackMicroBatchesRequest(plan=plan_request,
                                                            ranks=list(ranks or ())))
            out.add_message(1, _requests.pack_request(encode, on, with_position_ids, layout,
                                                      mask, tensors, segment_ids))
            if loss_mask is not None:
                encode(loss_mask, 3, out)
            return out

        def request():
            if scratch is not None:
                scratch.reset()
            out = build(lambda t, number, o: regions.encode(t, number, o, scratch), device)
            got = scratch.allocate(arena) if scratch is not None and arena else None
            if got is not None:
                out.message.outputs.CopyFrom(scratch.slice(got[0], arena))
            return out

        def start(message, timeout, metadata):
            # The call, and its first message (the plan): until it comes, a call answered
            # UNAVAILABLE or CANCELLED is made again, as unary calls are.
            call = self._connection.step(message, timeout=timeout, metadata=metadata)
            try:
                return call, next(call)
            except grpc.RpcError as e:
                call.cancel()
                raise e
            except StopIteration:
                raise PackdError(grpc.StatusCode.INTERNAL,
                                 "packd ended the PackMicroBatches stream without a plan")

        options = (single, cu_seqlens_dtype, segment_ids is not None, with_position_ids, layout)
        if gpu is not None:
            call, first, decode = self._gpu.step(
                gpu, lambda encode: build(encode, "uuid:" + self._gpu.uuid(gpu)), arena, start)
            with self._lock:
                self._step_output_bytes = first[0].output_bytes
            return StepPlan(call, first[0], lambda: None, options, decode,
                            lambda t: self.device_memory.to_device(t, gpu))
        try:
            call, first = regions.with_regions(lambda: self._call(start, request()), scratch)
        except BaseException:
            regions.give_back(scratch)
            raise
        with self._lock:
            self._step_output_bytes = first[0].output_bytes
        return StepPlan(call, first[0], lambda: regions.give_back(scratch), options,
                        lambda m, t: regions.decode(m, t, scratch))

    def register_cuda_tensor(self, name: str, tensor: torch.Tensor,
                             device: Optional[str] = None) -> pb.RegionSlice:
        """Registers the GPU allocation holding `tensor` as device region `name` and returns
        the slice (packd.v1.RegionSlice) that addresses the tensor in it, for requests' inputs
        or outputs on the server's GPU.

        An IPC handle exports a whole allocation from its start, and PyTorch's caching
        allocator puts many tensors in one allocation, so the region is the whole allocation
        (its base, size and 64-byte handle from the driver, as the automatic GPU path finds
        them) and the slice's offset is the tensor's distance from the allocation's start
        (docs/gpu.md, "Device regions"). The device is named by its UUID, which holds whatever
        CUDA_VISIBLE_DEVICES each process has; `device` ("cuda:N", the server's numbering) is
        only the fallback for a server that cannot match UUIDs. Unregister it
        (unregister_region) before the memory is freed.
        """
        index = self.device_memory.device_of(tensor)
        if index is None or not tensor.is_contiguous() or tensor.numel() == 0:
            raise ValueError("register_cuda_tensor takes a contiguous GPU tensor with bytes")
        alloc = self.device_memory.allocation(tensor)
        request = pb.RegisterDeviceRegionRequest(
            name=name, ipc_handle=alloc.handle, device=device or self.device_memory.name(index),
            device_uuid=self._gpu.uuid(index), byte_size=alloc.size,
            lease_seconds=self._gpu.lease_seconds)
        self._regions.register_device(request)
        return pb.RegionSlice(region=name, offset=tensor.data_ptr() - alloc.base,
                              byte_size=tensor.numel() * tensor.element_size())

    def unregister_region(self, name: str) -> None:
        """Unregisters region `name` (one register_cuda_tensor made, say): the server no longer
        maps it, and this client no longer registers it again. NOT_FOUND when the server has no
        such region."""
        self._regions.forget_device([name])
        conn = self._connection
        conn.call(conn.stub.UnregisterRegion, pb.UnregisterRegionRequest(name=name))

    def unregister_gpu_regions(self) -> None:
        """Unregisters every device region this client registered (the automatic GPU path's
        and register_cuda_tensor's) now, so that the server no longer maps that memory. Call it
        before torch.cuda.empty_cache() or anything else that returns cached GPU memory to the
        driver: memory freed while the server still maps it stays pinned until the region's
        lease ends, and using it is undefined. The next GPU call registers what it needs
        again."""
        self._gpu.unregister_freed(everything=True)

    def info(self) -> pb.ServerInfo:
        return self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest())

    def close(self) -> None:
        """Unregisters the client's idle scratch segments (those of calls still running go when
        they end) and its device regions, and closes every connection."""
        self._regions.close()
        self._gpu.unregister_freed(everything=True)
        self._connection.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
