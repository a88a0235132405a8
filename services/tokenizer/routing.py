"""Which engine a request goes to, when a tokenizer service fronts several (``--routing``).

* ``round_robin``: in turn.
* ``least_loaded``: the fewest requests (this service's open ones, or the engine's running + waiting as its last
  GetInfo said, whichever is more), then the lowest KV-cache usage (in tenths of the pool).
* ``kv_aware`` (the default with several engines): the engine whose prefix cache holds the longest prefix of the
  prompt, exactly: the prompt's full-block hashes are computed here with the engine's own function
  (engine.core.block_hashing: same algorithm, block size and ``PYTHONHASHSEED``, LoRA name and cache salt as extra
  keys) and looked up in each engine's index of the blocks its KV events said it cached. Load wins over the cache
  when the engines' loads drift apart (SGLang's cache-aware rule): when the most loaded has more than
  ``balance_abs_threshold`` requests over the least loaded and more than ``balance_rel_threshold`` times its load,
  the request goes to the least loaded, so one hot prefix under concurrency still spreads over the replicas.

Ties go in turn, so that requests sharing nothing alternate over idle engines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.core.block_hashing import BlockHasher, block_extra_keys, external_block_hash, make_block_hasher

if TYPE_CHECKING:
    from services.tokenizer.kv_index import BlockIndex

ROUTING_POLICIES = ("kv_aware", "least_loaded", "round_robin")


@dataclass(frozen=True)
class RoutingSettings:
    """``policy`` None: ``kv_aware`` with several engines (one engine needs no choice)."""

    policy: str | None = None
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.policy!r}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("the balance thresholds must be >= 0 (absolute) and >= 1 (relative)")

    def policy_for(self, num_engines: int) -> str:
        return self.policy or ("kv_aware" if num_engines > 1 else "round_robin")


class Candidate(Protocol):
    """What routing reads of one engine (services.tokenizer.engines.Engine)."""

    @property
    def load(self) -> int: ...

    @property
    def kv_cache_usage(self) -> float: ...

    @property
    def cache(self) -> CacheView | None: ...


@dataclass(frozen=True)
class CacheView:
    """An engine's prefix cache as the router sees it: the index its KV events feed, and how it hashes blocks."""

    index: BlockIndex
    block_size: int
    hash_algo: str


@dataclass(frozen=True)
class Decision:
    """The engine chosen (its position among the candidates), by which rule, and the prompt tokens it has cached
    (as far as its KV events said)."""

    choice: int
    policy: str           # the rule that decided: kv_aware, least_loaded, round_robin, or balance (kv_aware overruled)
    matched_tokens: int = 0

    def describe(self) -> str:
        return f"{self.policy}, {self.matched_tokens} prompt tokens cached there"


class PromptBlocks:
    """A prompt's full-block hashes as KV events carry them, computed as far as they are asked for (the walk stops
    at the first block no engine has)."""

    def __init__(self, token_ids: Sequence[int], block_size: int, hasher: BlockHasher, lora_name: str | None,
                 cache_salt: str | None) -> None:
        self._ids = token_ids
        self._bs = block_size
        self._hasher = hasher
        self._lora = lora_name
        self._salt = cache_salt
        self._hashes: list[bytes] = []
        self._external: list[int] = []
        self.num_blocks = len(token_ids) // block_size

    def __iter__(self) -> Iterator[int]:
        for i in range(self.num_blocks):
            while len(self._external) <= i:
                j = len(self._hashes)
                block = tuple(map(int, self._ids[j * self._bs:(j + 1) * self._bs]))  # numpy ints pickle otherwise
                digest = self._hasher(self._hashes[-1] if self._hashes else None, block,
                                      block_extra_keys(self._lora, self._salt, j == 0))
                self._hashes.append(digest)
                self._external.append(external_block_hash(digest))
            yield self._external[i]


# A prompt's block hashes by (block size, hash algorithm).
PromptHashes = dict[tuple[int, str], PromptBlocks]


class Router:
    """One service's routing state: the rotation for ties, the hashers by algorithm (each binds this process's
    ``PYTHONHASHSEED``, which must be the engines')."""

    def __init__(self, settings: RoutingSettings, hasher_for: Callable[[str], BlockHasher] = make_block_hasher
                 ) -> None:
        self.settings = settings
        self._next = 0
        self._hasher_for = hasher_for
        self._hashers: dict[str, BlockHasher] = {}

    def choose(self, engines: Sequence[Candidate], token_ids: Sequence[int], *, lora_name: str | None = None,
               cache_salt: str | None = None, hashes: PromptHashes | None = None) -> Decision:
        """Which of ``engines`` (at least one) gets a request for the prompt ``token_ids``; ``hashes``: the
        prompt's, from :meth:`hash_prompt` (None: computed here, as far as needed)."""
        if len(engines) == 1:
            return Decision(0, "single")
        policy = self.settings.policy_for(len(engines))
        if policy == "round_robin":
            return Decision(self._turn(list(range(len(engines)))), policy)
        loads = [e.load for e in engines]
        if policy == "least_loaded" or self._imbalanced(loads):
            return Decision(self._least_loaded(engines, range(len(engines))),
                            policy if policy == "least_loaded" else "balance")
        if hashes is None:
            hashes = self.hash_prompt(engines, token_ids, lora_name=lora_name, cache_salt=cache_salt)
        matched = [_matched_tokens(e.cache, hashes) for e in engines]
        best = max(matched)
        choice = self._least_loaded(engines, [i for i, m in enumerate(matched) if m == best])
        return Decision(choice, policy, best)

    def _imbalanced(self, loads: list[int]) -> bool:
        most, least = max(loads), min(loads)
        s = self.settings
        return most - least > s.balance_abs_threshold and most > s.balance_rel_threshold * least

    def _least_loaded(self, engines: Sequence[Candidate], among: Iterator[int] | Sequence[int] | range) -> int:
        # KV usage comes from the engine's last GetInfo (up to a second old): only a difference of a tenth of the
        # pool or more counts, else requests that finish within that second would all go to one engine.
        keyed = [((engines[i].load, int(engines[i].kv_cache_usage * 10)), i) for i in among]
        low = min(k for k, _ in keyed)
        return self._turn([i for k, i in keyed if k == low])

    def _turn(self, tied: list[int]) -> int:
        """One of ``tied`` in turn."""
        self._next += 1
        return tied[self._next % len(tied)]

    def hash_prompt(self, engines: Sequence[Candidate], token_ids: Sequence[int], *, lora_name: str | None = None,
                    cache_salt: str | None = None) -> PromptHashes:
        """The prompt's block hashes for each way the engines hash (once in practice: one block size and
        algorithm), computed as far as some engine has them cached. Safe off the event loop (it only reads the
        indexes): a long prompt's hashes take a while."""
        hashes: PromptHashes = {}
        for e in engines:
            cache = e.cache
            if cache is None or not len(cache.index):
                continue
            key = (cache.block_size, cache.hash_algo)
            blocks = hashes.get(key)
            if blocks is None:
                blocks = hashes[key] = PromptBlocks(token_ids, cache.block_size, self._hasher(cache.hash_algo),
                                                    lora_name, cache_salt)
            cache.index.matched_blocks(blocks)   # computes them as far as this engine has them
        return hashes

    def _hasher(self, algo: str) -> BlockHasher:
        hasher = self._hashers.get(algo)
        if hasher is None:
            hasher = self._hashers[algo] = self._hasher_for(algo)
        return hasher


def _matched_tokens(cache: CacheView | None, hashes: PromptHashes) -> int:
    """The prompt tokens ``cache`` holds (0 where it is unknown)."""
    blocks = None if cache is None else hashes.get((cache.block_size, cache.hash_algo))
    if cache is None or blocks is None:
        return 0
    return cache.index.matched_blocks(blocks) * cache.block_size
