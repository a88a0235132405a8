"""The prefix cache's block hash: one documented function, shared by the engine and any router (a leaf module).

A full block's hash is vLLM's ``hash_block_tokens``::

    block_hash = H((parent_hash or NONE_HASH, tuple(block_token_ids), extra_keys))

``H`` is the ``--prefix-caching-hash-algo`` (vLLM's names and serializations):

* ``sha256``       ``hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()`` (vLLM's default)
* ``sha256_cbor``  ``hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()`` — reproducible outside Python
* ``xxhash``       ``xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))``
* ``xxhash_cbor``  ``xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))``

``NONE_HASH`` (the first block's parent) is ``H(PYTHONHASHSEED)`` when that variable is set, else 32 random bytes
per process — as vLLM, so that without an agreed seed nobody outside can predict a block's hash. A router that
recomputes hashes must run with the engine's ``PYTHONHASHSEED`` and algorithm.

``extra_keys`` is None for a base-model block without a salt or image, else a tuple of, in vLLM's order, the LoRA
adapter's name, the content hashes of the images whose placeholders the block covers, and (first block only) the
request's cache salt. KV events carry each hash as vLLM does by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): its last 8 bytes as an unsigned big-endian integer
(``external_block_hash``).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

BlockHash = bytes
ExtraKeys = tuple[Any, ...] | None
# (parent hash, the block's token ids, extra keys) -> the block's hash.
BlockHasher = Callable[[bytes | None, tuple[int, ...], ExtraKeys], bytes]


def _pickled(obj: object) -> bytes:
    # Serializing our own tuples of ints, bytes and strings to hash them; nothing is ever unpickled.
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: object) -> bytes:
    import cbor2

    return cbor2.dumps(obj, canonical=True)


def _xxh3_128(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


_DIGESTS: dict[str, Callable[[object], bytes]] = {
    "sha256": lambda obj: hashlib.sha256(_pickled(obj)).digest(),
    "sha256_cbor": lambda obj: hashlib.sha256(_cbor(obj)).digest(),
    "xxhash": lambda obj: _xxh3_128(_pickled(obj)),
    "xxhash_cbor": lambda obj: _xxh3_128(_cbor(obj)),
}


PREFIX_CACHING_HASH_ALGOS = tuple(_DIGESTS)


def hash_function(algo: str) -> Callable[[object], bytes]:
    """The serialize-and-digest function named by ``--prefix-caching-hash-algo``."""
    try:
        return _DIGESTS[algo]
    except KeyError:
        raise ValueError(f"unknown prefix caching hash algorithm {algo!r}; "
                         f"one of {', '.join(PREFIX_CACHING_HASH_ALGOS)}") from None


def none_hash(algo: str, environ: Mapping[str, str] | None = None) -> bytes:
    """The first block's parent hash: ``H(PYTHONHASHSEED)`` when it is set, else random per process."""
    seed = (os.environ if environ is None else environ).get("PYTHONHASHSEED")
    return os.urandom(32) if seed is None else hash_function(algo)(seed)


def hash_block_tokens(hash_fn: Callable[[object], bytes], none: bytes, parent_hash: bytes | None,
                      token_ids: tuple[int, ...], extra_keys: ExtraKeys = None) -> bytes:
    """Chained hash of one full block (vLLM ``hash_block_tokens``)."""
    return hash_fn((parent_hash or none, tuple(token_ids), extra_keys))


def make_block_hasher(algo: str = "sha256", environ: Mapping[str, str] | None = None) -> BlockHasher:
    """``hash_block_tokens`` bound to one algorithm and this process's ``NONE_HASH``."""
    fn, none = hash_function(algo), none_hash(algo, environ)

    def hasher(parent_hash: bytes | None, token_ids: tuple[int, ...], extra_keys: ExtraKeys = None) -> bytes:
        return hash_block_tokens(fn, none, parent_hash, token_ids, extra_keys)

    return hasher


def block_extra_keys(lora_name: str | None, cache_salt: str | None, first_block: bool,
                     mm_hashes: Sequence[str] = ()) -> ExtraKeys:
    """A block's extra keys, as vLLM's ``generate_block_hash_extra_keys`` orders them: the LoRA adapter, the hashes
    of the multimodal items whose placeholders the block covers (``mm_block_hashes``), the salt."""
    keys: list[Any] = []
    if lora_name is not None:
        keys.append(lora_name)
    keys.extend(mm_hashes)
    if first_block and cache_salt:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def mm_block_hashes(spans: Sequence[tuple[int, int, str]], start: int, end: int) -> tuple[str, ...]:
    """The hashes of the multimodal items, given as (placeholder offset, length, hash) in prompt order, whose
    placeholders overlap the block of tokens ``[start, end)`` (vLLM's ``_gen_mm_extra_hash_keys``)."""
    return tuple(h for offset, length, h in spans if offset < end and offset + length > start)


def external_block_hash(block_hash: bytes | int) -> int:
    """A hash as KV events carry it: the digest's last 8 bytes, unsigned big-endian (vLLM's int block hashes)."""
    if isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF
