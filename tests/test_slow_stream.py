"""A survey stream as it lives: a slow trickle, then a burst, then quiet, in real time.

One decoy partition with a mixing-pool floor of 50 records (10 groups of γ = 5), a
worker and a consumer on the embedded servers:

- **slow**: SLOW records at SLOW_RATE records/s. The pool never reaches its floor, so
  nothing is published: that wait is the price of the floor, and `/status` shows it
  (the mixing section, the records held in the pool, nothing published);
- **burst**: BURST records at once. The pool's excess over the floor leaves at once;
- **quiet**: no more records. The pool, at its floor and quiet for flush_interval,
  leaves whole.

Every slow record that arrived more than LONG seconds before the burst waited at least
that long: the delay histogram in `/status` must count them above LONG, and the live
page must show the floor and the delay quantiles.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import shutil
import time
import tomllib

import pytest
import redis.asyncio as aioredis
import tomli_w
from harness import Harness
from test_consumer import wait_for
from test_live_page import CHROMIUM, CHROMIUM_ARGS

from service.cli import client
from service.core.config import load_config
from service.core.table import open_sample
from streams.runtime.topics import create_topics
from streams.tools.produce import produce

pytestmark = pytest.mark.stream

FLOOR = 50  # mixing_pool: 10 groups of γ = 5
FLUSH = 2.0  # flush_interval, seconds
SLOW, SLOW_RATE = 20, 2.0  # records and the most records/s of the slow phase
BURST = 1000
LONG = 5.0  # seconds: a bound of the delay histogram (service.store.buffer.DELAY_BOUNDS_MS)


def adult_messages(names: list[str], count: int) -> list[tuple[bytes, bytes]]:
    with open_sample() as stream:
        rows = itertools.islice(csv.DictReader(stream), count)
        return [
            (f"s{i}".encode(), json.dumps({n: row[n] for n in names}).encode())
            for i, row in enumerate(rows)
        ]


def test_slow_then_burst_then_quiet_shows_what_the_floor_costs(servers, tmp_path):
    harness = Harness(servers, tmp_path, "adult-decoy.toml", row_column=False)
    document = tomllib.loads(harness.path.read_text())
    document["stream"].update(
        partitions=1, mixing_pool=FLOOR, flush_interval=FLUSH, max_wait=120.0, batch_wait=0.05
    )
    harness.path.write_text(tomli_w.dumps(document))
    config = harness.config = load_config(harness.path)
    messages = adult_messages(config.schema.names, 1 + SLOW + BURST)

    async def totals() -> dict[str, int]:
        redis = aioredis.from_url(config.redis_url)
        out = await harness.totals(redis)
        await redis.aclose()
        return out

    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    harness.start_worker()
    harness.start_consumer()
    try:
        # One record first: once it is in Redis, the worker consumes as records arrive.
        asyncio.run(produce(config, iter(messages[:1]), progress=False))
        wait_for(lambda: asyncio.run(totals()).get("ingested") == 1, "the worker to join")
        wait_for(lambda: client.status(harness.url), "the consumer to answer")

        # When each slow record was seen in Redis: its arrival was no later.
        arrived = []
        for i, message in enumerate(messages[1 : 1 + SLOW], start=2):
            started = time.monotonic()
            asyncio.run(produce(config, iter([message]), progress=False))
            wait_for(lambda i=i: asyncio.run(totals()).get("ingested") == i, "a slow record")
            arrived.append(time.monotonic())
            time.sleep(max(0.0, 1 / SLOW_RATE - (arrived[-1] - started)))
        slow = client.status(harness.url)

        burst_at = time.monotonic()
        asyncio.run(produce(config, iter(messages[1 + SLOW :]), progress=False))
        final = wait_for(
            lambda: (
                (s := client.status(harness.url))["worker"].get("ingested") == len(messages)
                and s["worker"]["pool"] + s["worker"]["in_flight"] == 0
                and s["consumer"]["records"] == s["worker"]["published"]
                and s
            ),
            "the burst to be published and counted",
            timeout=60.0,
        )
        page = live_page(harness.url)
    finally:
        harness.stop()

    # Slow: below the floor nothing leaves; the status says why.
    assert slow["worker"]["published"] == 0, slow["worker"]
    pool, held = slow["worker"]["pool"], slow["worker"]["held"]
    mixing = {"floor": FLOOR, "flush_interval": FLUSH, "partitions": 1, "pool": pool, "held": held}
    assert slow["mixing"] == mixing
    assert 0 < slow["worker"]["pool"] < FLOOR
    assert slow["delay"]["count"] == 0 and slow["delay"]["p99"] is None

    # Burst, then quiet: the pool emptied whole, each record published once and counted.
    worker = final["worker"]
    assert worker["published"] + worker["pending"] == len(messages), worker
    assert final["delay"]["count"] == worker["published"]
    # Each slow record waited at least from its arrival to the burst, unless it still
    # waits for a group.
    waited_long = sum(1 for t in arrived if burst_at - t > LONG)
    buckets = {str(bound): count for bound, count in final["delay"]["buckets"]}
    over_long = final["delay"]["count"] - buckets[str(LONG)]
    assert waited_long >= 10 and over_long >= waited_long - worker["pending"], (
        waited_long, final["delay"],
    )  # fmt: skip
    assert final["delay"]["p99"] > LONG

    # The live page shows the floor and the delay quantiles.
    assert f"floor {FLOOR} per partition" in page["pool"], page
    assert page["p99"] not in ("", "—"), page


def live_page(url: str) -> dict[str, str]:
    from playwright.sync_api import sync_playwright

    assert shutil.which("chromium") or CHROMIUM
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.goto(f"{url}/")
        page.wait_for_selector('body[data-ready="1"]', timeout=30_000)
        page.wait_for_function(
            "document.getElementById('c-delay-p99').textContent !== '—'", timeout=30_000
        )
        shown = {"pool": page.inner_text("#c-pool-sub"), "p99": page.inner_text("#c-delay-p99")}
        browser.close()
    return shown
