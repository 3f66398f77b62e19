"""Shared fixtures: small synthetic tables with known truth and the bundled Adult sample."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from deploy.embedded import EmbeddedServers, Endpoints
from service.cli.batch import main
from service.core.schema import Attribute, Schema
from service.core.table import Table, open_sample, read_table

ADULT_QUASI = ["age", "sex", "race", "marital_status", "education"]


def synthetic_table(shares: list[float], rows: int, public_values: int = 3, seed: int = 0) -> Table:
    """A public attribute `a` correlated with a sensitive attribute `s` of given shares."""
    rng = np.random.default_rng(seed)
    shares_array = np.asarray(shares) / np.sum(shares)
    sensitive = rng.choice(len(shares), size=rows, p=shares_array)
    conditional = rng.dirichlet(np.full(public_values, 1.5), size=len(shares))
    cumulative = conditional.cumsum(axis=1)[sensitive]
    public = (rng.random(rows)[:, None] > cumulative).sum(axis=1)
    schema = Schema(
        (
            Attribute("a", False, tuple(f"a{i}" for i in range(public_values))),
            Attribute("s", True, tuple(f"s{i}" for i in range(len(shares)))),
        )
    )
    return Table(schema, {"a": public.astype(np.int32), "s": sensitive.astype(np.int32)})


@pytest.fixture(scope="session")
def adult() -> Table:
    with open_sample() as stream:
        table, rejections = read_table(stream, quasi=ADULT_QUASI, sensitive=["occupation"])
    assert not rejections
    return table


@pytest.fixture(scope="session")
def adult_csv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample as `splu sample` writes it."""
    path = tmp_path_factory.mktemp("data") / "adult.csv"
    assert main(["sample", "--output", str(path)]) == 0
    return path


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoints]:
    """A Kafka broker and a Redis server shared by the session (or those KAFKA_BOOTSTRAP and
    REDIS_URL name): tests use fresh topic and key names rather than fresh servers."""
    with EmbeddedServers(tmp_path_factory.mktemp("servers")) as endpoints:
        yield endpoints


@pytest.fixture
def redis_client(servers: Endpoints) -> Iterator[redis.Redis]:
    """A plain client of the session's Redis server, for a test that calls scripts itself."""
    client = redis.Redis.from_url(servers.redis_url)
    yield client
    client.close()
