"""The live page in a real browser (Debian's Chromium driven by Playwright) against
`splu demo --serve`: every plot must render with data, or the test fails."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

from deploy.embedded import free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As the machine's notes advise: no background connections a closed network would refuse.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
PLOTS = ("plot-standing", "plot-guarantee", "plot-buffer", "plot-delay")
DEMO_TIMEOUT = 240.0


def _lines(process: subprocess.Popen) -> queue.Queue:
    """The demo's output lines, read on a thread so waiting can time out."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for_line(lines: queue.Queue, text: str, seen: list[str]) -> None:
    deadline = time.monotonic() + DEMO_TIMEOUT
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError("the demo ended early:\n" + "".join(seen))
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"no {text!r} from the demo:\n" + "".join(seen))


def test_live_page_renders_every_plot_with_data(tmp_path):
    from playwright.sync_api import sync_playwright

    port = free_port()
    demo = subprocess.Popen(
        [sys.executable, "-m", "streams.cli", "demo", "--records", "8000", "--serve",
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    seen: list[str] = []
    lines = _lines(demo)
    try:
        _wait_for_line(lines, "serving the live page", seen)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector('body[data-ready="1"]', timeout=30_000)
            for plot in PLOTS:
                page.wait_for_function(
                    f"Number(document.getElementById('{plot}').dataset.points || 0) > 0",
                    timeout=30_000,
                )
            points = {p: int(page.get_attribute(f"#{p}", "data-points")) for p in PLOTS}
            page.screenshot(path=str(tmp_path / "live-page.png"), full_page=True)
            shown = page.inner_text("body")
            browser.close()
        assert (tmp_path / "live-page.png").stat().st_size > 10_000
        assert not errors, errors
        # Four standing queries, the deviation curve over 200 counts, history samples.
        assert points["plot-standing"] >= 4 and points["plot-guarantee"] >= 100, points
        assert "adversary" in shown
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            demo.wait(timeout=60)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.wait()
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    output = "".join(seen)
    assert demo.returncode == 0, output
    assert "every process it started has stopped" in output
