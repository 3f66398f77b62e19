"""The downstream reader: a stream's answers from its two public topics alone.

``splu query --topic STREAM`` and this module's `read_publication` read
``<stream>.manifest`` and the published topic it names straight from Kafka (no consumer
group, nothing committed: from the beginning through the end offsets at the start), count
each record once by its token and answer count queries exactly as the stream's consumer
answers ``/estimate``. They need read access to the two topics and nothing else: no config
file, no service key, no Redis. The counting and the answers are `service.manifest`::

    from streams.reader import read_publication

    publication = read_publication("adult", bootstrap="kafka:9092")
    answers = publication.answer([{"where": {"sex": "Female"}, "value": {"occupation": "Sales"}}])
    pandas.DataFrame(answers)  # the query, estimate, low, high, published, rows
"""

from __future__ import annotations

import os

from aiokafka.structs import ConsumerRecord

from service.manifest import ManifestError, Publication, manifest_topic
from streams.manifest import read_manifest, read_to_end
from streams.topics import existing_topics, run_in_thread

BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP"
HINT = f"give --bootstrap HOST:PORT or set {BOOTSTRAP_ENV}"


async def fetch_publication(stream: str, bootstrap: str, confidence: float = 0.95) -> Publication:
    """The stream's manifest and every record published when the read starts, counted."""
    manifest = await read_manifest(bootstrap, stream, HINT)
    if manifest is None:
        raise ManifestError(
            f"{manifest_topic(stream)} at {bootstrap} holds no manifest: no stream {stream!r} "
            "there, or its workers have not started (or predate manifests)"
        )
    topic = manifest.published_topic
    partitions = (await existing_topics(bootstrap, HINT)).get(topic)
    if partitions is None:
        raise ManifestError(f"the manifest names {topic}, which does not exist at {bootstrap}")
    tally = manifest.tally()

    def count(batch: list[ConsumerRecord]) -> None:
        for record in batch:
            tally.add(record.key, record.value)

    await read_to_end(bootstrap, topic, partitions, on_batch=count)
    return Publication(manifest, tally, confidence)


def read_publication(
    stream: str, bootstrap: str | None = None, confidence: float = 0.95
) -> Publication:
    """`fetch_publication` for sync callers (also inside a running event loop, as in
    Jupyter); `bootstrap` defaults to KAFKA_BOOTSTRAP. `confidence`: the coverage of every
    answer's [low, high] (the consumer's is 0.95)."""
    bootstrap = bootstrap or os.environ.get(BOOTSTRAP_ENV)
    if not bootstrap:
        raise ValueError(f"name the Kafka bootstrap: {HINT}")
    return run_in_thread(fetch_publication(stream, bootstrap, confidence))
