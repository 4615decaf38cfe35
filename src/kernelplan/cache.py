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
* A corrupt or truncated file ("malformed", "not a database", a failing
  ``quick_check``) is copied aside with a warning and rebuilt by an atomic
  replace, under a lock file: once across processes.  Nothing else rebuilds a
  file: a healthy file that other processes write to is never moved.
* A computation never fails because of the cache.  A cache that cannot be
  opened or written (a read-only or missing directory, a path that is a file
  or a directory, a full disk, a schema from a newer kernelplan) gives one
  ``PlanCacheWarning`` naming the path and the fix, and the process goes on
  with an in-memory cache.  A read-only but valid file is still read.  A row
  that does not parse counts as missing, with a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
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
    """The plan cache was unusable, rebuilt or read only: results are measured again or kept in memory."""


# SQLite's words for a damaged file; anything else (permissions, a full disk, locks) is not damage.
_DAMAGE = ("malformed", "not a database", "quick_check reported")


class _NewerSchema(sqlite3.DatabaseError):
    """The file's schema is newer than this kernelplan's: not damage, and not ours to rebuild."""


def warn(message: str, stacklevel: int = 5) -> None:
    """A PlanCacheWarning and a log line; never an exception (``-W error`` must not fail a computation)."""
    log.warning("%s", message)
    try:
        warnings.warn(message, PlanCacheWarning, stacklevel=stacklevel)
    except Exception:  # noqa: BLE001  warnings turned into errors: the log line stands
        pass


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
        fp["driver"] = driver_version()
    return fp


@functools.lru_cache(maxsize=1)
def driver_version() -> str:
    """The CUDA driver's version (``cuDriverGetVersion``); the runtime's view without cuda-bindings; "none"
    where no driver is installed (a CPU machine compiling with NVRTC)."""
    try:
        from cuda.bindings import driver  # ships with the GPU machines' cuda-bindings
    except ImportError:  # older stacks: the NVML-free fallback is the runtime's view
        import torch

        return f"runtime-{torch.version.cuda}"
    try:
        err, version = driver.cuDriverGetVersion()
    except Exception:  # noqa: BLE001  no libcuda on this machine
        return "none"
    return str(version) if int(err) == 0 else "none"


class PlanCache:
    """A process-safe, bounded key -> JSON store with an in-process front layer."""

    def __init__(self, path: str | os.PathLike | None = None, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.path = Path(path) if path is not None else default_cache_dir() / "plans.sqlite"
        self.max_entries = int(max_entries)
        self._memory: dict[str, Any] = {}
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self.disk_reads = 0  # counts queries that went to SQLite, for tests and `cache info`
        self.unusable: str | None = None  # why this process keeps its results in memory only
        self.read_only = False  # a valid file this process may read but not write
        self._said: set = set()

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
        try:
            value = json.loads(row) if row is not None else None
        except (TypeError, ValueError) as exc:
            self._warn_once(f"kernelplan plan cache {self.path}: the row for {op} does not parse ({exc}); it "
                            f"counts as missing and is measured again (`kernelplan cache clear` drops all rows)")
            value = None
        if value is not None:
            self._memory[mem_key] = value
        return value

    def put(self, op: str, problem: dict, value: Any, device: str | None = None) -> None:
        key = self.make_key(op, problem, device or problem.get("device", "cpu"))
        self._with_db(self._write, key, op, json.dumps(value, sort_keys=True))
        self._memory[(op, _freeze(problem), device)] = value

    def info(self) -> dict[str, Any]:
        entries = self._with_db(lambda conn: conn.execute("SELECT COUNT(*) FROM plans").fetchone()[0], default=0)
        size = 0
        for p in self._files():
            with contextlib.suppress(OSError):
                size += p.stat().st_size if p.is_file() else 0
        return {"path": str(self.path), "entries": entries, "size_bytes": size, "max_entries": self.max_entries,
                "read_only": self.read_only, "unusable": self.unusable, "in_memory": len(self._memory)}

    def clear(self) -> int:
        """Delete every entry; return how many there were."""

        def clear(conn):
            with conn:
                n = conn.execute("DELETE FROM plans").rowcount
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            return n

        n = self._with_db(clear, default=0)
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
            if row is not None and not self.read_only:
                conn.execute("UPDATE plans SET last_used = ? WHERE key = ?", (time.time(), key))
        return row[0] if row else None

    def _write(self, conn: sqlite3.Connection, key: str, op: str, value: str) -> None:
        if self.read_only:
            self._warn_once(f"kernelplan plan cache {self.path} is read-only: it is read, and new measurements "
                            f"are kept in this process's memory; point KERNELPLAN_CACHE_DIR at a writable "
                            f"directory to keep them")
            return
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

    def _with_db(self, fn, *args, default=None):
        """``fn(connection, *args)``; on any failure of the file, ``default`` and a warning, never an exception."""
        with self._lock:
            if self.unusable is not None:
                return default
            for attempt in (0, 1):
                try:
                    return fn(self._connection(), *args)
                except (sqlite3.Error, OSError) as exc:
                    if isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc)):
                        self._warn_once(f"kernelplan plan cache {self.path} stayed locked by another process for "
                                        f"60 s ({exc}); this lookup or store was skipped")
                        return default
                    if not attempt and _is_damage(exc):
                        try:
                            self._rebuild(f"{type(exc).__name__}: {exc}")
                            continue
                        except (sqlite3.Error, OSError) as again:
                            exc = again
                    self._give_up(exc)
                    return default
            return default

    def _give_up(self, exc: BaseException) -> None:
        """Keep this process's results in memory from now on, and say why once."""
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None
        self.unusable = f"{type(exc).__name__}: {exc}"
        fix = ("it was written by a newer kernelplan: upgrade, or point KERNELPLAN_CACHE_DIR elsewhere"
               if isinstance(exc, _NewerSchema) else
               "point KERNELPLAN_CACHE_DIR at a writable directory (or free disk space)")
        self._warn_once(f"kernelplan plan cache {self.path} cannot be used ({self.unusable}); results are kept in "
                        f"this process's memory only: {fix}")

    def _warn_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            warn(message)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = self._open()
        return self._conn

    def _open(self) -> sqlite3.Connection:
        """A connection to the file: read-write where the file and its directory allow it, else read-only."""
        parent = self.path.parent
        if not parent.exists():
            parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(parent, os.W_OK) and (not self.path.exists() or os.access(self.path, os.W_OK))
        if not writable and self.path.is_file():
            return self._open_read_only()
        conn = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
        try:
            self._init_schema(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _open_read_only(self) -> sqlite3.Connection:
        """Read a valid file where nothing may be written: as immutable, since WAL's shared memory cannot be made."""
        conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?immutable=1", uri=True, timeout=60,
                               isolation_level=None, check_same_thread=False)
        try:
            _check(conn)
            conn.execute("SELECT COUNT(*) FROM plans").fetchone()
        except BaseException:
            conn.close()
            raise
        self.read_only = True
        return conn

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA busy_timeout = 60000")
        _check(conn)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
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
        """Copy the damaged file aside and replace it with an empty one, atomically, once across processes."""
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None
        with open(f"{self.path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                # Another process may have rebuilt it while we waited for the lock.
                with contextlib.closing(sqlite3.connect(self.path, timeout=60)) as probe:
                    _check(probe)
                return
            except sqlite3.Error as exc:
                if not _is_damage(exc):
                    raise
            aside = Path(f"{self.path}.corrupt")
            fresh = Path(f"{self.path}.rebuild-{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                shutil.copyfile(self.path, aside)
            with contextlib.closing(sqlite3.connect(fresh)) as conn:
                self._init_schema(conn)
            for extra in self._files()[1:]:  # the damaged file's journal must not replay into the new one
                with contextlib.suppress(FileNotFoundError):
                    extra.unlink()
            os.replace(fresh, self.path)
            self._warn_once(f"kernelplan plan cache {self.path} was damaged ({why}); a copy is at {aside} and the "
                            f"file was rebuilt empty, so tuned plans will be measured again")


def _check(conn: sqlite3.Connection) -> None:
    """Raise where the file is damaged (``quick_check``) or from a newer schema."""
    check = conn.execute("PRAGMA quick_check").fetchone()[0]
    if check != "ok":
        raise sqlite3.DatabaseError(f"quick_check reported: {check}")
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise _NewerSchema(f"schema version {version}, newer than this kernelplan's {SCHEMA_VERSION}")
    if version < 0:
        raise sqlite3.DatabaseError(f"quick_check reported: schema version {version}")


def _is_damage(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, _NewerSchema) and \
        any(word in str(exc) for word in _DAMAGE)


def _freeze(obj):
    if isinstance(obj, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_freeze(v) for v in obj)
    return obj


_AT_DEFAULT: dict = {}  # class -> (path, the instance there)


def at_default(cls, name: str):
    """The process-wide ``cls(default_cache_dir() / name)``, made again if KERNELPLAN_CACHE_DIR changed."""
    path = default_cache_dir() / name
    hit = _AT_DEFAULT.get(cls)
    if hit is None or hit[0] != path:
        hit = _AT_DEFAULT[cls] = (path, cls(path))
    return hit[1]


def plan_cache() -> PlanCache:
    """The process-wide cache at the default location (re-read if KERNELPLAN_CACHE_DIR changes)."""
    return at_default(PlanCache, "plans.sqlite")
