"""The worker and consumer processes (`streams.runtime.process`)."""

from __future__ import annotations

import asyncio
import gc

import faust

from streams.runtime.process import GC_THRESHOLDS, StreamWorker


def test_a_started_worker_keeps_the_collector_out_of_the_streams_way(tmp_path):
    app = faust.App("splu-test-freeze", broker="kafka://127.0.0.1:1", datadir=str(tmp_path))
    worker = StreamWorker(app, loglevel="warning", quiet=True)
    made_at_start_up = [app]
    thresholds = gc.get_threshold()
    try:
        assert gc.get_freeze_count() == 0
        asyncio.run(worker.on_startup_finished())
        assert gc.get_freeze_count() > 0
        assert not any(tracked is made_at_start_up for tracked in gc.get_objects())
        made_later = [app]
        assert any(tracked is made_later for tracked in gc.get_objects())
        # Young collections rarely, once started: a fetch's records are not walked over
        # and over while they are in hand.
        assert gc.get_threshold() == GC_THRESHOLDS != thresholds
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
