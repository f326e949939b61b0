"""The connection to a packd server under a Client: channels (several, for calls in parts),
TLS, the bearer token, deadlines, and calls retried with backoff on UNAVAILABLE and CANCELLED.
Safe to share across threads, as gRPC channels are; it holds no state a call changes."""
import os
import time
from typing import Any, Optional, Sequence, Union

import grpc

from packd import _wire
from packd.options import ConnectionOptions, TlsOptions, TokenOptions
from packd.v1 import pack_service_pb2 as pb
from packd.v1 import pack_service_pb2_grpc as pb_grpc

Interceptor = Union[grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor]

# What a call is retried on: UNAVAILABLE (the server is draining, restarting or unreachable) and
# CANCELLED (this client cancels nothing, so a server going away did: gRPC cancels the calls that
# reach a server while it shuts down, before a handler sees them, grpc/grpc#41785). Every packd
# call may be repeated.
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
INITIAL_BACKOFF = 0.05  # seconds, doubling between attempts up to
MAX_BACKOFF = 2.0


class PackdError(Exception):
    """A call packd refused or could not complete. `code` is the grpc.StatusCode, `details` the
    server's message. Malformed requests (INVALID_ARGUMENT) also derive from ValueError."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class PackdValueError(PackdError, ValueError):
    """INVALID_ARGUMENT: the request was malformed (shapes, dtypes, tail_shape, ...)."""


def error(rpc_error: grpc.RpcError) -> PackdError:
    code, details = rpc_error.code(), rpc_error.details()
    cls = PackdValueError if code == grpc.StatusCode.INVALID_ARGUMENT else PackdError
    return cls(code, details)


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


def is_node_local(address: str) -> bool:
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


class Connection:
    """Channels to `address` (`connections` of them: channels with different arguments share
    none), the stub, and packd's raw methods on each (Pack and Scatter skip protobuf's copies of
    tensor bytes: packd/_wire.py)."""

    def __init__(self, address: str, *, timeout: float, retries: int,
                 connection: ConnectionOptions, tls: TlsOptions, token: TokenOptions,
                 interceptors: Sequence[Interceptor]) -> None:
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self._metadata = _token_metadata(token.file, token.env)
        limit = min(connection.max_message_bytes, (1 << 31) - 1)
        credentials = _tls_credentials(tls.ca_file, tls.cert_file, tls.key_file)
        extra = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
        self.load_balancing_policy = connection.load_balancing_policy
        if self.load_balancing_policy is None and address.startswith("dns:"):
            self.load_balancing_policy = "round_robin"
        if self.load_balancing_policy:
            extra.append(("grpc.lb_policy_name", self.load_balancing_policy))

        def channel(i):
            # Reconnect as often as calls are retried: gRPC's own backoff (1 s, growing to
            # 2 min) would leave a restarted server unreached while the retries run out.
            options = [("grpc.max_send_message_length", limit),
                       ("grpc.max_receive_message_length", limit),
                       ("grpc.initial_reconnect_backoff_ms", int(INITIAL_BACKOFF * 1000)),
                       ("grpc.max_reconnect_backoff_ms", int(MAX_BACKOFF * 1000)),
                       ("grpc.http2.lookahead_bytes", 64 << 20),
                       ("packd.connection", i)] + extra
            if credentials is None:
                made = grpc.insecure_channel(address, options=options)
            else:
                made = grpc.secure_channel(address, credentials, options=options)
            return grpc.intercept_channel(made, *interceptors) if interceptors else made

        self.channels = [channel(i) for i in range(max(1, connection.connections))]
        self.stub = pb_grpc.PackServiceStub(self.channels[0])
        self.pack = [c.unary_unary(
            "/packd.v1.PackService/Pack", request_serializer=_wire.serialize,
            response_deserializer=_wire.parser(pb.PackResponse, pb.Tensor))
            for c in self.channels]
        self.scatter = [c.unary_unary(
            "/packd.v1.PackService/Scatter", request_serializer=_wire.serialize,
            response_deserializer=_wire.parser(pb.ScatterResponse, pb.Tensor))
            for c in self.channels]
        self.step = self.channels[0].unary_stream(
            "/packd.v1.PackService/PackMicroBatches", request_serializer=_wire.serialize,
            response_deserializer=_wire.parser(pb.PackMicroBatchesResponse, pb.Tensor))
        # The streaming step's: a group's tensors sent from their own memory, a rank's
        # micro-batches read as PackMicroBatches' are.
        self.submit_group = self.channels[0].unary_unary(
            "/packd.v1.PackService/SubmitGroup", request_serializer=_wire.serialize,
            response_deserializer=pb.SubmitGroupResponse.FromString)
        self.receive_step = self.channels[0].unary_stream(
            "/packd.v1.PackService/ReceiveStep",
            request_serializer=pb.ReceiveStepRequest.SerializeToString,
            response_deserializer=_wire.parser(pb.PackMicroBatchesResponse, pb.Tensor))

    def metadata_for(self, request: Any):
        """The call's metadata: the token, and for Pack and Scatter the request's size, so
        that the server's memory budget admits the call for what it needs."""
        if not isinstance(request, _wire.Outgoing):
            return self._metadata
        return (self._metadata or ()) + (
            ("packd-request-bytes", str(_wire.serialized_size(request))),)

    def call(self, method: Any, request: Any, retries: Optional[int] = None,
             connection: int = 0, attempt_timeout: Optional[float] = None) -> Any:
        """method(request) (a callable of channel `connection`), retried with backoff on the
        codes in RETRIED, every attempt within the one deadline. With attempt_timeout, each
        attempt waits at most that long, and one whose own deadline passed is retried too (for
        calls packd takes once however often they come: SubmitGroup with its group key)."""
        retries = self.retries if retries is None else retries
        deadline = time.monotonic() + self.timeout
        backoff = INITIAL_BACKOFF
        for attempt in range(retries + 1):
            left = max(deadline - time.monotonic(), 1e-3)
            wait = left if attempt_timeout is None else min(left, attempt_timeout)
            try:
                return method(request, timeout=wait, metadata=self.metadata_for(request))
            except grpc.RpcError as e:
                retried = e.code() in RETRIED or (
                    attempt_timeout is not None and wait < left
                    and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
                if (not retried or attempt == retries
                        or time.monotonic() + backoff >= deadline):
                    raise error(e) from None
                self._back_off(connection, backoff)
                backoff = min(2 * backoff, MAX_BACKOFF)

    def _back_off(self, connection, seconds):
        """Waits `seconds` before a retry, meanwhile driving channel `connection` to reconnect:
        in Python, gRPC runs a disconnected channel's reconnect timer only while someone waits on
        the channel, and a server that came back would otherwise stay unreached for seconds."""
        end = time.monotonic() + seconds
        ready = grpc.channel_ready_future(self.channels[connection])
        try:
            ready.result(timeout=seconds)
        except grpc.FutureTimeoutError:
            pass
        finally:
            ready.cancel()
        time.sleep(max(0.0, end - time.monotonic()))

    def in_parts(self, methods: Sequence[Any], requests: Sequence[Any]) -> list:
        """requests[k] on connection k (methods[k] is its callable), all at once; the replies in
        order. A part the server answered UNAVAILABLE or CANCELLED is retried alone."""
        if len(requests) == 1:
            return [self.call(methods[0], requests[0])]
        futures = [m.future(r, timeout=self.timeout, metadata=self.metadata_for(r))
                   for m, r in zip(methods, requests)]
        replies = []
        for connection, (method, request, future) in enumerate(zip(methods, requests, futures)):
            try:
                replies.append(future.result())
            except grpc.RpcError as e:
                if e.code() not in RETRIED:
                    for f in futures:
                        f.cancel()
                    raise error(e) from None
                replies.append(self.call(method, request, connection=connection))  # retried
        return replies

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
