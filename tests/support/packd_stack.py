"""A pytest plugin (-p packd_stack) that names the stack a Python test runs on in its header:
the interpreter and the versions of packd's dependencies and peers, so that a failure's log says
whether it was Debian's torch 1.13 or PyPI's torch 2 (tests/python/python_tests.cmake)."""
import importlib.metadata as metadata
import os
import sys

# The tests fork only to exec (subprocess: packd, clients run as other users), never to use gRPC
# in a child. gRPC's fork support would make each such fork wait for gRPC's thread pool to go
# idle, which never happens when a pool thread waits for the GIL the forking thread holds (seen
# as "Waiting for thread pool to idle before forking" forever). Off before any test imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

PACKAGES = ("torch", "grpcio", "protobuf", "numpy", "transformers", "verl", "trl")


def versions():
    """'torch 2.15.0, grpcio 1.85.3, ...' for the packages installed."""
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def pytest_report_header(config):
    return f"packd stack: Python {sys.version.split()[0]}, {versions()}"


def pytest_configure(config):
    # The tests use the option objects (packd.Layout, packd.PlanOptions, ...): a call that still
    # passes a deprecated keyword fails, except inside pytest.warns, which the tests of the old
    # keywords use.
    config.addinivalue_line("filterwarnings", "error::packd.options.PackdDeprecationWarning")
