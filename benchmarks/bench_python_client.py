"""The Python client's inline Pack, for bench_service: prints the median ms of --repeats calls.

    bench_python_client.py --address=unix:/tmp/packd.sock --shape=16,1024,4096 \
        --lengths=307,300,... --repeats=10
"""
import argparse
import statistics
import time

import torch

import packd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--shape", required=True, help="B,S,H of a bf16 x")
    parser.add_argument("--lengths", required=True, help="active prefix length of each row")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    B, S, H = (int(v) for v in args.shape.split(","))
    lengths = torch.tensor([int(v) for v in args.lengths.split(",")])
    mask = torch.arange(S)[None, :] < lengths[:, None]
    x = torch.randint(-1000, 1000, (B, S, H), dtype=torch.float32).to(torch.bfloat16)
    client = packd.Client(args.address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0))
    result = client.pack(x, mask)
    if not torch.equal(result.packed.view(torch.int16), x[mask].view(torch.int16)):
        raise SystemExit("bench_python_client: the packed result differs from x[mask]")
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        client.pack(x, mask)
        times.append((time.perf_counter() - t0) * 1e3)
    print("%.4f" % statistics.median(times))


if __name__ == "__main__":
    main()
