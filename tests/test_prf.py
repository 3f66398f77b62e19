"""Keyed PRF: reproducible under one key, unrelated across keys and purposes."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from service.core.prf import (
    KeyedUniforms,
    ServiceKey,
    keystream64,
    prf64,
    random_ids,
    to_unit_interval,
)


def test_same_key_same_outputs_and_ids():
    key = ServiceKey.from_seed(7)
    ids = random_ids(1000, key)
    assert np.array_equal(ids, random_ids(1000, ServiceKey.from_seed(7)))
    assert np.array_equal(prf64(key, "draw", ids), prf64(ServiceKey.from_seed(7), "draw", ids))


def test_keys_and_purposes_give_unrelated_outputs():
    ids = random_ids(5000)
    a = prf64(ServiceKey.from_seed(1), "draw", ids)
    b = prf64(ServiceKey.from_seed(2), "draw", ids)
    c = prf64(ServiceKey.from_seed(1), "order", ids)
    # Equal low bits would happen with probability 1/2 per row if outputs were related.
    assert (a & 1 == b & 1).mean() == pytest.approx(0.5, abs=4 * 0.5 / np.sqrt(5000))
    assert (a & 1 == c & 1).mean() == pytest.approx(0.5, abs=4 * 0.5 / np.sqrt(5000))


def test_prf_output_is_uniform_mod_gamma():
    draws = prf64(ServiceKey.from_seed(3), "draw", random_ids(20_000, ServiceKey.from_seed(4))) % 5
    observed = np.bincount(draws.astype(np.int64), minlength=5)
    assert stats.chisquare(observed).pvalue > 0.001


def test_fresh_ids_and_keys_differ_every_time():
    assert not np.array_equal(random_ids(4), random_ids(4))
    assert ServiceKey.fresh() != ServiceKey.fresh()


def test_secret_never_shows_in_repr():
    key = ServiceKey.from_seed(1)
    assert key.secret.hex() not in repr(key) and repr(key) == "ServiceKey()"
    with pytest.raises(ValueError, match="32 bytes"):
        ServiceKey(b"short")


@pytest.mark.parametrize("start", [0, 1, 2, 7])
def test_keystream_offsets_continue_the_same_stream(start):
    key = ServiceKey.from_seed(9)
    whole = keystream64(key, "x", 40)
    assert np.array_equal(keystream64(key, "x", 40 - start, start=start), whole[start:])


def test_keyed_uniforms_chunks_form_one_stream():
    key = ServiceKey.from_seed(5)
    chunked = KeyedUniforms(key, "u", chunk=3)
    taken = chunked.take() + chunked.take() + chunked.take(4)
    assert taken == to_unit_interval(keystream64(key, "u", 10)).tolist()
    assert all(0.0 <= u < 1.0 for u in taken)
