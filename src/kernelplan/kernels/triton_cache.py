"""Triton's compiled kernels under kernelplan's cache folder, for kernelplan's own kernels.

Triton keeps its own disk cache (``~/.triton/cache``, or ``TRITON_CACHE_DIR``).
kernelplan compiles its Triton kernels inside ``compiling()``, which points
Triton's cache at ``$KERNELPLAN_CACHE_DIR/triton`` for those compiles alone, so
``kernelplan warmup`` and ``kernelplan cache info|clear`` cover them beside the
cubins.  Every other Triton user of the process (``torch.compile``) keeps its
own folder: the knob is set inside ``triton.knobs.cache.scope()`` and restored
after, never through the environment.  (A Triton compile in another thread that
starts inside that window writes here too; it is a cache entry, nothing more.)

* ``TRITON_CACHE_DIR``, where the user set it, is left alone: kernelplan's
  Triton kernels go there as well.
* A folder that cannot be written warns once, and Triton keeps its own
  folder: a cache is never the reason a computation fails.
* Bounded: past ``max_bytes`` the oldest entries (Triton's per-kernel folders,
  by last write; Triton does not touch them on a read) go.
* Compiles happen on a kernel's first launch for a specialization, which is
  where kernelplan enters the scope (``Launcher.compiled``, the gated kernel's
  first launch of a problem, the conversions).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path

from ..cache import at_default, default_cache_dir, warn

DEFAULT_MAX_BYTES = 256 * 2**20
_LOCK = threading.RLock()  # one scope at a time: the knob is process-wide


class TritonCache:
    """kernelplan's folder of Triton's cache entries: where, how big, cleared on request."""

    def __init__(self, folder: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        self.folder = Path(folder) if folder is not None else default_cache_dir() / "triton"
        self.max_bytes = int(max_bytes)
        self.unusable: str | None = None
        self._checked = False

    def user_folder(self) -> str | None:
        """``TRITON_CACHE_DIR`` when the user set it: then Triton's folder is theirs, and this one unused."""
        return os.environ.get("TRITON_CACHE_DIR") or None

    def usable(self) -> bool:
        """The folder made and found writable, once per process (a conversion enters the scope on every call)."""
        if self.unusable is None and not self._checked:
            self._checked = True
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                if not os.access(self.folder, os.W_OK | os.X_OK):
                    raise PermissionError(f"no write permission on {self.folder}")
            except OSError as e:
                self.unusable = f"{type(e).__name__}: {e}"
                warn(f"kernelplan's Triton cache {self.folder} cannot be written ({self.unusable}); kernelplan's "
                     f"Triton kernels are cached in Triton's own folder: point KERNELPLAN_CACHE_DIR at a writable "
                     f"directory")
        return self.unusable is None

    def entries(self) -> list[Path]:
        try:
            return [p for p in self.folder.iterdir() if p.is_dir()]
        except OSError:
            return []

    def _sizes(self) -> list[tuple[float, int, Path]]:
        out = []
        for entry in self.entries():
            with contextlib.suppress(OSError):
                files = [f.stat() for f in entry.iterdir()]
                out.append((max((s.st_mtime for s in files), default=entry.stat().st_mtime),
                            sum(s.st_size for s in files), entry))
        return out

    def info(self) -> dict:
        sizes = self._sizes()
        return {"path": str(self.folder), "entries": len(sizes), "size_bytes": sum(s for _, s, _ in sizes),
                "max_bytes": self.max_bytes, "unusable": self.unusable, "overridden_by": self.user_folder()}

    def clear(self) -> int:
        n = 0
        for entry in self.entries():
            shutil.rmtree(entry, ignore_errors=True)
            n += not entry.exists()
        return n

    def evict(self) -> None:
        """Drop the oldest entries until the folder holds at most ``max_bytes``."""
        sizes = self._sizes()
        total = sum(s for _, s, _ in sizes)
        for _, size, entry in sorted(sizes, key=lambda s: s[0]):
            if total <= self.max_bytes:
                break
            shutil.rmtree(entry, ignore_errors=True)  # another process may have dropped it first
            total -= size

    @contextlib.contextmanager
    def compiling(self):
        """Triton compiles inside this block write to this folder (unless the user named Triton's own)."""
        if _interpreted() or self.user_folder() is not None or not self.usable():
            yield
            return
        import triton.knobs

        with _LOCK:
            before = self._stamp()
            with triton.knobs.cache.scope():
                triton.knobs.cache.dir = str(self.folder)
                yield
            if self._stamp() != before:  # an entry was added: a compile
                with contextlib.suppress(OSError):
                    self.evict()

    def _stamp(self) -> int | None:
        """The folder's modification time: one stat, where counting its entries took a stat of each (0.2 ms a
        conversion with a few hundred kernels cached, bench/results/sparse24-convert-h100.json at 23a4c98)."""
        try:
            return self.folder.stat().st_mtime_ns
        except OSError:
            return None


def _interpreted() -> bool:
    """TRITON_INTERPRET is set: nothing compiles, so nothing to point anywhere (Triton's own spelling of true)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y")


def triton_cache() -> TritonCache:
    """The process-wide Triton folder at the default location (re-read if KERNELPLAN_CACHE_DIR changes)."""
    return at_default(TritonCache, "triton")


def compiling():
    """``triton_cache().compiling()``: wrap a first launch of one of kernelplan's Triton kernels in it."""
    return triton_cache().compiling()
