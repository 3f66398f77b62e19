"""What a worker and a consumer write to a log file is text: Faust's start-up spinner,
which draws on a terminal, writes nothing there (no terminal codes such as the cursor's
``\\x1b[?25l``, which would garble a log file whatever the spinner's output)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from harness import Harness

from deploy.embedded import free_port

pytestmark = pytest.mark.stream

TIMEOUT = 60.0


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_logs_written_to_a_file_carry_no_terminal_codes(servers, tmp_path):
    harness = Harness(servers, tmp_path, "adult-decoy.toml", row_column=False)
    port = free_port()
    harness.start_worker(port=port)
    harness.start_consumer()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (ready(f"http://127.0.0.1:{port}") and ready(harness.url)):
            assert time.monotonic() < deadline, "the worker and consumer never became ready"
            time.sleep(0.5)
    finally:
        harness.stop()  # the spinner wrote its last codes when the process stopped
    for log in (harness.log, harness.log.with_suffix(".consumer.log")):
        text = log.read_bytes()
        assert b"\x1b" not in text and b"\x08" not in text, (log.name, text[:200])
