"""Persistent plan cache: algorithm-search and autotune results in one SQLite file.

* Location: ``$KERNELPLAN_CACHE_DIR/plans.sqlite``, else the user's cache dir
  (``$XDG_CACHE_HOME/kernelplan`` or ``~/.cache/kernelplan``).
* Many processes at once: WAL journal, a busy timeout, and every write in
  one transaction (atomic: a reader sees all of a put or none of it).
* Bounded: at most ``max_entries`` rows; a put beyond that evicts the least
  recently used.  "Used" is recorded when a process first reads a row and on
  every put; later hits in the same process are served from memory and touch
  no disk.
* Keys carry the op, the problem (shape, dtype, layout, epilogue) and the
  environment: GPU name, driver, CUDA, torch, triton and kernelplan versions,
  so a driver or library upgrade never reuses a stale search.
* A corrupt or truncated file is detected (``quick_check`` on open, any
  ``sqlite3.DatabaseError`` later), set aside with a warning, and rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import sqlite3
import threading
import time
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger("kernelplan.cache")

SCHEMA_VERSION = 1
DEFAULT_MAX_ENTRIES = 10_000


class PlanCacheWarning(UserWarning):
    """The plan cache file was unusable and has been rebuilt (results are re-measured)."""


def default_cache_dir() -> Path:
    env = os.environ.get("KERNELPLAN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kernelplan"


@functools.lru_cache(maxsize=None)
def environment_fingerprint(device: str = "cpu") -> dict[str, str]:
    """What a cached measurement depends on besides the problem itself."""
    import torch

    from . import __version__

    fp = {"kernelplan": __version__, "torch": torch.__version__, "device_type": torch.device(device).type}
    try:
        import triton

        fp["triton"] = triton.__version__
    except ImportError:
        fp["triton"] = "none"
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        fp["gpu"] = props.name
        fp["cc"] = f"{props.major}.{props.minor}"
        fp["cuda"] = str(torch.version.cuda)
        fp["driver"] = _driver_version()
    return fp


def _driver_version() -> str:
    try:
        from cuda.bindings import driver  # ships with the GPU machines' cuda-bindings

        err, version = driver.cuDriverGetVersion()
        return str(version)
    except ImportError:  # older stacks: the NVML-free fallback is the runtime's view
        import torch

        return f"runtime-{torch.version.cuda}"


class PlanCache:
    """A process-safe, bounded key -> JSON store with an in-process front layer."""

    def __init__(self, path: str | os.PathLike | None = None, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.path = Path(path) if path is not None else default_cache_dir() / "plans.sqlite"
        self.max_entries = int(max_entries)
        self._memory: dict[str, Any] = {}
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self.disk_reads = 0  # counts queries that went to SQLite, for tests and `cache info`

    # -- keys ------------------------------------------------------------
    @staticmethod
    def make_key(op: str, problem: dict, device: str = "cpu") -> str:
        fingerprint = environment_fingerprint(str(device))
        return json.dumps([op, problem, fingerprint], sort_keys=True, default=str)

    # -- public API ------------------------------------------------------
    def get(self, op: str, problem: dict, device: str | None = None) -> Any | None:
        # The memory layer is keyed without JSON: building the full key costs ~5 us.
        mem_key = (op, _freeze(problem), device)
        if mem_key in self._memory:
            return self._memory[mem_key]
        key = self.make_key(op, problem, device or problem.get("device", "cpu"))
        row = self._with_db(self._read, key)
        value = json.loads(row) if row is not None else None
        if value is not None:
            self._memory[mem_key] = value
        return value

    def put(self, op: str, problem: dict, value: Any, device: str | None = None) -> None:
        key = self.make_key(op, problem, device or problem.get("device", "cpu"))
        self._with_db(self._write, key, op, json.dumps(value, sort_keys=True))
        self._memory[(op, _freeze(problem), device)] = value

    def info(self) -> dict[str, Any]:
        entries = self._with_db(lambda conn: conn.execute("SELECT COUNT(*) FROM plans").fetchone()[0])
        size = sum(p.stat().st_size for p in self._files() if p.exists())
        return {"path": str(self.path), "entries": entries, "size_bytes": size, "max_entries": self.max_entries}

    def clear(self) -> int:
        """Delete every entry; return how many there were."""

        def clear(conn):
            with conn:
                n = conn.execute("DELETE FROM plans").rowcount
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            return n

        n = self._with_db(clear)
        self._memory.clear()
        return n

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # -- internals -------------------------------------------------------
    def _read(self, conn: sqlite3.Connection, key: str) -> str | None:
        self.disk_reads += 1
        with conn:
            row = conn.execute("SELECT value FROM plans WHERE key = ?", (key,)).fetchone()
            if row is not None:
                conn.execute("UPDATE plans SET last_used = ? WHERE key = ?", (time.time(), key))
        return row[0] if row else None

    def _write(self, conn: sqlite3.Connection, key: str, op: str, value: str) -> None:
        now = time.time()
        with conn:  # one transaction: the row and the eviction land together or not at all
            conn.execute(
                "INSERT INTO plans(key, op, value, created, last_used) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value, last_used = excluded.last_used",
                (key, op, value, now, now),
            )
            excess = conn.execute("SELECT COUNT(*) FROM plans").fetchone()[0] - self.max_entries
            if excess > 0:
                conn.execute(
                    "DELETE FROM plans WHERE key IN (SELECT key FROM plans ORDER BY last_used ASC LIMIT ?)",
                    (excess,),
                )

    def _with_db(self, fn, *args):
        with self._lock:
            for attempt in (0, 1):
                try:
                    return fn(self._connection(), *args)
                except sqlite3.DatabaseError as exc:
                    if attempt or isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                        raise
                    self._rebuild(f"{type(exc).__name__}: {exc}")

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
            try:
                self._init_schema(conn)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA busy_timeout = 60000")
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise sqlite3.DatabaseError(f"quick_check reported: {check}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise sqlite3.DatabaseError(f"schema version {version}, expected {SCHEMA_VERSION}")
        with conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS plans (key TEXT PRIMARY KEY, op TEXT NOT NULL, "
                "value TEXT NOT NULL, created REAL NOT NULL, last_used REAL NOT NULL)"
            )
            conn.execute("CREATE INDEX IF NOT EXISTS plans_lru ON plans(last_used)")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _files(self) -> list[Path]:
        return [self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")]

    def _rebuild(self, why: str) -> None:
        """Set the unusable file aside and start an empty one, once across processes."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{self.path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                # Another process may have rebuilt it while we waited for the lock.
                with contextlib.closing(sqlite3.connect(self.path, timeout=60)) as probe:
                    self._init_schema(probe)
                return
            except sqlite3.DatabaseError:
                pass
            aside = Path(f"{self.path}.corrupt")
            os.replace(self.path, aside) if self.path.exists() else None
            for extra in self._files()[1:]:
                with contextlib.suppress(FileNotFoundError):
                    extra.unlink()
            warnings.warn(
                f"kernelplan plan cache {self.path} was unusable ({why}); it was moved to {aside} "
                f"and rebuilt empty, so tuned plans will be measured again",
                PlanCacheWarning,
                stacklevel=4,
            )
            log.warning("plan cache %s rebuilt: %s", self.path, why)


def _freeze(obj):
    if isinstance(obj, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_freeze(v) for v in obj)
    return obj


_DEFAULT: PlanCache | None = None


def plan_cache() -> PlanCache:
    """The process-wide cache at the default location (re-read if KERNELPLAN_CACHE_DIR changes)."""
    global _DEFAULT
    path = default_cache_dir() / "plans.sqlite"
    if _DEFAULT is None or _DEFAULT.path != path:
        _DEFAULT = PlanCache(path)
    return _DEFAULT
