"""The downstream reader: a stream's answers from its two public topics alone.

``splu query --topic STREAM`` and this module's `read_publication` read
``<stream>.manifest`` and the published topic it names straight from Kafka (no consumer
group, nothing committed: from the beginning through the end offsets at the start), count
each record once by its token and answer count queries exactly as the stream's consumer
answers ``/estimate``. They need read access to the two topics and nothing else: no config
file, no service key, no Redis (the reader role of docs/security.md's ACL table). A secured
cluster's settings come from the KAFKA_* variables a stream's config would override
(`service.core.config`), or from a `KafkaSettings`. The counting and the answers are
`service.core.manifest`::

    from streams.tools.reader import read_publication

    publication = read_publication("adult", bootstrap="kafka:9092")
    answers = publication.answer([{"where": {"sex": "Female"}, "value": {"occupation": "Sales"}}])
    pandas.DataFrame(answers)  # the query, estimate, low, high, published, rows
"""

from __future__ import annotations

import os

from aiokafka.structs import ConsumerRecord

from service.core.kafka_settings import KAFKA_ENV, KafkaSettings, kafka_from_env
from service.core.manifest import ManifestError, Publication, manifest_topic
from streams.runtime.manifest import read_manifest, read_to_end
from streams.runtime.topics import existing_topics, run_in_thread

HINT = "give --bootstrap HOST:PORT or set KAFKA_BOOTSTRAP"


async def fetch_publication(
    stream: str, kafka: KafkaSettings, confidence: float = 0.95
) -> Publication:
    """The stream's manifest and every record published when the read starts, counted."""
    manifest = await read_manifest(kafka, stream, HINT)
    if manifest is None:
        raise ManifestError(
            f"{manifest_topic(stream)} at {kafka.bootstrap} holds no manifest: no stream "
            f"{stream!r} there, or its workers have not started (or predate manifests)"
        )
    topic = manifest.published_topic
    partitions = (await existing_topics(kafka, HINT)).get(topic)
    if partitions is None:
        raise ManifestError(
            f"the manifest names {topic}, which does not exist at {kafka.bootstrap} (or this "
            "reader may not see it)"
        )
    tally = manifest.tally()

    def count(batch: list[ConsumerRecord]) -> None:
        for record in batch:
            tally.add(record.key, record.value)

    await read_to_end(kafka, topic, partitions, on_batch=count)
    return Publication(manifest, tally, confidence)


def read_publication(
    stream: str,
    bootstrap: str | None = None,
    confidence: float = 0.95,
    kafka: KafkaSettings | None = None,
) -> Publication:
    """`fetch_publication` for sync callers (also inside a running event loop, as in
    Jupyter). The brokers: `kafka`, else the KAFKA_* variables (`bootstrap` overriding
    KAFKA_BOOTSTRAP), as a stream's config names them: a secured cluster needs
    KAFKA_SECURITY_PROTOCOL, KAFKA_CA_FILE, KAFKA_SASL_MECHANISM, KAFKA_USERNAME and
    KAFKA_PASSWORD (or KAFKA_PASSWORD_FILE). `confidence`: the coverage of every answer's
    [low, high] (the consumer's is 0.95)."""
    if kafka is None:
        if not (bootstrap or os.environ.get(KAFKA_ENV["bootstrap"])):
            raise ValueError(f"name the Kafka bootstrap: {HINT}")
        kafka = kafka_from_env(bootstrap)
    return run_in_thread(fetch_publication(stream, kafka, confidence))
