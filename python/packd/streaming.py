"""The streaming step (docs/operation.md, "The streaming step"): the global batch planned while
rollouts arrive. A trainer's controller opens a step (Client.open_step) on one packd replica and
holds it open; rollout workers submit finished groups to it (Client.submit_group, at the
controller's `address`); each trainer rank receives its own micro-batches as waves commit
(Client.receive_step), then the step's global_loss_tokens; the trainer scales its accumulated
gradients by world_size / global_loss_tokens (scale_gradients) before the optimizer step."""
import dataclasses
import queue
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc
import torch

from packd._connection import error
from packd.layout import Layout
from packd.results import MicroBatch, Plan, pack_result
from packd import _tensors
from packd._tensors import FROM_WIRE
from packd.v1 import pack_service_pb2 as pb


@dataclasses.dataclass
class StepSummary:
    """What the controller hears once every rank has been sent its last message."""
    step_id: str
    groups: int
    rows: int
    waves: int                   # committed while groups arrived, before the close
    micro_batches_per_rank: int
    global_loss_tokens: int
    global_sequences: int


@dataclasses.dataclass
class SubmittedGroup:
    group: int      # its index in the step
    first_row: int  # its rows are the step's rows first_row .. first_row + g - 1
    waves: int      # waves committed so far


class StepController:
    """An open streaming step: `step_id` and `address` (the replica holding it) at once;
    close() when the batch is complete returns its StepSummary. The step lives while this
    stream is open: cancel() (or leaving a `with` block without close()) ends it for every
    party."""

    def __init__(self, stub: Any, options: pb.StepOptions, timeout: float,
                 metadata: Optional[Sequence[Tuple[str, str]]]) -> None:
        self._requests: "queue.Queue[Optional[pb.StepControl]]" = queue.Queue()
        self._requests.put(pb.StepControl(open=options))

        def requests() -> Iterator[pb.StepControl]:
            while True:
                item = self._requests.get()
                if item is None:
                    return
                yield item

        self._call = stub.OpenStep(requests(), timeout=timeout, metadata=metadata)
        self.summary: Optional[StepSummary] = None
        try:
            first = next(self._call)
        except grpc.RpcError as e:
            self._requests.put(None)
            raise error(e) from None
        self.step_id, self.address = first.step_id, first.address

    def close(self) -> StepSummary:
        """Closes the step: packd plans what is left as a whole-batch plan would, sends it,
        then every rank its last message. Returns once every rank has been sent it (the ranks
        must be receiving). Raises PackdError with the step's failure."""
        self._requests.put(pb.StepControl(close=pb.StepClose()))
        try:
            last = next(self._call)
        except grpc.RpcError as e:
            raise error(e) from None
        finally:
            self._requests.put(None)
        self.summary = StepSummary(last.step_id, last.groups, last.rows, last.waves,
                                   last.micro_batches_per_rank, last.global_loss_tokens,
                                   last.global_sequences)
        return self.summary

    def cancel(self) -> None:
        """Ends the step for every party (receivers get CANCELLED) and releases it."""
        self._call.cancel()
        self._requests.put(None)

    def __enter__(self) -> "StepController":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.summary is None:
            self.cancel()


def _tensor(msg: pb.Tensor) -> torch.Tensor:
    dtype = FROM_WIRE[msg.dtype]
    shape = list(msg.shape)
    if not msg.data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)


class StepStream:
    """One rank's micro-batches of a streaming step, by iterating it: MicroBatch(rank, index,
    samples, result), `samples` the step's rows (SubmittedGroup.first_row onwards), `result`
    exactly pack() of those rows with the step's layout. Once iterated to the end, `plan` (a
    Plan of every micro-batch the step sent) and `global_loss_tokens` are set."""

    def __init__(self, call: Any, single: bool, documents: bool, with_position_ids: bool,
                 layout: Layout, cu_seqlens_dtype: torch.dtype) -> None:
        self._call = call
        self._options = (single, cu_seqlens_dtype, documents, with_position_ids, layout)
        self.plan: Optional[Plan] = None
        self.global_loss_tokens: Optional[int] = None

    def __iter__(self) -> Iterator[MicroBatch]:
        single, cu_dtype, docs, with_position_ids, layout = self._options
        try:
            for reply in self._call:
                if reply.HasField("plan"):
                    self.plan = Plan.of(reply.plan)
                    self.global_loss_tokens = reply.plan.global_loss_tokens
                    continue
                packed = [_tensor(m) for m in reply.packed.packed]
                shifted = [_tensor(m) for m in reply.packed.shifted]
                yield MicroBatch(reply.rank, reply.index, list(reply.samples), pack_result(
                    reply.packed, packed, shifted, single, cu_dtype, docs, with_position_ids,
                    layout))
        except grpc.RpcError as e:
            raise error(e) from None

    def cancel(self) -> None:
        self._call.cancel()


def scale_gradients(parameters: Iterable[torch.nn.Parameter], world_size: int,
                    global_loss_tokens: int) -> None:
    """Multiplies every gradient by world_size / global_loss_tokens: after each micro-batch's
    summed token loss was backpropagated and the ranks' gradients averaged (the all-reduce
    mean), the gradient of the step's global token mean (docs/design.md §9, §18)."""
    scale = world_size / max(int(global_loss_tokens), 1)
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(scale)


def step_options(max_tokens: int, *, num_ranks: int, layout: Layout, with_position_ids: bool,
                 device: str, cost, micro_batch_multiple: int, policy_version: int,
                 max_staleness: int, step_id: str, wave_fill: float, reserve: Optional[float],
                 timeout_seconds: int) -> pb.StepOptions:
    options = pb.StepOptions(
        plan=pb.PlanRequest(max_tokens_per_micro_batch=int(max_tokens), num_ranks=num_ranks,
                            micro_batch_multiple=micro_batch_multiple),
        layout=pb.PackRequest(device=device, with_position_ids=with_position_ids),
        policy_version=policy_version, max_staleness=max_staleness, step_id=step_id,
        wave_fill=wave_fill, timeout_seconds=timeout_seconds)
    if reserve is not None:
        options.reserve = float(reserve)
    if cost is not None:
        options.plan.cost_per_token, options.plan.cost_per_token_squared = map(float, cost)
    layout.to_pack(options.layout)
    return options


def tensor_message(t: torch.Tensor) -> pb.Tensor:
    """A tensor with its bytes inline."""
    msg = pb.Tensor()
    _tensors.header(t, msg)
    msg.data = _tensors.as_bytes_view(t.contiguous()).numpy().tobytes()
    return msg


def group_request(step_id: str, tensors: List[torch.Tensor], mask: torch.Tensor,
                  policy_version: int, segment_ids, loss_mask,
                  prefix_lengths) -> pb.SubmitGroupRequest:
    request = pb.SubmitGroupRequest(step_id=step_id, policy_version=policy_version,
                                    mask=tensor_message(mask))
    request.inputs.extend(tensor_message(t) for t in tensors)
    if segment_ids is not None:
        request.segment_ids.CopyFrom(tensor_message(segment_ids))
    if loss_mask is not None:
        request.loss_mask.CopyFrom(tensor_message(loss_mask))
    if prefix_lengths is not None:
        request.prefix_lengths.extend(int(v) for v in prefix_lengths)
    return request
