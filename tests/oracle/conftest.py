"""The servers the oracle drives, one per backend, and the table of combinations that ran.

span:     packd_testing, cpu calls on the span backend (the default)
torch:    packd_testing --cpu_impl=torch, cpu calls on libtorch
fake_gpu: the first server's cuda:0, the fake GPU of tests/fake_gpu (host tensors staged to it)
gpu_memory: the same server, every tensor of the call in fake GPU memory of this process
          (tests/support/fake_gpu_memory.py): the clients' GPU path, device regions, results
          (a step's: its arena) on the device
"""
import collections
import os

import pytest

from packd_server import PackdServer

# (op, backend) -> {combination: cases run}, filled by the tests, printed at the end.
COVERAGE = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="session")
def servers():
    binary = os.environ["PACKD_TESTING_BINARY"]
    with PackdServer("--fake_gpu_devices=1", binary=binary) as span, \
            PackdServer("--cpu_impl=torch", binary=binary) as torch_address:
        yield {"span": (span, "cpu"), "torch": (torch_address, "cpu"),
               "fake_gpu": (span, "cuda:0"), "gpu_memory": (span, "gpu_memory")}


def pytest_terminal_summary(terminalreporter):
    if not COVERAGE:
        return
    write = terminalreporter.write_line
    write("layout oracle: combinations run (served / refused with their named error), cases")
    total_cells = total_cases = 0
    for (op, backend), cells in sorted(COVERAGE.items()):
        refused = sum(1 for key in cells if key.startswith("refused"))
        cases = sum(cells.values())
        total_cells += len(cells)
        total_cases += cases
        write("  %-8s %-9s %3d combinations (%3d served, %2d refused), %4d cases"
              % (op, backend, len(cells), len(cells) - refused, refused, cases))
    write("  all: %d combinations, %d cases" % (total_cells, total_cases))
