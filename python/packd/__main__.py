"""`python -m packd`: a small command line for machines without packctl.

    python -m packd --address=unix:/run/packd/packd.sock info
    python -m packd health                      # exit 0 when SERVING, 1 otherwise
    python -m packd plan --lengths=900,300,2048,50 --max-tokens=4096 --ranks=2

Errors print the server's message and exit 2."""
import argparse
import json
import sys
from typing import List, Optional, Sequence

import grpc

from packd import _wire
from packd.client import Client, PackdError, Plan
from packd.options import ConnectionOptions, PlanOptions, TlsOptions, TokenOptions

# grpc.health.v1.Health/Check, encoded by hand (no grpcio-health-checking needed):
# HealthCheckRequest {string service = 1}, HealthCheckResponse {ServingStatus status = 1}.
_HEALTH = "/grpc.health.v1.Health/Check"
_STATUSES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _health_request(service: str) -> bytes:
    data = service.encode()
    return _wire.length_delimited(1, data) if data else b""


def _health_status(response: bytes) -> int:
    """The status field of a HealthCheckResponse (0 when absent), read by the package's one
    reader (packd/_wire.py), which refuses a field cut off or running past the end."""
    reader = _wire.Reader(response, len(response))
    while reader.at < reader.end:
        key = reader.varint()
        if key == 0x08:
            return reader.varint()
        reader.skip(key & 7)
    return 0


def _ints(text: str) -> List[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}")


def _floats(text: str) -> List[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m packd", description=__doc__.split("\n")[0])
    parser.add_argument("--address", default="127.0.0.1:50051",
                        help="packd's address: host:port or unix:/path (default %(default)s)")
    parser.add_argument("--token-file", help="a file whose first line is the bearer token "
                        "(else $PACKD_TOKEN)")
    parser.add_argument("--tls-ca-file", help="CA bundle: connect over TLS")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="the server's version, devices and limits, as JSON")
    health = commands.add_parser("health", help="the gRPC health status; exit 0 when SERVING")
    health.add_argument("--service", default="", help="a service name (default: the server)")
    plan = commands.add_parser("plan", help="plan micro-batches over data-parallel ranks")
    plan.add_argument("--lengths", type=_ints, required=True, help="sample lengths: 900,300,...")
    plan.add_argument("--max-tokens", type=int, required=True,
                      help="token budget of a micro-batch")
    plan.add_argument("--ranks", type=int, default=1, help="data-parallel ranks (default 1)")
    plan.add_argument("--loss-tokens", type=_ints, help="loss tokens per sample")
    plan.add_argument("--cost", type=_floats, help="a,b: balance ranks by a*P + b*P^2")
    plan.add_argument("--pad-multiple", type=int, default=0,
                      help="each sample padded to a multiple of it")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with Client(args.address, timeout=args.timeout, retries=1,
                    token=TokenOptions(file=args.token_file),
                    tls=TlsOptions(ca_file=args.tls_ca_file),
                    connection=ConnectionOptions(connections=1)) as client:
            if args.command == "info":
                from google.protobuf import json_format
                print(json_format.MessageToJson(client.info(), indent=2))
                return 0
            if args.command == "health":
                connection = client._connection
                check = connection.channels[0].unary_unary(_HEALTH)
                status = _health_status(check(_health_request(args.service),
                                              timeout=args.timeout,
                                              metadata=connection.metadata_for(None) or None))
                print(_STATUSES.get(status, str(status)))
                return 0 if status == 1 else 1
            if args.cost is not None and len(args.cost) != 2:
                print("python -m packd: --cost takes two numbers, a,b", file=sys.stderr)
                return 2
            plan = Plan.of(client.plan_micro_batches(
                args.lengths, args.max_tokens,
                plan=PlanOptions(num_ranks=args.ranks, cost=args.cost),
                loss_tokens=args.loss_tokens, pad_multiple=args.pad_multiple))
            print(json.dumps({
                "micro_batches_per_rank": plan.micro_batches_per_rank,
                "global_loss_tokens": plan.global_loss_tokens,
                "global_sequences": plan.global_sequences,
                "imbalance": plan.imbalance, "cost_imbalance": plan.cost_imbalance,
                "micro_batches": [{"rank": m.rank, "samples": m.samples, "tokens": m.tokens}
                                  for m in plan.micro_batches]}, indent=2))
            return 0
    except (PackdError, grpc.RpcError, ValueError, OSError) as e:
        details = e.details() if isinstance(e, grpc.RpcError) else str(e)
        print(f"python -m packd: {details}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
