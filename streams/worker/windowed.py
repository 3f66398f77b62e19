"""The worker of a windowed stream: a batch mechanism per window (`service/store/windowed.py`).

One Faust app per stream, like `streams/runtime/app.py`, whose pieces it reuses
(`faust_app`, `add_ingest` on `streams/runtime/bulk.py`, `Publisher`, `retrying`):

- ``ingest`` (whole fetches of ``<stream>.raw``, `streams.runtime.bulk`) validates each batch
  (`WindowPreparer`: rejections go to ``<stream>.rejected``) and stores it in its
  partition's open window with one Lua call, which also closes the windows now full. Offsets are
  committed only after that call returned; while a partition buffers
  ``buffer_cap`` records or more (open and closed windows), the handler waits.
- ``tick`` (timer, 1 s) makes the same call without records, so a window whose
  first record waited ``max_window_wait`` closes.
- ``emit`` (a task) takes each owned partition's oldest closed window, runs the
  mechanism on it off the event loop, stages its messages under fresh tokens,
  sends them to ``<stream>.published``, and after the broker's acknowledgement
  drops the window. A staged window is re-sent as staged, with its tokens, also
  by whichever worker owns the partition after a crash or a rebalance.

While the stream's pause flag is set (``splu:{<stream>}:paused``) nothing is
published; records keep arriving and windows keep closing in Redis.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import faust

from service.core.config import StreamConfig
from service.core.prf import ServiceKey
from service.core.windows import WindowPreparer, render_window
from service.store.lifecycle import Lifecycle
from service.store.windowed import WindowBuffer, encode_staged
from streams.runtime.app import (
    TRANSIENT,
    add_health_pages,
    app_publisher,
    assigned_partitions,
    describe,
    faust_app,
    now_ms,
    redis_client,
    stream_topic,
)
from streams.worker.app import (
    TICK_INTERVAL,
    Intake,
    PauseWatch,
    add_ingest,
    add_metrics_page,
    close_step,
    held_step,
)
from streams.worker.closing import Closer
from streams.worker.undecodable import HeldBatches

log = logging.getLogger("splu.windowed")

EMIT_INTERVAL = 0.2  # seconds between looks for closed windows while none is waiting


def create_windowed_app(
    config: StreamConfig, key: ServiceKey, datadir: Path, web: tuple[str, int] | None = None
) -> faust.App:
    """The worker app for one windowed stream; `web` as for `streams.runtime.app.create_app`."""
    assert config.windowed is not None, "a windowed stream has a [windowed] table"
    settings = config.windowed
    app = faust_app(config, f"splu-{config.name}", datadir, web=web)
    raw = stream_topic(app, config, "raw")
    publisher = app_publisher(app, config)
    preparer = WindowPreparer(config, key)
    client = redis_client(app, config)
    buffer = WindowBuffer(client, config)
    lifecycle = Lifecycle(client, config)
    closer = Closer(config, lifecycle)
    pause = PauseWatch(buffer)

    def assigned() -> set[int]:
        return assigned_partitions(app, raw)

    held = HeldBatches(buffer, publisher.send_all)
    add_ingest(app, raw, config, Intake(config, preparer, buffer, lifecycle, publisher), held)
    add_health_pages(app, raw, client, publisher)
    add_metrics_page(app, raw, buffer)

    async def publish_window(partition: int, number: int) -> None:
        """Publish (or suppress) closed window `number`: stage, send, finish."""
        staged = await buffer.staged(partition, number)
        if staged is None:
            records = await buffer.records(partition, number)
            output = await asyncio.to_thread(
                render_window, config.schema, settings, key, partition, number, records
            )
            if output.summary:
                log.info("partition %d window %d:\n%s", partition, number, output.summary)
            if output.reason is not None:
                log.warning(
                    "partition %d: window %d of %d records suppressed: %s",
                    partition, number, output.records, output.reason,
                )  # fmt: skip
                await buffer.finish(partition, number, 0, 0, output.records, whole=True)
                return
            staged = await buffer.stage(partition, number, encode_staged(output))
            if staged is None:
                return  # another owner finished it meanwhile
        else:
            log.warning(
                "partition %d: re-sending window %d (%d messages) with its tokens",
                partition, number, len(staged.messages),
            )  # fmt: skip
        await publisher.send_all(config.topics["published"], staged.messages)
        await buffer.finish(
            partition, number, staged.rows, staged.side, staged.suppressed, whole=False
        )

    async def publish_round() -> bool:
        """Publish the oldest closed window of every owned partition; False if none was
        waiting (or publishing is paused), so the caller may sleep."""
        if await pause.holding():
            return False
        published = False
        for partition in sorted(assigned()):
            try:
                number = await buffer.oldest(partition)
                if number is not None:
                    await publish_window(partition, number)
                    published = True
            except TRANSIENT as err:
                # The window stays queued (and staged, if it got that far): the next round
                # sends it again with the same tokens.
                log.warning("partition %d: publication failed (%s)", partition, describe(err))
        return published

    @app.task
    async def emit() -> None:
        """Publish windows as long as some are waiting, then look again every EMIT_INTERVAL."""
        while True:
            if not await publish_round():
                await asyncio.sleep(EMIT_INTERVAL)

    @app.timer(interval=TICK_INTERVAL)
    async def tick() -> None:
        for partition in sorted(assigned()):
            try:
                await buffer.ingest(partition, None, now_ms())
            except TRANSIENT as err:
                log.warning("partition %d: tick failed (%s)", partition, describe(err))
        await close_step(closer, assigned(), assigned())
        await held_step(app, held, raw)

    app.splu_buffer = buffer  # type: ignore[attr-defined]
    return app
