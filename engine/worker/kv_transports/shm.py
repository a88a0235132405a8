"""Same-host transport (``SharedMemoryConnector``): the producer's KV cache lives in anonymous memory files
(``memfd_create``, one per layer), which a consumer on the same host opens through ``/proc/<pid>/fd/<fd>`` and maps
read-only; each block is then copied once, straight from the producer's cache into the consumer's.

The files have no name in ``/dev/shm``, so nothing is left behind when the producer dies, even by SIGKILL: the
memory goes once the last mapping of it is closed. Both engines must see each other's ``/proc`` (one host, one PID
namespace) and the consumer must be allowed to open the producer's descriptors (the same user, or root).
The address is ``pid:fd@inode,fd@inode,...``: a consumer checks each file's inode, so a reused pid never passes
for the producer it named.
"""
from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from engine.attention.backend import CacheMemory
from engine.worker.kv_transports import CacheLayout, KVTransport

logger = logging.getLogger(__name__)


class MemfdCacheMemory:
    """Allocates each cache tensor in an anonymous memory file of its own, kept open for consumers to map."""

    def __init__(self) -> None:
        self.files: list[tuple[int, int]] = []   # (fd, inode) per tensor, in allocation order
        self._maps: list[mmap.mmap] = []

    def empty_cache_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = int(np.prod(shape))
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        fd = os.memfd_create(f"sluice-kv-{len(self.files)}", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        self._maps.append(mm)
        self.files.append((fd, os.fstat(fd).st_ino))
        return torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape)

    def close(self) -> None:
        for fd, _ in self.files:
            os.close(fd)
        self.files = []   # the mappings stay while the tensors on them live


class _Mapped:
    """A producer's cache files, mapped read-only here: one flat byte array per layer."""

    def __init__(self, pid: int, files: list[tuple[int, int]]) -> None:
        self.pid = pid
        self.maps: list[mmap.mmap] = []
        self.layers: list[np.ndarray] = []
        try:
            for fd, inode in files:
                path = f"/proc/{pid}/fd/{fd}"
                with open(path, "rb") as f:
                    if os.fstat(f.fileno()).st_ino != inode:
                        raise OSError(f"{path} is not the producer's cache file (another inode)")
                    mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
                self.maps.append(mm)
                self.layers.append(np.frombuffer(mm, dtype=np.uint8))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.layers = []
        for mm in self.maps:
            try:
                mm.close()
            except BufferError:   # a copy still reads it (another thread): it closes with its last view
                pass
        self.maps = []


def parse_address(address: str) -> tuple[int, list[tuple[int, int]]]:
    """``pid:fd@inode,...`` -> (pid, [(fd, inode), ...]); ValueError when it is not one."""
    pid_text, _, rest = address.partition(":")
    files = []
    for part in rest.split(","):
        fd, _, inode = part.partition("@")
        files.append((int(fd), int(inode)))
    return int(pid_text), files


class SharedMemoryTransport(KVTransport):
    name = "shm"

    def __init__(self) -> None:
        self.memory: MemfdCacheMemory | None = None
        self._mapped: dict[str, _Mapped] = {}

    def cache_memory(self, device: CacheMemory) -> CacheMemory:
        self.memory = MemfdCacheMemory()
        return self.memory

    def publish(self, kv_caches: list[torch.Tensor]) -> str:
        if self.memory is None or len(self.memory.files) < len(kv_caches):
            raise RuntimeError("the KV cache was not allocated from the shared-memory transport's files")
        files = self.memory.files[-len(kv_caches):]
        return f"{os.getpid()}:" + ",".join(f"{fd}@{inode}" for fd, inode in files)

    def _open(self, address: str) -> _Mapped:
        mapped = self._mapped.get(address)
        if mapped is not None:
            return mapped
        for other in [a for a, m in self._mapped.items() if not os.path.exists(f"/proc/{m.pid}")]:
            self._mapped.pop(other).close()   # producers that exited: their memory goes with our mapping
        pid, files = parse_address(address)
        mapped = self._mapped[address] = _Mapped(pid, files)
        return mapped

    def read(self, address: str, layout: CacheLayout, blocks: Sequence[tuple[int, int]],
             kv_caches: list[torch.Tensor], deadline: float) -> int:
        if not blocks:
            return 0
        try:
            mapped = self._open(address)
        except (OSError, ValueError) as e:
            logger.warning("KV transfer: cannot map the producer's cache at %s (%s); its blocks are recomputed",
                           address, e)
            return 0
        if len(mapped.layers) != len(kv_caches) or any(len(src) < layout.num_blocks * layout.planes
                                                       * layout.plane_block_bytes for src in mapped.layers):
            logger.warning("KV transfer: the producer's cache at %s is not the layout it sent", address)
            return 0
        run = layout.plane_block_bytes
        for src, cache in zip(mapped.layers, kv_caches):
            if time.monotonic() > deadline:
                return 0
            planes = src[:layout.planes * layout.num_blocks * run].reshape(layout.planes, layout.num_blocks, run)
            dst = cache.view(-1).view(torch.uint8).numpy().reshape(cache.shape[0], cache.shape[1], run)
            for remote, local in blocks:   # one copy per block (a fancy-index gather would copy twice)
                dst[:, local] = planes[:, remote]
        return len(blocks)

    def close(self) -> None:
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
        if self.memory is not None:
            self.memory.close()
