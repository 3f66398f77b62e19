"""docs/streaming.md's stream section, as written, against `splu up` on a fresh machine.

`splu up` runs in the foreground and prints two export lines (three with
`--redis-cluster 3`, which runs a Redis Cluster); the worker, the
consumer and the producer run as docs/streaming.md shows them, with those variables and the
example config; `/estimate` answers; `splu close` ends the survey and publishes what the
mixing floors held. Then Ctrl-C stops `splu up`, and nothing it
started is left running (this process is a subreaper, so an orphan would show up as
its child).
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from test_stream import PR_SET_CHILD_SUBREAPER, children

from deploy.embedded import free_port

pytestmark = pytest.mark.stream

SPLU = [sys.executable, "-m", "streams.cli"]
CONFIG = str(Path(__file__).parents[1] / "deploy" / "examples" / "adult-decoy.toml")
RECORDS = 5000  # the head of the bundled sample: enough for every partition's floor
TIMEOUT = 120.0


def exports(process: subprocess.Popen, count: int) -> dict[str, str]:
    """The `count` `export NAME=value` lines `splu up` prints, read with a timeout."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    found: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while len(found) < count and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").strip().partition("=")
            found[name] = value
    return found


@pytest.mark.parametrize("cluster", [False, True], ids=["redis", "redis-cluster"])
def test_up_then_the_documented_stream_section_then_ctrl_c_leaves_nothing(tmp_path, cluster):
    """Also with `splu up --redis-cluster 3`: a third line, REDIS_CLUSTER=1, and the same
    commands work on the cluster; the worker serves its health pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    before = children()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "REDIS_", "SPLU_"))}
    options = ["--redis-cluster", "3"] if cluster else []
    up = subprocess.Popen(
        [*SPLU, "up", "--data-dir", str(tmp_path / "data"), *options], env=base, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    started: list[subprocess.Popen] = []
    try:
        env = {
            **base,
            **exports(up, 3 if cluster else 2),
            "SPLU_SERVICE_KEY": secrets.token_hex(32),
        }
        assert {"KAFKA_BOOTSTRAP", "REDIS_URL"} <= set(env), env
        assert env.get("REDIS_CLUSTER") == ("1" if cluster else None), env
        port, worker_port = free_port(), free_port()
        for command in (["worker", "--config", CONFIG, "--port", str(worker_port)],
                        ["consumer", "--config", CONFIG, "--port", str(port)]):  # fmt: skip
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            started.append(subprocess.Popen([*SPLU, *command], env=env, cwd=tmp_path, **quiet))
        sample = tmp_path / "adult.csv"
        for command in (["sample", "--output", str(sample)],
                        ["produce", "--config", CONFIG, "--input", str(sample)]):  # fmt: skip
            done = subprocess.run([*SPLU, *command], env=env, cwd=tmp_path, capture_output=True,
                                  text=True, timeout=300, check=False)  # fmt: skip
            assert done.returncode == 0, done.stderr
            if command[0] == "sample":
                lines = sample.read_text().splitlines(keepends=True)
                sample.write_text("".join(lines[: RECORDS + 1]))
        url = (
            f"http://127.0.0.1:{port}/estimate?where=sex:Female,education:Bachelors"
            "&value=occupation:Sales"
        )
        deadline, status = time.monotonic() + TIMEOUT, None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/status") as response:
                    status = json.loads(response.read())
            except OSError:
                status = None
            worker = status["worker"] if status else {}
            if worker.get("settled") == RECORDS and (
                status["consumer"]["records"] == worker["published"]
            ):
                break
            time.sleep(1)
        assert status and status["worker"]["settled"] == RECORDS, status
        with urllib.request.urlopen(url, timeout=10) as response:
            answer = json.loads(response.read())
        assert answer["published"] > 0 and answer["low"] <= answer["estimate"] <= answer["high"]
        for page in (f"{worker_port}/healthz", f"{worker_port}/readyz", f"{port}/readyz"):
            with urllib.request.urlopen(f"http://127.0.0.1:{page}", timeout=10) as response:
                assert response.status == 200, page
        # The survey ends: what the floors held is published, and the close says so.
        closed = subprocess.run(
            [*SPLU, "close", "--config", CONFIG], env=env, cwd=tmp_path, capture_output=True,
            text=True, timeout=300, check=False,
        )  # fmt: skip
        assert closed.returncode == 0, closed.stderr
        assert f"closed: {RECORDS:,} records accepted" in closed.stderr, closed.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status") as response:
            status = json.loads(response.read())
        worker = status["worker"]
        assert worker["published"] + worker["suppressed"] == RECORDS and worker["pool"] == 0
        assert status["close"]["state"] == "closed", status["close"]
    finally:
        for process in started:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=60)
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0
    deadline = time.monotonic() + 5
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children() - before == set()
