"""StepPlan: a PackMicroBatches call in progress, its plan at once and its micro-batches as
they arrive. The results it yields are packd/results.py's."""
from typing import Any, Callable, Iterator, Tuple

import grpc
import torch

from packd._connection import error
from packd.results import MicroBatch, Plan, pack_result
from packd.v1 import pack_service_pb2 as pb


def micro_batch(reply: pb.PackMicroBatchesResponse, tensors: dict, options: Tuple[Any, ...],
                decode: Callable[[Any, Any], torch.Tensor] = lambda msg, t: t,
                place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> MicroBatch:
    """A micro-batch's message (packd/_wire.py's parser: the message, and its tensors by field)
    as a MicroBatch. options: (single, cu_seqlens_dtype, docs, with_position_ids, layout);
    decode: a result tensor from its header and inline tensor (or its arena); place: where the
    metadata goes. What PackMicroBatches and a streaming step's ranks both receive."""
    packed_reply, inner = tensors.get(
        pb.PackMicroBatchesResponse.PACKED_FIELD_NUMBER, [(pb.PackResponse(), {})])[0]
    single, cu_dtype, docs, with_position_ids, layout = options
    packed = [decode(m, t) for m, t in zip(packed_reply.packed,
                                           inner.get(pb.PackResponse.PACKED_FIELD_NUMBER, []))]
    shifted = [decode(m, t) for m, t in zip(packed_reply.shifted,
                                            inner.get(pb.PackResponse.SHIFTED_FIELD_NUMBER, []))]
    return MicroBatch(reply.rank, reply.index, list(reply.samples), pack_result(
        packed_reply, packed, shifted, single, cu_dtype, docs, with_position_ids, layout,
        place))


class StepPlan:
    """A PackMicroBatches call in progress: `plan` (a Plan) at once, then the micro-batches
    (MicroBatch) as they arrive, by iterating it. The server packs the next micro-batch while
    this one is read, and no further. close() (or leaving a `with` block) cancels what is left;
    iterating to the end releases the call's shared memory (`release`, called once)."""

    def __init__(self, call: Any, first: Any, release: Callable[[], None],
                 options: Tuple[Any, ...],
                 decode: Callable[[Any, Any], torch.Tensor] = lambda msg, t: t,
                 place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        self._call, self._release = call, release
        self._options = options  # (single, cu_seqlens_dtype, docs, with_position_ids, layout)
        self._decode = decode    # a result tensor: inline, or copied out of the call's arena
        self._place = place      # the metadata where the results are (a GPU step's: there)
        self.plan = Plan.of(first.plan)
        # What the results of every micro-batch take in an arena (docs/design.md §12), and
        # how many micro-batches came through it (from a step's second call of a shape on).
        self.output_bytes = first.output_bytes
        self.through_shared_memory = 0

    def __iter__(self) -> Iterator[MicroBatch]:
        try:
            for reply, tensors in self._call:
                if any(m.HasField("region") for m in reply.packed.packed):
                    self.through_shared_memory += 1
                yield micro_batch(reply, tensors, self._options, self._decode, self._place)
        except grpc.RpcError as e:
            raise error(e) from None
        finally:
            self.close()

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> "StepPlan":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

