"""The streaming step (docs/operation.md, "The streaming step"): the global batch planned while
rollouts arrive. A trainer's controller opens a step (Client.open_step) on one packd replica and
holds it open; rollout workers submit finished groups to it (Client.submit_group, at the
controller's `address`), each taken once however often it is sent; each trainer rank receives
its own micro-batches as waves commit (Client.receive_step), read with the step's own layout,
then the step's global_loss_tokens; the trainer scales its accumulated gradients by
world_size / global_loss_tokens (scale_gradients) before the optimizer step."""
import dataclasses
import queue
import uuid
import warnings
from typing import Any, Iterable, Iterator, Optional, Sequence, Tuple, Union

import grpc
import torch

from packd._connection import error
from packd._regions import Regions
from packd import _wire
from packd.layout import Layout
from packd.options import PackdDeprecationWarning, PlanOptions, same_names, with_deprecated
from packd.results import MicroBatch, Plan
from packd.step_plan import micro_batch
from packd.v1 import pack_service_pb2 as pb

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]
# open_step's planning keywords that PlanOptions replaces.
_STREAM_PLAN = same_names(["num_ranks", "micro_batch_multiple", "cost"])
# receive_step's keywords that the step's own layout replaces.
_RECEIVE_LAYOUT = ("layout", "with_position_ids", "documents")


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


class StepStream:
    """One rank's micro-batches of a streaming step, by iterating it: MicroBatch(rank, index,
    samples, result), `samples` the step's rows (SubmittedGroup.first_row onwards), `result`
    exactly pack() of those rows with the step's layout, which packd sends with each one. Once
    iterated to the end, `plan` (a Plan of every micro-batch the step sent) and
    `global_loss_tokens` are set."""

    def __init__(self, call: Any, single: bool, cu_seqlens_dtype: torch.dtype) -> None:
        self._call = call
        self._single, self._cu_dtype = single, cu_seqlens_dtype
        self.plan: Optional[Plan] = None
        self.global_loss_tokens: Optional[int] = None

    def __iter__(self) -> Iterator[MicroBatch]:
        try:
            for reply, tensors in self._call:
                if reply.HasField("plan"):
                    self.plan = Plan.of(reply.plan)
                    self.global_loss_tokens = reply.plan.global_loss_tokens
                    continue
                # The step's own layout; documents where its groups carry segment ids.
                layout = reply.layout
                options = (self._single, self._cu_dtype, len(reply.packed.doc_cu_seqlens) > 0,
                           layout.with_position_ids, Layout.of(layout))
                yield micro_batch(reply, tensors, options)
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


def step_options(max_tokens: int, plan: PlanOptions, layout: Layout, *, with_position_ids: bool,
                 device: str, policy_version: int, max_staleness: int, step_id: str,
                 wave_fill: float, reserve: Optional[float], timeout_seconds: int,
                 submitters: Sequence[str]) -> pb.StepOptions:
    options = pb.StepOptions(
        plan=pb.PlanRequest(max_tokens_per_micro_batch=int(max_tokens)),
        layout=pb.PackRequest(device=device, with_position_ids=with_position_ids),
        policy_version=policy_version, max_staleness=max_staleness, step_id=step_id,
        wave_fill=wave_fill, timeout_seconds=timeout_seconds)
    plan.to(options.plan)
    layout.to_pack(options.layout)
    options.submitters.extend(submitters)
    if reserve is not None:
        options.reserve = float(reserve)
    return options


def group_request(step_id: str, tensors: Sequence[torch.Tensor], mask: torch.Tensor,
                  policy_version: int, segment_ids: Optional[torch.Tensor],
                  loss_mask: Optional[torch.Tensor], prefix_lengths: Optional[Sequence[int]],
                  group_key: str = "") -> _wire.Outgoing:
    """A SubmitGroupRequest with its tensors' bytes inline, sent from the tensors' own memory."""
    out = _wire.Outgoing(pb.SubmitGroupRequest(step_id=step_id, policy_version=policy_version,
                                               group_key=group_key))
    fields = pb.SubmitGroupRequest
    Regions.encode(mask, fields.MASK_FIELD_NUMBER, out, None)
    for t in tensors:
        Regions.encode(t, fields.INPUTS_FIELD_NUMBER, out, None)
    if segment_ids is not None:
        Regions.encode(segment_ids, fields.SEGMENT_IDS_FIELD_NUMBER, out, None)
    if loss_mask is not None:
        Regions.encode(loss_mask, fields.LOSS_MASK_FIELD_NUMBER, out, None)
    if prefix_lengths is not None:
        out.message.prefix_lengths.extend(int(v) for v in prefix_lengths)
    return out


class StepCalls:
    """packd.Client's calls of the streaming step (Client inherits them)."""

    def open_step(self, max_tokens: int, *, plan: Optional[PlanOptions] = None,
                  layout: Optional[Layout] = None, with_position_ids: bool = False,
                  device: str = "", policy_version: int = 0, max_staleness: int = 0,
                  step_id: str = "", wave_fill: float = 0.0, reserve: Optional[float] = None,
                  timeout_seconds: int = 0, submitters: Sequence[str] = (),
                  **deprecated: Any) -> StepController:
        """Opens a streaming step (docs/operation.md, "The streaming step") on this replica and
        returns its StepController: `.step_id`, and `.address`, where submitters and ranks reach
        the replica holding it. Groups are planned as they arrive into micro-batches of at most
        max_tokens tokens over plan.num_ranks ranks (packd.PlanOptions: num_ranks, cost and
        micro_batch_multiple, as pack_micro_batches'; groups come whole), packed with `layout`
        (a Layout without cp_rank or sp_rank: each receiver names its own; a shared prefix as
        SharedPrefix((), (), same_inputs): each group brings its prefix lengths). A group whose
        policy version is below policy_version - max_staleness is refused. wave_fill (0: 0.9)
        is how full every rank's micro-batch must be for a wave; `reserve` micro-batches per
        rank are left for the close to balance (default: 1 with several ranks, 0 with one).
        timeout_seconds (0: 3600) bounds the step's life. The step lives while the
        controller's stream is open. It is this client's tenant's: to any other it does not
        exist, except that the tenants named in `submitters` (their token names,
        docs/service.md) may submit groups to it."""
        plan = with_deprecated("open_step", "plan", plan, PlanOptions(), deprecated,
                               _STREAM_PLAN)
        if plan.groups is not None or plan.pipeline_order:
            raise ValueError("open_step: a streaming step plans each group whole as it arrives; "
                             "PlanOptions.groups and pipeline_order are pack_micro_batches'")
        options = step_options(
            max_tokens, plan, layout or Layout(), with_position_ids=with_position_ids,
            device=device, policy_version=policy_version, max_staleness=max_staleness,
            step_id=step_id, wave_fill=wave_fill, reserve=reserve,
            timeout_seconds=timeout_seconds, submitters=submitters)
        return StepController(self._connection.stub, options, self._step_timeout(),
                              self._connection.metadata_for(None))

    def submit_group(self, step_id: str, x_or_tensors: TensorOrList, mask: torch.Tensor, *,
                     policy_version: int = 0, segment_ids: Optional[torch.Tensor] = None,
                     loss_mask: Optional[torch.Tensor] = None,
                     prefix_lengths: Optional[Sequence[int]] = None,
                     group_key: Optional[str] = None,
                     attempt_timeout: Optional[float] = None) -> SubmittedGroup:
        """Submits one finished group to streaming step `step_id` (call the controller's
        `address`): its rows mask [g, S] (g >= 1) and tensors each [g, S, *tail] (the same
        dtypes and tails as every group of the step), optional segment_ids and loss_mask [g, S],
        and with a shared-prefix layout its prompt's length on each row. A group is never split
        where the layout shares its prompt. Raises PackdError: INVALID_ARGUMENT for a malformed
        or empty group (the step goes on), FAILED_PRECONDITION for a stale one or a closed
        step, NOT_FOUND when no such step is open on this replica (or it is another tenant's
        that did not name this one a submitter), RESOURCE_EXHAUSTED when packd's memory is full
        now (retry after a short wait: the step makes room as its ranks read), ALREADY_EXISTS
        for a group_key taken by a group with other content.

        packd takes a group once: group_key (default: a fresh random key for this call) names
        it, so the call is retried like every other (UNAVAILABLE, CANCELLED), and also when an
        attempt's reply does not come within attempt_timeout (default: a quarter of the
        client's timeout); a repeat of a key taken gets the first reply. Give your own key to
        resubmit safely from another process (a worker restarted after a crash)."""
        tensors = [x_or_tensors] if isinstance(x_or_tensors, torch.Tensor) else list(x_or_tensors)
        request = group_request(step_id, tensors, mask, policy_version, segment_ids, loss_mask,
                                prefix_lengths, group_key or uuid.uuid4().hex)
        reply = self._call(self._connection.submit_group, request,
                           attempt_timeout=attempt_timeout or max(self.timeout / 4, 1.0))
        return SubmittedGroup(reply.group, reply.first_row, reply.waves)

    def receive_step(self, step_id: str, rank: int, *, cp_rank: int = 0, single: bool = False,
                     cu_seqlens_dtype: torch.dtype = torch.int64,
                     **ignored: Any) -> StepStream:
        """Rank `rank`'s (and with a CP or SP layout, cp_rank's) receiving stream of streaming
        step `step_id`: iterate it for its micro-batches as waves commit (MicroBatch(rank,
        index, samples, result), result exactly pack() of the step's rows `samples`, read with
        the step's own layout, which packd sends), then its `global_loss_tokens`. single (one
        input: result.packed a tensor) and cu_seqlens_dtype say how to present the results.
        Every rank must receive: a rank's stream that ends early ends the step for all with
        UNAVAILABLE naming it."""
        unknown = sorted(set(ignored) - set(_RECEIVE_LAYOUT))
        if unknown:
            raise TypeError("receive_step() got an unexpected keyword argument %r" % unknown[0])
        if ignored:
            warnings.warn("receive_step(): %s are no longer needed and are ignored: each rank "
                          "reads its micro-batches with the step's own layout, which packd "
                          "sends" % ", ".join(sorted(ignored)), PackdDeprecationWarning,
                          stacklevel=2)
        call = self._connection.receive_step(
            pb.ReceiveStepRequest(step_id=step_id, rank=rank, cp_rank=cp_rank),
            timeout=self._step_timeout(), metadata=self._connection.metadata_for(None))
        return StepStream(call, single, cu_seqlens_dtype)

    def _step_timeout(self) -> float:
        """A streaming step's streams live as long as the step: their deadline is an hour, or
        the client's timeout when longer."""
        return max(self._connection.timeout, 3600.0)
