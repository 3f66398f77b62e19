"""Keyed pseudo-random functions: record ids, per-record draws, keyed choices.

Everything random that decides what gets published derives from one secret
*service key*. A retry or a redelivery therefore reproduces the same output
instead of drawing again: a second independent draw for the same record would
be a second release of it, and averaging releases strips the small-count noise
(SPEC §2.1, seed notes 001 §9).

The PRF is AES-256 applied to a 128-bit record id under a per-purpose subkey.
AES is a pseudo-random permutation; on distinct 128-bit inputs it is
indistinguishable from a random function up to the birthday bound q²/2¹²⁹
(PRP/PRF switching), which for q = 10⁹ records is below 10⁻²⁰. AES rather than a
per-record HMAC because numpy hands the whole id array to one AES call: the worker
derives every record's id and draws this way, so the PRF's cost per record is the
worker's (docs/performance.md, *Keyed PRF*).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_BYTES = 32
_FLOAT_SCALE = 2.0**-53


@dataclass(frozen=True)
class ServiceKey:
    """The secret behind every keyed draw. Its bytes never appear in repr or logs."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise ValueError(f"a service key has {KEY_BYTES} bytes, got {len(self.secret)}")

    @classmethod
    def fresh(cls) -> ServiceKey:
        """A new random key: the default, so nobody can replay a publication."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_seed(cls, seed: int) -> ServiceKey:
        """A key anyone holding `seed` can rebuild: for reproducible experiments only."""
        return cls(hashlib.sha256(b"splu-stream seed\0" + str(int(seed)).encode()).digest())

    def subkey(self, purpose: str) -> bytes:
        """Independent key per purpose, so draws for different uses never correlate."""
        return hmac.digest(self.secret, purpose.encode(), "sha256")


def ids_for(key: ServiceKey, names: list[bytes], prefix: bytes = b"") -> np.ndarray:
    """Record ids keyed by a stable name per record (producer id or offset), each
    name read after `prefix`.

    A redelivered record gets back the id it had, and ids stay independent of
    record content and unguessable without the key.
    """
    # Copying a state that has absorbed the prefix hashes prefix + name without
    # building it, and costs less than a new hash object per record.
    state = hashlib.blake2b(prefix, digest_size=16)
    digests = []
    for name in names:
        digest = state.copy()
        digest.update(name)
        digests.append(digest.digest())
    blocks = np.frombuffer(b"".join(digests), dtype=">u8").astype(np.uint64).reshape(-1, 2)
    return prf128(key, "record ids", blocks)


def random_ids(n: int, key: ServiceKey | None = None) -> np.ndarray:
    """`n` random 128-bit ids as an (n, 2) uint64 array of (high, low) words.

    Ids are independent of record content and arrival order. With `key` they are
    reproducible from it (seeded runs); without, they come from the OS.
    """
    if key is None:
        words = np.frombuffer(os.urandom(16 * n), dtype=np.uint64)
    else:
        words = keystream64(key, "record ids", 2 * n)
    return words.reshape(n, 2).copy()


def prf128(key: ServiceKey, purpose: str, blocks: np.ndarray) -> np.ndarray:
    """PRF(key, purpose, block) as (n, 2) uint64 words, for (n, 2) uint64 input blocks."""
    blocks = np.ascontiguousarray(blocks, dtype=np.uint64)
    encryptor = Cipher(algorithms.AES(key.subkey(purpose)), modes.ECB()).encryptor()
    out = encryptor.update(blocks.astype(">u8").tobytes()) + encryptor.finalize()
    return np.frombuffer(out, dtype=">u8").astype(np.uint64).reshape(-1, 2)


def prf64(key: ServiceKey, purpose: str, ids: np.ndarray) -> np.ndarray:
    """PRF(key, purpose, id) as uint64, one per row of the (n, 2) `ids` array."""
    return prf128(key, purpose, ids)[:, 0].copy()


def keystream64(key: ServiceKey, purpose: str, n: int, start: int = 0) -> np.ndarray:
    """Words `start .. start+n-1` of the AES-CTR keystream for `purpose` as uint64."""
    first_block, skip = divmod(start, 2)
    nonce = int(first_block).to_bytes(16, "big")
    encryptor = Cipher(algorithms.AES(key.subkey(purpose)), modes.CTR(nonce)).encryptor()
    words = np.frombuffer(encryptor.update(bytes(8 * (n + skip))), dtype="<u8")
    return words[skip:].astype(np.uint64)


def to_unit_interval(words: np.ndarray) -> np.ndarray:
    """Map uint64 words to floats uniform on [0, 1) using their top 53 bits."""
    return (words >> np.uint64(11)).astype(np.float64) * _FLOAT_SCALE


class KeyedUniforms:
    """An endless, reproducible stream of uniforms on [0, 1) for keyed choices.

    Consumers take uniforms in chunks; the sequence depends only on the key and
    the purpose, so a sequential algorithm fed from it is deterministic.
    """

    def __init__(self, key: ServiceKey, purpose: str, chunk: int = 1 << 16) -> None:
        self._key = key
        self._purpose = purpose
        self._chunk = chunk
        self._position = 0

    def take(self, n: int | None = None) -> list[float]:
        n = self._chunk if n is None else n
        words = keystream64(self._key, self._purpose, n, start=self._position)
        self._position += n
        return to_unit_interval(words).tolist()
