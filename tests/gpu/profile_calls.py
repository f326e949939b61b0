"""Where a Pack or Scatter call's time goes, for a GPU machine (or the host with --device cpu):
the client's wall time per call against the server's own (packd_request_duration_seconds from
its metrics) and a bare round trip (Info), over a small and a large batch, then the client's
Python profile of the small pack. Not a test: a measurement printed as a table.

    PACKD_BINARY=.gpu/bin/packd PYTHONPATH=.gpu/python python3 tests/gpu/profile_calls.py
    ... profile_calls.py --device cpu      # the same calls on the host (any machine)
"""
import argparse
import cProfile
import os
import pstats
import re
import socket
import sys
import time
import urllib.request

import torch

import packd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from packd_server import PackdServer  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_seconds(metrics, method):
    """packd's total seconds and count of `method` calls so far."""
    text = urllib.request.urlopen("http://%s/metrics" % metrics, timeout=5).read().decode()
    total = count = 0.0
    for line in text.splitlines():
        m = re.match(r'packd_request_duration_seconds_(sum|count)\{(.*)\} (\S+)', line)
        if m and 'method="%s"' % method in m.group(2):
            if m.group(1) == "sum":
                total += float(m.group(3))
            else:
                count += float(m.group(3))
    return total, count


def measure(name, method, fn, sync, metrics, reps):
    fn()
    times = []
    before = server_seconds(metrics, method)
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    after = server_seconds(metrics, method)
    calls = after[1] - before[1]
    server_ms = (after[0] - before[0]) / calls * 1e3 if calls else float("nan")
    times.sort()
    print("%-34s %9.3f %9.3f %9.3f %9.3f" % (name, times[len(times) // 2], times[0],
                                              server_ms, times[len(times) // 2] - server_ms),
          flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    metrics = "127.0.0.1:%d" % free_port()
    with PackdServer("--device=cpu",
                     "--metrics_listen=" + metrics) as address:
        client = packd.Client(address)
        gen = torch.Generator().manual_seed(7)
        print("%-34s %9s %9s %9s %9s" % ("call", "median ms", "best ms", "server ms",
                                          "rest ms"))
        measure("Info (a round trip)", "Info", client.info, sync, metrics, args.reps)
        for B, S, H in [(8, 2048, 64), (16, 4096, 1024)]:
            mask = (torch.rand(B, S, generator=gen) < 0.3).to(device)
            x = torch.randn(B, S, H, generator=gen).to(device)
            tag = "%dx%dx%d f32" % (B, S, H)
            measure("pack %s" % tag, "Pack", lambda: client.pack(x, mask), sync, metrics,
                    args.reps)
            measure("pack %s + positions" % tag, "Pack",
                    lambda: client.pack(x, mask, with_position_ids=True), sync, metrics,
                    args.reps)
            packed = x[mask]
            measure("scatter %s" % tag, "Scatter", lambda: client.scatter(packed, mask), sync,
                    metrics, args.reps)
            measure("torch x[mask] %s" % tag, "-", lambda: x[mask], sync, metrics, args.reps)
        B, S, H = 8, 2048, 64
        mask = (torch.rand(B, S, generator=gen) < 0.3).to(device)
        x = torch.randn(B, S, H, generator=gen).to(device)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.reps):
            client.pack(x, mask, with_position_ids=True)
        sync()
        profile.disable()
        print("\n%d packs of %dx%dx%d with positions, the client's Python by own time:"
              % (args.reps, B, S, H))
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)
        print("by cumulative time:")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
        client.close()


if __name__ == "__main__":
    main()
