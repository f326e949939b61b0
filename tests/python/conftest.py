"""A real packd server for the Python client tests (PACKD_BINARY), on a free loopback port."""
import os
import re
import subprocess
import threading
import time

import pytest


@pytest.fixture(scope="session")
def address():
    proc = subprocess.Popen([os.environ["PACKD_BINARY"], "--listen=127.0.0.1:0"],
                            stderr=subprocess.PIPE, text=True)
    lines, found = [], None
    deadline = time.time() + 60
    while time.time() < deadline and found is None:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on ([^,]+),", line)
        found = m and m.group(1)
    assert found, "packd did not start:\n" + "".join(lines)
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    yield found
    proc.terminate()
    assert proc.wait(timeout=60) == 0
