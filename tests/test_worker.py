"""The worker and consumer processes (`streams.runtime.process`)."""

from __future__ import annotations

import asyncio
import gc

import faust

from streams.runtime.process import StreamWorker


def test_a_started_worker_spares_the_collector_what_its_start_up_made(tmp_path):
    app = faust.App("splu-test-freeze", broker="kafka://127.0.0.1:1", datadir=str(tmp_path))
    worker = StreamWorker(app, loglevel="warning", quiet=True)
    made_at_start_up = [app]
    try:
        assert gc.get_freeze_count() == 0
        asyncio.run(worker.on_startup_finished())
        assert gc.get_freeze_count() > 0
        assert not any(tracked is made_at_start_up for tracked in gc.get_objects())
        made_later = [app]
        assert any(tracked is made_later for tracked in gc.get_objects())
    finally:
        gc.unfreeze()
