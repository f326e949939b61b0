"""A real packd server for the Python test suites: started on a unix socket in a fresh
directory, ready once grpc.health.v1 answers SERVING for packd.v1.PackService (the server's log
is for people, not parsed), stopped with SIGTERM and required to exit 0.

    with PackdServer() as address:              # the server under test: $PACKD_BINARY
        channel = grpc.insecure_channel(address)
    with PackdServer("--shm_key_prefix=/t", binary=other) as address:  # flags, another binary
        ...
"""
import os
import random
import socket
import subprocess
import tempfile
import time

import grpc

_READINESS = b"packd.v1.PackService"
# grpc.health.v1.HealthCheckRequest{service} and HealthCheckResponse{status: SERVING}, encoded
# by hand so that no health stubs are needed.
_CHECK_REQUEST = b"\x0a" + bytes([len(_READINESS)]) + _READINESS
_SERVING = b"\x08\x01"


def unused_port():
    """A loopback port nothing listens on (now), below the kernel's ephemeral range: no other
    process is given it while a test's server restarts on it (binding port 0 and connecting
    take ports from that range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first, end = (10000, min(low, 32768)) if low > 11000 else (1024, 65536)
    start = random.randrange(first, end)
    for i in range(end - first):
        port = first + (start - first + i) % (end - first)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port")


def binary_under_test():
    """The packd the tests run: $PACKD_BINARY (ctest sets it)."""
    binary = os.environ.get("PACKD_BINARY")
    if not binary:
        raise RuntimeError("PACKD_BINARY is not set: run the tests through ctest, or set it to "
                           "the packd to test (e.g. PACKD_BINARY=build/bin/packd)")
    return binary


class PackdServer:
    def __init__(self, *flags, binary=None, timeout=60.0):
        binary = binary or binary_under_test()
        self._dir = tempfile.TemporaryDirectory(prefix="packd-test-")
        self.address = "unix:" + os.path.join(self._dir.name, "packd.sock")
        # "{dir}" in a flag is the server's own directory; a --listen flag replaces the unix
        # socket; readiness is asked on --health_listen when a flag sets it (the main port may
        # speak TLS).
        flags = [f.replace("{dir}", self._dir.name) for f in flags]
        self.address = next((f.split("=", 1)[1] for f in flags if f.startswith("--listen=")),
                            self.address)
        flags = [f for f in flags if not f.startswith("--listen=")]
        self._health = next((f.split("=", 1)[1] for f in flags
                             if f.startswith("--health_listen=")), self.address)
        self._args = [binary, "--listen=" + self.address, *flags]
        self._timeout = timeout
        self._launch()

    def _launch(self):
        self._proc = subprocess.Popen(self._args, stderr=subprocess.PIPE, text=True)
        try:
            self._wait_ready(self._timeout)
        except Exception:
            self._proc.kill()
            log = self._proc.communicate()[1]
            self._dir.cleanup()
            raise RuntimeError("packd did not become ready; its log:\n" + log)

    def restart(self, graceful=False):
        """The same server again on the same address, ready: after SIGKILL, or with graceful
        after SIGTERM and a clean drain (exit code 0)."""
        if graceful:
            self._proc.terminate()
        else:
            self._proc.kill()
        log = self._proc.communicate()[1]
        if graceful and self._proc.returncode != 0:
            raise RuntimeError("packd exited with code %d after SIGTERM; its log:\n%s"
                               % (self._proc.returncode, log))
        self._launch()

    def _wait_ready(self, timeout):
        deadline = time.time() + timeout
        attempt = 0
        while time.time() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError("packd exited with code %d" % self._proc.returncode)
            # A channel dialled before the server listens backs off for seconds between
            # attempts: each attempt dials afresh.
            attempt += 1
            with grpc.insecure_channel(self._health,
                                       options=[("packd.attempt", attempt)]) as channel:
                try:
                    check = channel.unary_unary("/grpc.health.v1.Health/Check")
                    if check(_CHECK_REQUEST, timeout=1.0) == _SERVING:
                        return
                except grpc.RpcError:
                    pass
            time.sleep(0.02)
        raise TimeoutError("packd was not SERVING within %.0f s" % timeout)

    @property
    def pid(self):
        return self._proc.pid

    def stop(self):
        """SIGTERM, then the exit code (0 after a clean drain); its log is kept in `log`."""
        self._proc.terminate()
        self.log = self._proc.communicate(timeout=60)[1]
        code = self._proc.returncode
        self._dir.cleanup()
        return code

    def __enter__(self):
        return self.address

    def __exit__(self, *exc):
        assert self.stop() == 0
