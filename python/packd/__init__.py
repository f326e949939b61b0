"""packd for PyTorch users: pack padded [B, S, *tail] batches into [total_active, *tail] and back,
through a packd server.

    import packd
    op = packd.RemotePackOp("127.0.0.1:50051")
    packed, cu_seqlens = op(hidden_states, completion_mask)   # differentiable
    dense = op.unpack(packed, completion_mask)

    with packd.Client("unix:/run/packd/packd.sock") as client:
        r = client.pack([hidden, token_ids], mask, with_position_ids=True,
                        cu_seqlens_dtype=torch.int32, layout=packd.Layout(pad_multiple=8))
"""
# The server's version too (CMake's project version): tests/python/test_cli.py checks both.
__version__ = "0.1.0"

from packd.client import Client, PackdError, PackdValueError, device_slice
from packd.results import (MicroBatch, PackResult, Plan, PlannedMicroBatch, SharedResult,
                           varlen_kwargs)
from packd.layout import Layout, MRope, SharedPrefix
from packd.options import (ConnectionOptions, GpuOptions, PackdDeprecationWarning, PlanOptions,
                           SharedMemoryOptions, TlsOptions, TokenOptions)
from packd.step_plan import StepPlan
from packd.ops import RemotePackOp
from packd.streaming import (StepController, StepStream, StepSummary, SubmittedGroup,
                             scale_gradients)

__all__ = ["__version__", "Client", "ConnectionOptions", "GpuOptions", "Layout", "MRope",
           "MicroBatch", "PackdDeprecationWarning", "PackdError", "PackdValueError",
           "PackResult", "Plan", "PlanOptions", "PlannedMicroBatch", "RemotePackOp",
           "SharedMemoryOptions", "SharedPrefix", "SharedResult", "StepController", "StepPlan",
           "StepStream", "StepSummary", "SubmittedGroup", "TlsOptions", "TokenOptions",
           "device_slice", "scale_gradients", "varlen_kwargs"]
