"""Compiled kernels on disk: a new process loads a cubin instead of compiling it again.

The contract is ferrotorch-gpu's module cache (``../shared/seeds``): compiled
modules keyed by what they were compiled from, loaded once per device in a
process (``nvrtc.function``'s cache).  Its leak is left behind: the folder is
bounded, least recently used first out.

* Key: sha256 of the kernel's full source after preprocessing (which holds
  its kernels' names: one cubin is one module, its kernels looked up by
  name), the compile options, the architecture, the NVRTC and driver versions
  and kernelplan's version.  A change of any gives a new file.
* Files: ``<key>.cubin`` under ``$KERNELPLAN_CACHE_DIR/kernels``, each the
  magic, the sha256 of the payload and the payload.  A file that fails its
  checksum (truncated, damaged) is dropped with a warning and compiled again.
* Writes go to a temporary file, then ``os.replace``: processes compiling the
  same kernel at once leave one valid file.
* Bounded: past ``max_bytes`` the least recently read files go (reads touch
  the file's time).
* A folder that cannot be written warns once; compiled kernels then stay in
  this process's memory, as the plan cache does.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path

from .. import __version__
from ..cache import at_default, default_cache_dir, warn

MAGIC = b"KPCUBIN1"
DEFAULT_MAX_BYTES = 512 * 2**20


def cache_key(source: str, options: tuple[str, ...], architecture: str, compiler: str) -> str:
    """The file name of a compiled kernel: everything its bytes depend on, hashed."""
    h = hashlib.sha256()
    for part in (source, "\0".join(options), architecture, compiler, __version__):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()


class KernelCache:
    """A bounded folder of cubins, process-safe; counts its hits, misses and drops for tests and ``cache info``."""

    def __init__(self, folder: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        self.folder = Path(folder) if folder is not None else default_cache_dir() / "kernels"
        self.max_bytes = int(max_bytes)
        self.hits = self.misses = self.dropped = 0
        self.unusable: str | None = None
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        path = self.folder / f"{key}.cubin"
        try:
            blob = path.read_bytes()
        except OSError:  # missing (the usual miss), or unreadable: compiled again either way
            self.misses += 1
            return None
        payload = blob[len(MAGIC) + 32:]
        if blob[:len(MAGIC)] != MAGIC or hashlib.sha256(payload).digest() != blob[len(MAGIC):len(MAGIC) + 32]:
            self.dropped += 1
            self.misses += 1
            warn(f"kernelplan kernel cache: {path} fails its checksum (truncated or damaged); it is dropped and "
                  f"the kernel compiled again")
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: the last to be evicted
        self.hits += 1
        return payload

    def put(self, key: str, payload: bytes) -> None:
        if self.unusable is not None:
            return
        path = self.folder / f"{key}.cubin"
        tmp = self.folder / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.unusable = f"{type(e).__name__}: {e}"
            warn(f"kernelplan kernel cache {self.folder} cannot be written ({self.unusable}); compiled kernels are "
                  f"kept in this process's memory only: point KERNELPLAN_CACHE_DIR at a writable directory")
            return
        with self._lock:
            self._evict()

    def entries(self) -> list[Path]:
        try:
            return [p for p in self.folder.iterdir() if p.suffix == ".cubin"]
        except OSError:
            return []

    def info(self) -> dict:
        files = self.entries()
        size = 0
        for p in files:
            with contextlib.suppress(OSError):
                size += p.stat().st_size
        return {"path": str(self.folder), "entries": len(files), "size_bytes": size, "max_bytes": self.max_bytes,
                "unusable": self.unusable}

    def clear(self) -> int:
        n = 0
        for p in self.entries():
            with contextlib.suppress(OSError):
                p.unlink()
                n += 1
        return n

    def _evict(self) -> None:
        """Drop the least recently used files until the folder holds at most ``max_bytes``."""
        stats = []
        for p in self.entries():
            with contextlib.suppress(OSError):
                st = p.stat()
                stats.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in stats)
        for _, size, p in sorted(stats, key=lambda s: s[0]):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                p.unlink()  # another process may have dropped it first
            total -= size


def kernel_cache() -> KernelCache:
    """The process-wide kernel cache at the default location (re-read if KERNELPLAN_CACHE_DIR changes)."""
    return at_default(KernelCache, "kernels")
