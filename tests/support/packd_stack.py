"""A pytest plugin (-p packd_stack) that names the stack a Python test runs on in its header:
the interpreter and the versions of packd's dependencies and peers, so that a failure's log says
whether it was Debian's torch 1.13 or PyPI's torch 2 (tests/python/python_tests.cmake)."""
import importlib.metadata as metadata
import sys

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
