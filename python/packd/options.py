"""The option objects the client's calls take: how a step is planned (PlanOptions) and how a
Client connects (TlsOptions, TokenOptions, SharedMemoryOptions, ConnectionOptions, GpuOptions).
A layout is packd.Layout (packd/layout.py).

    plan = packd.PlanOptions(num_ranks=4, cost=(24576, 1))
    step = client.pack_micro_batches(tensors, mask, 8192, plan=plan,
                                     layout=packd.Layout(shifts=[(1, -100)]))
    client = packd.Client("dns:///packd:50051", tls=packd.TlsOptions(ca_file="ca.pem"),
                          shared_memory=packd.SharedMemoryOptions(threshold_bytes=0))

The keywords these objects replace still work for a release, each with a
PackdDeprecationWarning naming its replacement."""
import dataclasses
import warnings
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, TypeVar, Union

from packd.v1 import pack_service_pb2 as pb

Number = Union[int, float]


class PackdDeprecationWarning(DeprecationWarning):
    """A keyword packd still takes, for a release, beside the option object that replaces it."""


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How a step's rows are planned into micro-batches (docs/design.md §11, §12). num_ranks:
    the data-parallel ranks; micro_batch_multiple: each rank's count of micro-batches a
    multiple of it; cost=(a, b): a sequence of P tokens costs a * P + b * P**2 (default: P),
    e.g. (24576, 1) for a 7B-class model; groups: one id per row, rows with equal ids share a
    micro-batch; pipeline_order: each rank's micro-batches costliest in the middle."""
    num_ranks: int = 1
    micro_batch_multiple: int = 1
    cost: Optional[Tuple[Number, Number]] = None
    groups: Optional[Sequence[int]] = None
    pipeline_order: bool = False

    def to(self, message: pb.PlanRequest) -> None:
        """Sets a PlanRequest's planning fields (not its lengths or budget)."""
        message.num_ranks = int(self.num_ranks)
        message.micro_batch_multiple = int(self.micro_batch_multiple)
        message.pipeline_order = bool(self.pipeline_order)
        if self.cost is not None:
            a, b = self.cost
            message.cost_per_token, message.cost_per_token_squared = float(a), float(b)
        if self.groups is not None:
            message.groups.extend(int(v) for v in self.groups)


@dataclasses.dataclass(frozen=True)
class TlsOptions:
    """TLS, for a server with --tls_cert_file: ca_file, the PEM CA certificates that signed its
    certificate; cert_file / key_file: this client's certificate and key, for mutual TLS;
    server_name: the name the server's certificate carries when it is not the address's host
    (unix sockets: "localhost")."""
    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    server_name: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class TokenOptions:
    """A bearer token for a server with --auth_token_file, sent on every call: the first line
    of `file`, else the environment variable `env`."""
    file: Optional[str] = None
    env: Optional[str] = "PACKD_TOKEN"


@dataclasses.dataclass(frozen=True)
class SharedMemoryOptions:
    """Calls whose tensors hold at least threshold_bytes travel through shared memory when the
    server is on this node and allows it (0: never); each call in flight has a segment of its
    own, and idle_segments of them are kept for later calls. key_prefix: the server's
    --shm_key_prefix. lease_seconds: the server drops a region no call has named for that long
    (the client registers it again when a call finds it gone; 0: no lease). step_results:
    pack_micro_batches asks for its results in an arena after the batch in the call's segment,
    as large as the last step's results (docs/design.md §12; False: always inline)."""
    threshold_bytes: int = 4 << 20
    key_prefix: str = "/packd"
    lease_seconds: int = 30
    idle_segments: int = 4
    step_results: bool = True


@dataclasses.dataclass(frozen=True)
class ConnectionOptions:
    """max_message_bytes: the largest message either way; load_balancing_policy: gRPC's
    (None: "round_robin" for dns:/// addresses, pick_first otherwise); connections: channels,
    over which inline calls of at least split_threshold_bytes go as parts of the rows at once
    (0: never split); keep_freed_memory: tune this process's malloc to keep freed memory mapped
    (packd/_memory.py), which makes large inline calls several times faster."""
    max_message_bytes: int = 1 << 30
    load_balancing_policy: Optional[str] = None
    connections: int = 2
    split_threshold_bytes: int = 16 << 20
    keep_freed_memory: bool = True


@dataclasses.dataclass(frozen=True)
class GpuOptions:
    """lease_seconds: the lease of the CUDA allocations this client registers as device
    regions; device_memory: the seam to the GPU runtime (packd._device.DeviceMemory; default:
    torch's CUDA tensors)."""
    lease_seconds: int = 10
    device_memory: Optional[Any] = None


Options = TypeVar("Options")


def with_deprecated(call: str, argument: str, given: Optional[Options], default: Options,
                    old: Mapping[str, Any], fields: Mapping[str, str]) -> Options:
    """The option object a call uses: `given`, or `default` with the deprecated keywords `old`
    (each the object's field fields[name]) set on it, warning once per call that names them.
    TypeError for a keyword the call never took; ValueError for both forms at once."""
    unknown = sorted(set(old) - set(fields))
    if unknown:
        raise TypeError("%s() got an unexpected keyword argument %r" % (call, unknown[0]))
    if not old:
        return default if given is None else given
    if given is not None:
        raise ValueError("%s(): give %s= or the keywords %s, not both"
                         % (call, argument, ", ".join(sorted(old))))
    kind = type(default).__name__
    replacement = ", ".join("%s=..." % fields[name] for name in sorted(old))
    warnings.warn("%s(%s) is deprecated: pass %s=packd.%s(%s)"
                  % (call, ", ".join("%s=..." % name for name in sorted(old)), argument, kind,
                     replacement), PackdDeprecationWarning, stacklevel=3)
    return dataclasses.replace(default, **{fields[name]: value for name, value in old.items()})


def same_names(names: Sequence[str]) -> Dict[str, str]:
    """Keywords that keep their names as the option object's fields."""
    return {name: name for name in names}


def split_deprecated(old, *groups):
    """The deprecated keywords `old`, one dict per group of names, and the rest last."""
    parts = [{k: v for k, v in old.items() if k in g} for g in groups]
    known = set().union(*groups)
    return parts + [{k: v for k, v in old.items() if k not in known}]
