"""packd.Client: Pack and Scatter through a packd server, with torch tensors in and out."""
import collections
import concurrent.futures
import dataclasses
import itertools
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import grpc
import numpy
import torch

from packd import _device, _memory, _tensors, _wire
from packd._shm import Segment
from packd.layout import Layout
from packd.v1 import pack_service_pb2 as pb
from packd.v1 import pack_service_pb2_grpc as pb_grpc

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]
Number = Union[int, float]
# shifts=[(input, fill)]: a next-token view of inputs[input], `fill` where a sequence ends.
Shifts = Sequence[Tuple[int, Number]]
# fixed=(tokens, sequences, max_seqlen): the shapes every call of a compiled graph sees.
Fixed = Optional[Sequence[int]]
Interceptor = Union[grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor]


class PackdError(Exception):
    """A call packd refused or could not complete. `code` is the grpc.StatusCode, `details` the
    server's message. Malformed requests (INVALID_ARGUMENT) also derive from ValueError."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class PackdValueError(PackdError, ValueError):
    """INVALID_ARGUMENT: the request was malformed (shapes, dtypes, tail_shape, ...)."""


def _error(rpc_error):
    code, details = rpc_error.code(), rpc_error.details()
    cls = PackdValueError if code == grpc.StatusCode.INVALID_ARGUMENT else PackdError
    return cls(code, details)


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
    thd_max_num_seqs)."""
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
        raise ValueError("style is \"flash_attn\", \"te\" or \"megatron\", not %r" % (style,))
    if padded is not None and not torch.equal(padded.to(cu.device, torch.int64),
                                              cu.to(torch.int64)):
        raise ValueError("this layout puts pad rows between sequences, which flash attention "
                         "would attend to: use style=\"te\" (TransformerEngine) or "
                         "pad_multiple 0")
    return {"cu_seqlens_q": cu, "cu_seqlens_k": cu,
            "max_seqlen_q": longest, "max_seqlen_k": longest}


def _layout(pad_multiple, pad_values, cp_size, cp_rank, with_seq_idx, shifts, fixed, sp_size,
            sp_rank):
    """The Layout of a call's keyword arguments."""
    return Layout(pad_multiple=pad_multiple, pad_values=pad_values, cp_size=cp_size,
                  cp_rank=cp_rank, with_seq_idx=with_seq_idx,
                  shifts=tuple(tuple(s) for s in shifts),
                  fixed=tuple(fixed) if fixed else None, sp_size=sp_size, sp_rank=sp_rank)


def _token_metadata(token_file, token_env):
    """The call metadata carrying a bearer token: the first line of `token_file`, else the
    environment variable `token_env`; None without one."""
    token = ""
    if token_file:
        with open(token_file) as f:
            token = next((line.strip() for line in f if line.strip()), "")
        if not token:
            raise ValueError("no token in %s" % token_file)
    elif token_env:
        token = os.environ.get(token_env, "").strip()
    return (("authorization", "Bearer " + token),) if token else None


def _rows(t, rows):
    """t[rows], or t itself for rows None."""
    return t if rows is None else t[rows]


def _joined(replies, first_rows):
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


_COPY_PIECE = 4 << 20
_copiers = None
_copiers_lock = threading.Lock()


def _copy(dst, src):
    """dst[:] = src (numpy uint8 arrays): numpy's copy of bytes runs at memcpy's speed (torch's
    uint8 copy_ at half), and a large one is split over a few threads (numpy lets go of the GIL
    while it copies), which a single thread's memory bandwidth does not saturate."""
    global _copiers
    pieces = min(4, os.cpu_count() or 1, src.size // _COPY_PIECE)
    if pieces <= 1:
        numpy.copyto(dst, src)
        return
    with _copiers_lock:
        if _copiers is None:
            _copiers = concurrent.futures.ThreadPoolExecutor(
                max_workers=min(4, os.cpu_count() or 1) - 1, thread_name_prefix="packd-copy")
    bounds = [src.size * k // pieces for k in range(pieces + 1)]
    futures = [_copiers.submit(numpy.copyto, dst[a:b], src[a:b])
               for a, b in zip(bounds[1:-1], bounds[2:])]
    numpy.copyto(dst[:bounds[1]], src[:bounds[1]])
    for f in futures:
        f.result()


def _pack_result(reply, packed, shifted, single, cu_seqlens_dtype, docs, with_position_ids,
                 layout, place=lambda t: t):
    """The PackResult of a PackResponse and its packed and shifted tensors; `place` puts the
    metadata tensors where the packed ones are."""
    def ints(values, dtype=torch.int64):
        return place(torch.tensor(list(values), dtype=torch.int64).to(dtype))

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
        shifted=list(shifted) if layout.shifts else None)


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


class StepPlan:
    """A PackMicroBatches call in progress: `plan` (a Plan) at once, then the micro-batches
    (MicroBatch) as they arrive, by iterating it. The server packs the next micro-batch while
    this one is read, and no further. close() (or leaving a `with` block) cancels what is left;
    iterating to the end releases the call's shared memory."""

    def __init__(self, client: "Client", call: Any, first: Any, scratch: Any,
                 options: Tuple[Any, ...]) -> None:
        self._client, self._call, self._scratch = client, call, scratch
        self._options = options  # (single, cu_seqlens_dtype, docs, with_position_ids, layout)
        self.plan = Plan.of(first.plan)

    def __iter__(self) -> Iterator[MicroBatch]:
        try:
            for reply, tensors in self._call:
                packed_reply, inner = tensors.get(5, [(pb.PackResponse(), {})])[0]
                single, cu_dtype, docs, with_position_ids, layout = self._options
                yield MicroBatch(reply.rank, reply.index, list(reply.samples), _pack_result(
                    packed_reply, inner.get(1, []), inner.get(14, []), single, cu_dtype, docs,
                    with_position_ids, layout))
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            self.close()

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        scratch, self._scratch = self._scratch, None
        self._client._give_back(scratch)

    def __enter__(self) -> "StepPlan":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _is_node_local(address):
    """Whether only this node can reach `address`: unix sockets and loopback hosts (127.0.0.0/8,
    localhost, [::1]), with or without a gRPC scheme. The same rule as the server's and the C++
    client's (proto/address.cc, IsNodeLocal)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "ipv4:", "ipv6:"):
        if address.startswith(scheme):
            address = address[len(scheme):]
            break
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.startswith("127.") or host in ("localhost", "[::1]")


def device_slice(storage_offset: int, storage_bytes: int, tensor_offset: int,
                 tensor_bytes: int) -> Tuple[int, int]:
    """The (offset, byte_size) of a tensor in a device region registered from its IPC handle.

    The handle maps the allocation from its start; the tensor's storage begins
    `storage_offset` bytes into the allocation, and the tensor `tensor_offset` bytes into its
    storage. The region must cover storage_offset + storage_bytes."""
    if tensor_offset < 0 or tensor_offset + tensor_bytes > storage_bytes:
        raise ValueError("the tensor (%d bytes at %d) is not inside its storage of %d bytes"
                         % (tensor_bytes, tensor_offset, storage_bytes))
    return storage_offset + tensor_offset, tensor_bytes


def _read(path, what):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise PackdError(grpc.StatusCode.FAILED_PRECONDITION,
                         "cannot read %s %s: %s" % (what, path, e.strerror)) from None
    if not data:
        raise PackdError(grpc.StatusCode.FAILED_PRECONDITION, "%s %s is empty" % (what, path))
    return data


def _tls_credentials(ca_file, cert_file, key_file):
    """Channel credentials for TLS (None: plaintext)."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("tls_cert_file and tls_key_file go together")
    if not ca_file:
        if cert_file:
            raise ValueError("a client certificate needs TLS: give tls_ca_file too")
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file, "tls_ca_file"),
        private_key=_read(key_file, "tls_key_file") if key_file else None,
        certificate_chain=_read(cert_file, "tls_cert_file") if cert_file else None)


# What a call is retried on: UNAVAILABLE (the server is draining, restarting or unreachable) and
# CANCELLED (this client cancels nothing, so a server going away did: gRPC cancels the calls that
# reach a server while it shuts down, before a handler sees them, grpc/grpc#41785). Every packd
# call may be repeated.
# Device regions of GPU tensors are named py-gpu-PID-TAG-N: the tag tells processes of other pid
# namespaces apart.
_GPU_TAG = os.urandom(4).hex()
_gpu_regions = itertools.count()

_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
_INITIAL_BACKOFF = 0.05  # seconds, doubling between attempts up to
_MAX_BACKOFF = 2.0


class Client:
    """A connection to packd. Safe to share across threads, as gRPC stubs are: calls from many
    threads at once each get their own scratch memory, parts and results.

    address: "HOST:PORT", "unix:PATH", or "dns:///NAME:PORT" for a headless Kubernetes Service
    (calls spread over every address the name resolves to). load_balancing_policy: gRPC's
    policy; None: "round_robin" for dns:/// addresses, gRPC's pick_first otherwise. timeout:
    seconds per call, all of its attempts together. retries: extra attempts for calls answered
    UNAVAILABLE (a draining or restarting server) or cancelled by a server going away
    (CANCELLED: gRPC cancels the calls that reach a server while it shuts down), with
    exponential backoff from 50 ms to 2 s (the channels reconnect on the same schedule).
    shm_threshold_bytes: calls whose tensors hold at least this many bytes travel through shared
    memory when the server is on this node and allows it (0 disables); each call in flight has
    a segment of its own, and idle_scratch_segments of them are kept for later calls.
    shm_key_prefix: the server's --shm_key_prefix, under which segments are named.
    split_threshold_bytes: inline calls at least this large go as parts of the rows, one per
    connection (`connections` of them), at once (0: never). keep_freed_memory: tune this
    process's malloc to keep freed memory mapped (see packd._memory), which makes large inline
    calls several times faster. token_file /
    token_env: a bearer token for a server with --auth_token_file, from a file's first line or
    an environment variable (PACKD_TOKEN by default), sent on every call. lease_seconds: the
    lease of the regions this client registers (its shared-memory segments, CUDA memory): the
    server drops a region no call has named for that long, so a killed process leaks nothing
    for longer; the client registers it again, transparently, when a call finds it gone (0: no
    lease). tls_ca_file: TLS, for a server with --tls_cert_file: the PEM CA certificates that
    signed its certificate (default: plaintext); tls_cert_file / tls_key_file: this client's
    certificate and key, for mutual TLS; tls_server_name: the name the server's certificate
    carries when it is not the address's host (unix sockets: "localhost"). interceptors: gRPC
    client interceptors applied to every connection (tracing, or faults a test injects).

    GPU tensors stay on their GPU: a call whose tensors are all on one GPU registers the
    allocations holding them as device regions (once each, with the lease, again when the
    server lost them), allocates its results on that GPU and has packd write them there; no
    tensor byte crosses the host, and the results are tensors on that GPU (docs/gpu.md).
    device_memory: the seam to the GPU runtime (packd._device.DeviceMemory); default: torch's
    CUDA tensors.
    """

    def __init__(self, address: str = "127.0.0.1:50051", *, timeout: float = 60.0,
                 retries: int = 7, max_message_bytes: int = 1 << 30,
                 shm_threshold_bytes: int = 4 << 20, shm_key_prefix: str = "/packd",
                 split_threshold_bytes: int = 16 << 20, keep_freed_memory: bool = True,
                 token_file: Optional[str] = None, token_env: Optional[str] = "PACKD_TOKEN",
                 lease_seconds: int = 30, tls_ca_file: Optional[str] = None,
                 tls_cert_file: Optional[str] = None, tls_key_file: Optional[str] = None,
                 tls_server_name: Optional[str] = None,
                 load_balancing_policy: Optional[str] = None, connections: int = 2,
                 idle_scratch_segments: int = 4,
                 interceptors: Sequence[Interceptor] = (),
                 device_memory: Optional[_device.DeviceMemory] = None) -> None:
        self.address = address
        self.lease_seconds = lease_seconds
        # Device regions this client registered, by name: their requests, to register again.
        self._device_regions = {}
        self.device_memory = device_memory or _device.TorchCuda()
        # The allocations registered for GPU tensors: (device, base) -> (region name, handle);
        # and ((device, base) or None, region name) of allocations freed since, to forget and
        # unregister: appended to without the lock, from wherever memory is freed (a finalizer).
        self._gpu_allocations = {}
        self._gpu_freed = collections.deque()
        self._uuids = {}
        self.timeout = timeout
        self.retries = retries
        self.shm_threshold_bytes = shm_threshold_bytes
        self.shm_key_prefix = shm_key_prefix
        self.split_threshold_bytes = split_threshold_bytes
        self._metadata = _token_metadata(token_file, token_env)
        if keep_freed_memory:
            _memory.keep_freed_memory()
        limit = min(max_message_bytes, (1 << 31) - 1)
        # Several connections (channels with different arguments share none): large inline calls
        # go as parts of the rows, one on each, at once.
        credentials = _tls_credentials(tls_ca_file, tls_cert_file, tls_key_file)
        extra = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
        self.load_balancing_policy = load_balancing_policy

        if load_balancing_policy is None and address.startswith("dns:"):
            self.load_balancing_policy = "round_robin"
        if self.load_balancing_policy:
            extra.append(("grpc.lb_policy_name", self.load_balancing_policy))

        def channel(i):
            # Reconnect as often as calls are retried: gRPC's own backoff (1 s, growing to
            # 2 min) would leave a restarted server unreached while the retries run out.
            options = [("grpc.max_send_message_length", limit),
                       ("grpc.max_receive_message_length", limit),
                       ("grpc.initial_reconnect_backoff_ms", int(_INITIAL_BACKOFF * 1000)),
                       ("grpc.max_reconnect_backoff_ms", int(_MAX_BACKOFF * 1000)),
                       ("grpc.http2.lookahead_bytes", 64 << 20),
                       ("packd.connection", i)] + extra
            if credentials is None:
                made = grpc.insecure_channel(address, options=options)
            else:
                made = grpc.secure_channel(address, credentials, options=options)
            return grpc.intercept_channel(made, *interceptors) if interceptors else made

        self._channels = [channel(i) for i in range(max(1, connections))]
        self._channel = self._channels[0]
        self._stub = pb_grpc.PackServiceStub(self._channel)
        # Pack and Scatter skip protobuf's copies of tensor bytes (packd/_wire.py).
        self._pack = [channel.unary_unary(
            "/packd.v1.PackService/Pack", request_serializer=_wire.serialize,
            response_deserializer=_wire.parser(pb.PackResponse, pb.Tensor))
            for channel in self._channels]
        self._scatter = [channel.unary_unary(
            "/packd.v1.PackService/Scatter", request_serializer=_wire.serialize,
            response_deserializer=_wire.parser(pb.ScatterResponse, pb.Tensor))
            for channel in self._channels]
        self._step = self._channel.unary_stream(
            "/packd.v1.PackService/PackMicroBatches", request_serializer=_wire.serialize,
            response_deserializer=_wire.parser(pb.PackMicroBatchesResponse, pb.Tensor))
        self.idle_scratch_segments = idle_scratch_segments
        # Guards what follows: the scratch segments no call holds, whether the server allows
        # shared memory, and whether the client is closed.
        self._lock = threading.Lock()
        self._idle = []
        self._shm_allowed = None
        self._closed = False

    # -- plumbing ---------------------------------------------------------------------------

    def _metadata_for(self, request):
        """The call's metadata: the token, and for Pack and Scatter the request's size, so
        that the server's memory budget admits the call for what it needs."""
        if not isinstance(request, _wire.Outgoing):
            return self._metadata
        return (self._metadata or ()) + (
            ("packd-request-bytes", str(_wire.serialized_size(request))),)

    def _call(self, method, request, retries=None, connection=0):
        """method(request) (a callable of channel `connection`), retried with backoff on the
        codes in _RETRIED."""
        retries = self.retries if retries is None else retries
        deadline = time.monotonic() + self.timeout
        backoff = _INITIAL_BACKOFF
        for attempt in range(retries + 1):
            try:
                return method(request, timeout=max(deadline - time.monotonic(), 1e-3),
                              metadata=self._metadata_for(request))
            except grpc.RpcError as e:
                if (e.code() not in _RETRIED or attempt == retries
                        or time.monotonic() + backoff >= deadline):
                    raise _error(e) from None
                self._back_off(connection, backoff)
                backoff = min(2 * backoff, _MAX_BACKOFF)

    def _back_off(self, connection, seconds):
        """Waits `seconds` before a retry, meanwhile driving channel `connection` to reconnect:
        in Python, gRPC runs a disconnected channel's reconnect timer only while someone waits on
        the channel, and a server that came back would otherwise stay unreached for seconds."""
        end = time.monotonic() + seconds
        ready = grpc.channel_ready_future(self._channels[connection])
        try:
            ready.result(timeout=seconds)
        except grpc.FutureTimeoutError:
            pass
        finally:
            ready.cancel()
        time.sleep(max(0.0, end - time.monotonic()))

    def _with_regions(self, call, scratch, regions=()):
        """call(), and once more if it finds a region gone (NOT_FOUND) and registering this
        call's scratch segment or the device regions it names (`regions`) again helps."""
        try:
            return call()
        except PackdError as e:
            if e.code != grpc.StatusCode.NOT_FOUND or not self._reregister(scratch, regions):
                raise
        return call()

    def _reregister(self, scratch, regions=()):
        """Registers again what the server no longer holds (a lease ran out, or the server
        restarted) of `scratch` (the call's own segment, which no other call uses) and of the
        device regions `regions`; how many. Registering device memory twice is harmless: the
        server takes a repeated registration as the one it holds."""
        known = {r.name for r in self._call(self._stub.ListRegions,
                                            pb.ListRegionsRequest()).regions}
        count = 0
        if scratch is not None and scratch.region not in known:
            scratch.renew()
            count += 1
        with self._lock:
            devices = [self._device_regions[name] for name in set(regions)
                       if name not in known and name in self._device_regions]
        for request in devices:
            self._call(self._stub.RegisterDeviceRegion, request)
            count += 1
        return count

    def _in_parts(self, methods, requests):
        """requests[k] on connection k (methods[k] is its callable), all at once; the replies in
        order. A part the server answered UNAVAILABLE or CANCELLED is retried alone."""
        if len(requests) == 1:
            return [self._call(methods[0], requests[0])]
        futures = [m.future(r, timeout=self.timeout, metadata=self._metadata_for(r))
                   for m, r in zip(methods, requests)]
        replies = []
        for connection, (method, request, future) in enumerate(zip(methods, requests, futures)):
            try:
                replies.append(future.result())
            except grpc.RpcError as e:
                if e.code() not in _RETRIED:
                    for f in futures:
                        f.cancel()
                    raise _error(e) from None
                replies.append(self._call(method, request, connection=connection))  # retried
        return replies

    def _parts(self, nbytes, scratch, rows):
        """Into how many parts of the rows an inline call goes: one per connection (at most one
        per row) when it is large, else 1."""
        if (scratch is not None or self.split_threshold_bytes <= 0
                or nbytes < self.split_threshold_bytes):
            return 1
        return max(1, min(len(self._channels), rows))

    @staticmethod
    def _bounds(rows, parts):
        """The first row of each of `parts` parts of `rows` rows, and `rows`."""
        return [rows * k // parts for k in range(parts + 1)]

    @staticmethod
    def _by_rows(mask, tensors):
        """Whether a call can go in parts of the rows: every tensor [B, S, ...] like the [B, S]
        mask, with B >= 2."""
        return (mask.dim() == 2 and mask.shape[0] >= 2
                and all(t.dim() >= 2 and t.shape[:2] == mask.shape for t in tensors))

    def _scratch_for(self, nbytes):
        """The scratch segment of a call whose tensors hold `nbytes`, lent to it alone until
        _give_back: None when they travel inline, else the smallest idle one that holds them,
        or a new one."""
        if (self.shm_threshold_bytes <= 0 or nbytes < self.shm_threshold_bytes
                or not _is_node_local(self.address)):
            return None
        with self._lock:
            allowed = self._shm_allowed
        if allowed is None:
            allowed = self.info().shared_memory_enabled
            with self._lock:
                self._shm_allowed = allowed
        if not allowed:
            return None
        with self._lock:
            fits = [seg for seg in self._idle if seg.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda seg: seg.size)
                self._idle.remove(seg)
                seg.reset()
                return seg
        # Rounded up so that slightly larger batches reuse it (the C++ client's rule too).
        return Segment(self, nbytes + nbytes // 4 + (1 << 20), self.shm_key_prefix,
                       self.lease_seconds)

    def _give_back(self, scratch):
        """Returns a call's scratch segment to the idle ones, closing the smallest beyond
        idle_scratch_segments (or it, once the client is closed)."""
        if scratch is None:
            return
        evicted = None
        with self._lock:
            if self._closed:
                evicted = scratch
            else:
                self._idle.append(scratch)
                if len(self._idle) > max(self.idle_scratch_segments, 0):
                    evicted = min(self._idle, key=lambda seg: seg.size)
                    self._idle.remove(evicted)
        if evicted is not None:
            evicted.close()

    @staticmethod
    def _encode(t, number, outgoing, scratch):
        """Adds `t` as tensor field `number`: a handle into `scratch` when given, else its bytes
        (sent from the tensor's own memory)."""
        header = pb.Tensor()
        _tensors.header(t, header)
        src = _tensors.as_bytes_view(t)
        if scratch is not None and t.numel() > 0:
            got = scratch.allocate(src.numel())
            if got is not None:
                offset, dst = got
                _copy(dst.numpy(), src.numpy())
                header.region.CopyFrom(scratch.slice(offset, src.numel()))
                outgoing.add(number, header)
                return
        outgoing.add(number, header, memoryview(src.numpy()))

    @staticmethod
    def _decode(msg, tensor, scratch):
        if msg.HasField("region"):
            dtype = _tensors.FROM_WIRE[msg.dtype]
            raw = scratch.view(msg.region.offset, msg.region.byte_size).clone()
            return raw.view(dtype).reshape(list(msg.shape))
        return tensor

    @staticmethod
    def _outputs(scratch, sizes, outputs):
        if scratch is None:
            return
        slices = []
        for n in sizes:
            got = scratch.allocate(n) if n > 0 else None
            if got is None:
                return  # results inline
            slices.append(scratch.slice(got[0], n))
        outputs.extend(slices)

    # -- GPU tensors ------------------------------------------------------------------------

    def _gpu_of(self, named):
        """The GPU of a call whose tensors ((name, tensor or None) pairs) are on one GPU; None
        when they are in host memory. ValueError naming two that are on different devices.
        Host tensors without bytes go with any device."""
        memory = self.device_memory
        where = []
        for name, t in named:
            if t is None:
                continue
            index = memory.device_of(t)
            if index is None and t.device.type == "cpu" and t.numel() == 0:
                continue
            where.append((name, index))
        if not where:
            return None
        label = lambda index: "cpu" if index is None else memory.name(index)
        first_name, first = where[0]
        for name, index in where[1:]:
            if index != first:
                raise ValueError("%s is on %s but %s is on %s: the tensors of one call must be "
                                 "on one device" % (first_name, label(first), name, label(index)))
        return first

    def _uuid(self, index):
        with self._lock:
            known = self._uuids.get(index)
        if known is None:
            known = self.device_memory.uuid(index)
            with self._lock:
                self._uuids[index] = known
        return known

    def _gpu_slice(self, t, index, regions):
        """The RegionSlice of `t` (contiguous, on GPU `index`, with bytes), its allocation
        registered as a device region first when it is not yet; the region's name is added to
        `regions`."""
        memory = self.device_memory
        alloc = memory.allocation(t)
        key = (index, alloc.base)
        with self._lock:
            known = self._gpu_allocations.get(key)
        if known is not None and known[1] != alloc.handle:
            # The address is another allocation's now: the one registered was freed.
            self._forget_gpu(key, known[0])
            self._unregister_freed()
            known = None
        if known is None:
            name = "py-gpu-%d-%s-%d" % (os.getpid(), _GPU_TAG, next(_gpu_regions))
            request = pb.RegisterDeviceRegionRequest(
                name=name, ipc_handle=alloc.handle, device=memory.name(index),
                device_uuid=self._uuid(index), byte_size=alloc.size,
                lease_seconds=self.lease_seconds)
            self._call(self._stub.RegisterDeviceRegion, request)
            with self._lock:
                raced = self._gpu_allocations.get(key)
                if raced is not None and raced[1] == alloc.handle:
                    self._gpu_freed.append((None, name))  # another call registered it meanwhile
                else:
                    self._gpu_allocations[key] = (name, alloc.handle)
                    self._device_regions[name] = request
                    raced = None
            if raced is None:
                memory.watch(alloc, index, lambda: self._forget_gpu(key, name))
                known = (name, alloc.handle)
            else:
                known = raced
        regions.append(known[0])
        return pb.RegionSlice(region=known[0], offset=t.data_ptr() - alloc.base,
                              byte_size=t.numel() * t.element_size())

    def _forget_gpu(self, key, name):
        """Region `name` of allocation `key` is no longer to be used (the allocation was
        freed): forgotten and unregistered by the next call or close. Takes no lock: the device
        memory may say so from a finalizer, in any thread, at any moment."""
        self._gpu_freed.append((key, name))

    def _unregister_freed(self, everything=False):
        """Forgets and unregisters the regions of allocations freed since the last call (or
        every device region of the client, with `everything`)."""
        names = []
        with self._lock:
            if everything:
                self._gpu_freed.extend((None, name) for name in self._device_regions)
                self._gpu_allocations.clear()
            while self._gpu_freed:
                key, name = self._gpu_freed.popleft()
                if key is not None and self._gpu_allocations.get(key, (None,))[0] == name:
                    del self._gpu_allocations[key]
                if self._device_regions.pop(name, None) is not None or key is None:
                    names.append(name)
        for name in names:
            try:
                self._call(self._stub.UnregisterRegion, pb.UnregisterRegionRequest(name=name),
                           retries=0)
            except PackdError:
                pass  # gone already (its lease ran out), or the server is away: its lease ends it

    def _encode_gpu(self, t, number, outgoing, index, regions):
        """Adds GPU tensor `t` (contiguous) as tensor field `number`: a slice of its device
        region, or no bytes when it has none."""
        header = pb.Tensor()
        _tensors.header(t, header)
        if t.numel() == 0:
            outgoing.add(number, header, memoryview(b""))
        else:
            header.region.CopyFrom(self._gpu_slice(t, index, regions))
            outgoing.add(number, header)

    def _on_gpu(self, index, method, message, inputs, outputs):
        """A call on GPU `index`: `inputs` ((field number, tensor) pairs) sent as slices of
        their device regions, the results written into `outputs` (GPU tensors; none has no
        bytes) when given, else returned inline. The reply and its inline tensors."""
        memory = self.device_memory
        self._unregister_freed()
        memory.synchronize(index)  # the inputs written, the outputs' memory free
        regions = []

        def request():
            del regions[:]
            out = _wire.Outgoing(message)
            del out.message.outputs[:]
            for number, t in inputs:
                self._encode_gpu(t, number, out, index, regions)
            out.message.outputs.extend(self._gpu_slice(o, index, regions) for o in outputs)
            return out

        return self._with_regions(lambda: self._call(method, request()), None, regions)

    def _gpu_outputs(self, shapes, index):
        """Result memory on GPU `index`, one tensor per (shape, dtype); none at all when one
        would have no bytes (results then come inline: a slice of none names no memory)."""
        if any(torch.Size(shape).numel() == 0 for shape, _ in shapes):
            return []
        return [self.device_memory.empty(shape, dtype, index) for shape, dtype in shapes]

    def _gpu_results(self, messages, inline, outputs, index):
        """The result tensors on GPU `index`: `outputs` where packd wrote them (checked against
        the reply's shapes), else the inline ones copied there."""
        if not outputs:
            return [self.device_memory.to_device(t, index) for t in inline]
        for m, o in zip(messages, outputs):
            if not m.HasField("region") or list(m.shape) != list(o.shape):
                raise PackdError(grpc.StatusCode.INTERNAL,
                                 "packd answered shape %s for a result of shape %s"
                                 % (list(m.shape), list(o.shape)))
        return list(outputs)

    def _check_device_argument(self, device, index):
        if device and device not in (self.device_memory.name(index), "uuid:" + self._uuid(index)):
            raise ValueError("device=%r names where host tensors run; these tensors are on %s, "
                             "where the call runs" % (device, self.device_memory.name(index)))

    def to_device_of(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`t` on the GPU that holds `like`, when `t` is not there (a gradient autograd left in
        host memory); `t` itself otherwise."""
        memory = self.device_memory
        index = memory.device_of(like)
        if index is None or memory.device_of(t) == index or t.numel() == 0:
            return t
        return memory.to_device(t.detach().cpu(), index)

    # -- the API ----------------------------------------------------------------------------

    def _pack_in_parts(self, tensors, mask, segment_ids, scratch, nbytes, device,
                       with_position_ids, layout):
        """The PackResponse, packed and shifted tensors of a Pack: one call (through `scratch`
        when given), or parts of the rows on their own connections, joined. A layout's rows
        (padded, CP slices) are the whole batch's: such a call goes whole, its results inline."""
        laid_out = layout.any()

        def request(rows):
            if scratch is not None:
                scratch.reset()
            out = _wire.Outgoing(pb.PackRequest(device=device,
                                                with_position_ids=with_position_ids))
            layout.to_pack(out.message)
            self._encode(_rows(mask, rows), 1, out, scratch)
            for t in tensors:
                self._encode(_rows(t, rows), 2, out, scratch)
            if segment_ids is not None:
                self._encode(_rows(segment_ids, rows), 6, out, scratch)
            if not laid_out:
                self._outputs(scratch, [t.numel() * t.element_size() for t in tensors],
                              out.message.outputs)
            return out

        extra = [] if segment_ids is None else [segment_ids]
        parts = (self._parts(nbytes, scratch, mask.shape[0])
                 if self._by_rows(mask, tensors + extra) and not laid_out else 1)
        if parts == 1:
            reply, results = self._with_regions(
                lambda: self._call(self._pack[0], request(None)), scratch)
            return (reply, [self._decode(m, t, scratch)
                            for m, t in zip(reply.packed, results.get(1, []))],
                    results.get(14, []))
        bounds = self._bounds(mask.shape[0], parts)
        replies = self._in_parts(
            self._pack, [request(slice(bounds[k], bounds[k + 1])) for k in range(parts)])
        packed = [torch.cat([r[1][1][i] for r in replies]) for i in range(len(tensors))]
        return _joined(replies, bounds[:-1]), packed, []

    def pack(self, x_or_tensors: TensorOrList, mask: torch.Tensor,
             with_position_ids: bool = False, cu_seqlens_dtype: torch.dtype = torch.int64,
             device: str = "", segment_ids: Optional[torch.Tensor] = None, *,
             pad_multiple: int = 0, pad_values: Optional[Sequence[Number]] = None,
             cp_size: int = 0, cp_rank: int = 0, with_seq_idx: bool = False,
             shifts: Shifts = (), fixed: Fixed = None, sp_size: int = 0,
             sp_rank: int = 0) -> PackResult:
        """Packs each [B, S, *tail] tensor with one scan of the [B, S] mask (nonzero is active):
        packed[i] = tensors[i][mask != 0]. With segment_ids ([B, S], an integer dtype), the
        active tokens of each row are also cut into documents where the id changes: the doc_*
        fields describe them and position_ids restart at each (docs/design.md §8).

        Layouts for parallel attention (packd.Layout, docs/operation.md): pad_multiple,
        pad_values, cp_size / cp_rank, sp_size / sp_rank (Ulysses), with_seq_idx, shifts
        ([(input, fill)]: next-token views in `shifted`) and fixed ((tokens, sequences,
        max_seqlen)). Raises PackdValueError (a ValueError) for malformed input, PackdError for
        the rest."""
        layout = _layout(pad_multiple, pad_values, cp_size, cp_rank, with_seq_idx, shifts, fixed,
                         sp_size, sp_rank)
        single = isinstance(x_or_tensors, torch.Tensor)
        tensors = [x_or_tensors] if single else list(x_or_tensors)
        gpu = self._gpu_of([("mask", mask), ("segment_ids", segment_ids)]
                           + [("inputs[%d]" % i, t) for i, t in enumerate(tensors)])
        if gpu is not None:
            self._check_device_argument(device, gpu)
            reply, packed, shifted = self._pack_on_gpu(gpu, tensors, mask, segment_ids,
                                                       with_position_ids, layout)
            place = lambda t: self.device_memory.to_device(t, gpu)
        else:
            nbytes = mask.numel() * mask.element_size() + sum(
                2 * t.numel() * t.element_size() for t in tensors)
            scratch = self._scratch_for(nbytes)
            try:
                reply, packed, shifted = self._pack_in_parts(
                    tensors, mask, segment_ids, scratch, nbytes, device, with_position_ids,
                    layout)
            finally:
                self._give_back(scratch)
            place = lambda t: t

        return _pack_result(reply, packed, shifted, single, cu_seqlens_dtype,
                            segment_ids is not None, with_position_ids, layout, place)

    def _pack_on_gpu(self, index, tensors, mask, segment_ids, with_position_ids, layout):
        """The PackResponse, packed and shifted tensors of a Pack on GPU `index`, written by
        packd into tensors allocated there (a layout's results come inline and are copied
        there)."""
        mask = mask.contiguous()
        tensors = [t.contiguous() for t in tensors]
        inputs = [(1, mask)] + [(2, t) for t in tensors]
        if segment_ids is not None:
            inputs.append((6, segment_ids.contiguous()))
        outputs = []
        if mask.dim() == 2 and all(t.dim() >= 2 for t in tensors) and not layout.any():
            active = int(torch.count_nonzero(mask))
            outputs = self._gpu_outputs([([active] + list(t.shape[2:]), t.dtype)
                                         for t in tensors], index)
        message = pb.PackRequest(device="uuid:" + self._uuid(index),
                                 with_position_ids=with_position_ids)
        layout.to_pack(message)
        reply, inline = self._on_gpu(index, self._pack[0], message, inputs, outputs)
        return (reply, self._gpu_results(reply.packed, inline.get(1, []), outputs, index),
                self._gpu_results(reply.shifted, inline.get(14, []), [], index))

    def scatter(self, packed_or_tensors: TensorOrList, mask: torch.Tensor,
                tail_shape: Optional[Sequence[int]] = None, device: str = "",
                segment_ids: Optional[torch.Tensor] = None, *, pad_multiple: int = 0,
                cp_size: int = 0, cp_rank: int = 0, fixed: Fixed = None, sp_size: int = 0,
                sp_rank: int = 0) -> TensorOrList:
        """The inverse of pack: each [total_active, *tail] back to [B, S, *tail], zeros at
        inactive positions. tail_shape, when given, must equal every packed[i].shape[1:].
        With the layout of a Pack (segment_ids, pad_multiple, cp_size / cp_rank, sp_size /
        sp_rank, fixed), the packed rows are that layout's: pad rows, ghost rows and other CP
        or SP ranks' positions are dropped (the gradient of that Pack)."""
        layout = _layout(pad_multiple, None, cp_size, cp_rank, False, (), fixed, sp_size,
                         sp_rank)
        single = isinstance(packed_or_tensors, torch.Tensor)
        tensors = [packed_or_tensors] if single else list(packed_or_tensors)
        gpu = self._gpu_of([("mask", mask), ("segment_ids", segment_ids)]
                           + [("packed[%d]" % i, t) for i, t in enumerate(tensors)])
        if gpu is not None:
            self._check_device_argument(device, gpu)
            dense = self._scatter_on_gpu(gpu, tensors, mask, tail_shape, segment_ids, layout)
            return dense[0] if single else dense
        laid_out = layout.any() or segment_ids is not None
        positions = mask.numel()
        dense_sizes = [positions * (t[0].numel() if t.dim() > 0 and t.shape[0] > 0 else 0)
                       * t.element_size() for t in tensors]
        nbytes = mask.numel() * mask.element_size() + sum(
            t.numel() * t.element_size() for t in tensors) + sum(dense_sizes)
        scratch = self._scratch_for(nbytes)

        def request(mask_rows, packed_rows):
            if scratch is not None:
                scratch.reset()
            out = _wire.Outgoing(pb.ScatterRequest(device=device))
            layout.to_scatter(out.message)
            self._encode(_rows(mask, mask_rows), 1, out, scratch)
            for t in tensors:
                self._encode(_rows(t, packed_rows), 2, out, scratch)
            if segment_ids is not None:
                self._encode(_rows(segment_ids, mask_rows), 6, out, scratch)
            if tail_shape is not None:
                out.message.tail_shape.dims.extend(list(tail_shape))
            if all(n > 0 for n in dense_sizes):
                self._outputs(scratch, dense_sizes, out.message.outputs)
            return out

        try:
            parts = (self._parts(nbytes, scratch, mask.shape[0])
                     if mask.dim() == 2 and not laid_out else 1)
            if parts > 1:
                # Part k's packed rows start at the active count before its first row.
                bounds = self._bounds(mask.shape[0], parts)
                before = [0] + (mask != 0).sum(1).cumsum(0).tolist()
                first = [before[b] for b in bounds]
                if all(t.dim() >= 1 and t.shape[0] == first[-1] for t in tensors):
                    replies = self._in_parts(self._scatter, [
                        request(slice(bounds[k], bounds[k + 1]), slice(first[k], first[k + 1]))
                        for k in range(parts)])
                    dense = [torch.cat([r[1][1][i] for r in replies])
                             for i in range(len(tensors))]
                    return dense[0] if single else dense
            reply, results = self._with_regions(
                lambda: self._call(self._scatter[0], request(None, None)), scratch)
            dense = [self._decode(m, t, scratch) for m, t in zip(reply.dense, results.get(1, []))]
        finally:
            self._give_back(scratch)
        return dense[0] if single else dense

    def _scatter_on_gpu(self, index, tensors, mask, tail_shape, segment_ids, layout):
        """The dense tensors of a Scatter on GPU `index`, written by packd into tensors
        allocated there."""
        mask = mask.contiguous()
        tensors = [t.contiguous() for t in tensors]
        outputs = []
        if mask.dim() == 2 and all(t.dim() >= 1 for t in tensors):
            outputs = self._gpu_outputs([(list(mask.shape) + list(t.shape[1:]), t.dtype)
                                         for t in tensors], index)
        message = pb.ScatterRequest(device="uuid:" + self._uuid(index))
        layout.to_scatter(message)
        if tail_shape is not None:
            message.tail_shape.dims.extend(list(tail_shape))
        inputs = [(1, mask)] + [(2, t) for t in tensors]
        if segment_ids is not None:
            inputs.append((6, segment_ids.contiguous()))
        reply, inline = self._on_gpu(index, self._scatter[0], message, inputs, outputs)
        return self._gpu_results(reply.dense, inline.get(1, []), outputs, index)

    def plan_micro_batches(self, lengths: Sequence[int], max_tokens: int, *, num_ranks: int = 1,
                           micro_batch_multiple: int = 1,
                           loss_tokens: Optional[Sequence[int]] = None,
                           cost: Optional[Tuple[Number, Number]] = None,
                           costs: Optional[Sequence[Number]] = None,
                           groups: Optional[Sequence[int]] = None, pad_multiple: int = 0,
                           pipeline_order: bool = False) -> pb.PlanResponse:
        """Plans micro-batches over data-parallel ranks (docs/design.md §9, §11).

        cost=(a, b) balances ranks by a * P + b * P**2 for each sample (P: its length padded to
        pad_multiple), e.g. (24576, 1) for a 7B-class model, (0, 1) for attention alone; or
        costs= gives one cost per sample. Without either, the cost is P. groups= gives a group id
        per sample: a group's samples share one micro-batch. The budget counts padded tokens.
        pipeline_order=True emits each rank's micro-batches costliest in the middle.

        Returns the PlanResponse: micro_batches (rank, samples, tokens, loss_tokens, cost,
        padded_tokens; by rank, then position), micro_batches_per_rank, imbalance (tokens),
        cost_imbalance, global_loss_tokens (divide the summed per-token loss of all micro-batches
        of all ranks by it) and global_sequences (divide a sum of per-sequence mean losses by it).
        """
        if cost is not None and costs is not None:
            raise ValueError("give cost=(a, b) or costs=, not both")
        request = pb.PlanRequest(lengths=[int(v) for v in lengths],
                                 max_tokens_per_micro_batch=int(max_tokens),
                                 num_ranks=num_ranks, micro_batch_multiple=micro_batch_multiple,
                                 pad_multiple=int(pad_multiple),
                                 pipeline_order=bool(pipeline_order))
        if loss_tokens is not None:
            request.loss_tokens.extend(int(v) for v in loss_tokens)
        if cost is not None:
            a, b = cost
            request.cost_per_token, request.cost_per_token_squared = float(a), float(b)
        if costs is not None:
            request.costs.extend(float(v) for v in costs)
        if groups is not None:
            request.groups.extend(int(v) for v in groups)
        return self._call(self._stub.PlanMicroBatches, request)

    def pack_micro_batches(self, x_or_tensors: TensorOrList, mask: torch.Tensor,
                           max_tokens: int, *, num_ranks: int = 1,
                           ranks: Optional[Sequence[int]] = None, micro_batch_multiple: int = 1,
                           loss_mask: Optional[torch.Tensor] = None,
                           segment_ids: Optional[torch.Tensor] = None,
                           cost: Optional[Tuple[Number, Number]] = None,
                           groups: Optional[Sequence[int]] = None, pipeline_order: bool = False,
                           with_position_ids: bool = False,
                           cu_seqlens_dtype: torch.dtype = torch.int64, device: str = "",
                           pad_multiple: int = 0, pad_values: Optional[Sequence[Number]] = None,
                           cp_size: int = 0, cp_rank: int = 0, with_seq_idx: bool = False,
                           shifts: Shifts = (), fixed: Fixed = None, sp_size: int = 0,
                           sp_rank: int = 0) -> StepPlan:
        """A training step in one call (docs/design.md §12): the batch's rows planned into
        micro-batches of at most max_tokens tokens over num_ranks data-parallel ranks, each
        micro-batch packed with the layout, from one upload of the batch.

        A row's length for the plan is its rows in the layout (its sequences padded to
        pad_multiple) on one GPU: divided by cp_size, or by sp_size rounded up, so max_tokens
        is a per-GPU budget; its cost is cost=(a, b)'s a * P + b * P**2 summed over its
        sequences (documents, with segment_ids), by default P; its loss tokens are the
        positions active in both mask and loss_mask ([B, S], default: mask), counted whole
        (every CP or SP rank gets the same plan and global_loss_tokens). groups= gives
        rows that must share a micro-batch. ranks= chooses the ranks whose micro-batches are
        sent (default: all). The layout options and with_position_ids are Pack's, and `fixed`
        applies to every micro-batch.

        Returns a StepPlan: `.plan` at once (global_loss_tokens is the one denominator of the
        summed token loss), then iterate it for MicroBatch(rank, index, samples, result), each
        result exactly pack() of the batch's rows `samples` in that order. Tensors must be in
        host memory. Raises PackdValueError (a ValueError) for malformed input."""
        layout = _layout(pad_multiple, pad_values, cp_size, cp_rank, with_seq_idx, shifts, fixed,
                         sp_size, sp_rank)
        single = isinstance(x_or_tensors, torch.Tensor)
        tensors = [x_or_tensors] if single else list(x_or_tensors)
        named = ([("mask", mask), ("segment_ids", segment_ids), ("loss_mask", loss_mask)]
                 + [("inputs[%d]" % i, t) for i, t in enumerate(tensors)])
        on_device = [name for name, t in named if t is not None and t.device.type != "cpu"]
        if on_device:
            raise ValueError("pack_micro_batches takes tensors in host memory; %s are on %s"
                             % (", ".join(on_device), named[[n for n, _ in named].index(
                                 on_device[0])][1].device))
        plan = pb.PlanRequest(max_tokens_per_micro_batch=int(max_tokens), num_ranks=num_ranks,
                              micro_batch_multiple=micro_batch_multiple,
                              pipeline_order=bool(pipeline_order))
        if cost is not None:
            a, b = cost
            plan.cost_per_token, plan.cost_per_token_squared = float(a), float(b)
        if groups is not None:
            plan.groups.extend(int(v) for v in groups)
        nbytes = sum(t.numel() * t.element_size() for _, t in named if t is not None)
        scratch = self._scratch_for(nbytes)

        def request():
            if scratch is not None:
                scratch.reset()
            out = _wire.Outgoing(pb.PackMicroBatchesRequest(plan=plan, ranks=list(ranks or ())))
            batch = _wire.Outgoing(pb.PackRequest(device=device,
                                                  with_position_ids=with_position_ids))
            layout.to_pack(batch.message)
            self._encode(mask, 1, batch, scratch)
            for t in tensors:
                self._encode(t, 2, batch, scratch)
            if segment_ids is not None:
                self._encode(segment_ids, 6, batch, scratch)
            out.add_message(1, batch)
            if loss_mask is not None:
                self._encode(loss_mask, 3, out, scratch)
            return out

        def start(message, timeout, metadata):
            # The call, and its first message (the plan): until it comes, a call answered
            # UNAVAILABLE or CANCELLED is made again, as unary calls are.
            call = self._step(message, timeout=timeout, metadata=metadata)
            try:
                return call, next(call)
            except grpc.RpcError as e:
                call.cancel()
                raise e
            except StopIteration:
                raise PackdError(grpc.StatusCode.INTERNAL,
                                 "packd ended the PackMicroBatches stream without a plan")

        try:
            call, first = self._with_regions(lambda: self._call(start, request()), scratch)
        except BaseException:
            self._give_back(scratch)
            raise
        return StepPlan(self, call, first[0], scratch,
                        (single, cu_seqlens_dtype, segment_ids is not None, with_position_ids,
                         layout))

    def register_cuda_tensor(self, name: str, tensor: torch.Tensor,
                             device: Optional[str] = None) -> pb.RegionSlice:
        """Registers the CUDA memory holding `tensor` as device region `name` and returns the
        slice (packd.v1.RegionSlice) that addresses the tensor in it, for requests' inputs or
        outputs on the server's GPU.

        An IPC handle exports a whole allocation from its start, and PyTorch's caching
        allocator puts many tensors in one allocation, so the region is the allocation's head
        up to the end of the tensor's storage, and the slice's offset is the tensor's offset
        from the allocation's start (docs/gpu.md, "Device regions"). `device` is the server's
        name for the GPU ("cuda:N"), by default the tensor's own index.
        """
        if not tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError("register_cuda_tensor takes a contiguous CUDA tensor")
        storage = tensor.untyped_storage()
        shared = storage._share_cuda_()
        handle, storage_bytes, storage_offset = shared[1], shared[2], shared[3]
        offset, byte_size = device_slice(storage_offset, storage_bytes,
                                         tensor.storage_offset() * tensor.element_size(),
                                         tensor.numel() * tensor.element_size())
        request = pb.RegisterDeviceRegionRequest(
            name=name, ipc_handle=handle, device=device or "cuda:%d" % tensor.device.index,
            byte_size=storage_offset + storage_bytes, lease_seconds=self.lease_seconds)
        self._call(self._stub.RegisterDeviceRegion, request)
        with self._lock:
            self._device_regions[name] = request
        return pb.RegionSlice(region=name, offset=offset, byte_size=byte_size)

    def info(self) -> pb.ServerInfo:
        return self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest())

    def close(self) -> None:
        """Unregisters the client's idle scratch segments (those of calls still running go when
        they end) and its device regions, and closes every connection."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for seg in idle:
            seg.close()
        self._unregister_freed(everything=True)
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
