"""Where studies live: the ONE place a ``--storage`` argument is interpreted.

:func:`parse_storage` turns the argument into a :class:`StorageSpec` (no side effects);
:func:`open_storage` opens it as an Optuna storage:

* ``None`` or ``""`` -- a SQLite file :data:`DEFAULT_DB_NAME` in the given folder;
* a path ending in ``.db``, ``.sqlite`` or ``.sqlite3`` -- that SQLite file;
* a path ending in ``.log``, ``.journal`` or ``.jsonl`` -- an Optuna journal file
  (:class:`optuna.storages.journal.JournalStorage` over a
  :class:`~optuna.storages.journal.JournalFileBackend`; no database, works on NFS; a
  worker killed while appending leaves its lock file, which the next writer breaks after
  the lock's 30 s grace period, and a trial it was running stays RUNNING: not counted,
  never resumed);
* a URL (``sqlite:///...``, ``postgresql://...``, ``mysql://...``, with an optional
  ``+driver``) -- an :class:`optuna.storages.RDBStorage`: many workers on many machines
  join one study through it.

Anything else is a ``ValueError``. RDB storages (SQLite included) run a heartbeat, so a
trial whose worker was killed is marked failed after :data:`GRACE_PERIOD_S`; SQLite waits
up to :data:`SQLITE_TIMEOUT_S` for a lock held by another worker, and workers that create
a new database at once are retried past Optuna's schema set-up race.
"""

from __future__ import annotations

import logging
import os
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalStorage

__all__ = [
    "DEFAULT_DB_NAME",
    "GRACE_PERIOD_S",
    "HEARTBEAT_INTERVAL_S",
    "JOURNAL_SUFFIXES",
    "RDB_SCHEMES",
    "SQLITE_SUFFIXES",
    "SQLITE_TIMEOUT_S",
    "StorageSpec",
    "open_storage",
    "parse_storage",
]

logger = logging.getLogger(__name__)

#: The SQLite file used when no storage is given.
DEFAULT_DB_NAME = "fasttree-tune.db"
#: File suffixes of a SQLite database.
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
#: File suffixes of an Optuna journal file.
JOURNAL_SUFFIXES = (".log", ".journal", ".jsonl")
#: URL schemes (before any ``+driver``) of the databases Optuna's RDB storage takes.
RDB_SCHEMES = ("sqlite", "postgresql", "mysql")
#: Seconds between a running trial's heartbeats (RDB storages).
HEARTBEAT_INTERVAL_S = 60
#: Seconds without a heartbeat after which a running trial is marked failed.
GRACE_PERIOD_S = 180
#: Seconds a SQLite connection waits for another worker's lock.
SQLITE_TIMEOUT_S = 60.0
#: Attempts to open a database, and the base of the back-off between them (seconds).
_OPEN_ATTEMPTS = 5
_OPEN_BACKOFF_S = 0.2


@dataclass(frozen=True)
class StorageSpec:
    """A parsed storage argument.

    Attributes
    ----------
    kind : str
        ``"sqlite"`` (a SQLite file or ``sqlite://`` URL), ``"journal"`` (a journal file)
        or ``"rdb"`` (a PostgreSQL or MySQL URL).
    target : str
        The SQLAlchemy URL (``sqlite`` and ``rdb``) or the journal file's absolute path.
    """

    kind: str
    target: str

    def describe(self) -> str:
        """The target without any password, for logs."""
        if self.kind == "journal":
            return f"journal file {self.target}"
        from sqlalchemy.engine import make_url

        try:
            return make_url(self.target).render_as_string(hide_password=True)
        except Exception:  # an unparsable URL: show only its scheme
            return self.target.split("://", 1)[0] + "://..."


def _sqlite_url(path: Path) -> str:
    return "sqlite:///" + str(path.expanduser().resolve())


def parse_storage(storage: str | os.PathLike | None, *, folder: str | os.PathLike = ".") -> StorageSpec:
    """Interpret a storage argument (see the module docstring).

    Parameters
    ----------
    storage : str, PathLike or None
        The argument.
    folder : str or PathLike
        Where the default SQLite file goes when ``storage`` is None or empty.

    Returns
    -------
    StorageSpec

    Raises
    ------
    ValueError
        On anything that is neither empty, a SQLite or journal file path, nor a URL of
        :data:`RDB_SCHEMES`.
    """
    if storage is None or (isinstance(storage, str) and not storage.strip()):
        return StorageSpec("sqlite", _sqlite_url(Path(folder) / DEFAULT_DB_NAME))
    if isinstance(storage, os.PathLike):
        storage = os.fspath(storage)
    if not isinstance(storage, str):
        raise ValueError(f"a storage must be a path, a URL or None, got {type(storage).__name__}")
    text = storage.strip()
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        if scheme.split("+", 1)[0] not in RDB_SCHEMES:
            raise ValueError(
                f"storage URL scheme {scheme!r} is not supported; use one of {list(RDB_SCHEMES)} "
                f"(e.g. postgresql://user@host/db), or a {'/'.join(SQLITE_SUFFIXES)} or "
                f"{'/'.join(JOURNAL_SUFFIXES)} file"
            )
        kind = "sqlite" if scheme.startswith("sqlite") else "rdb"
        return StorageSpec(kind, text)
    path = Path(text)
    suffix = path.suffix.lower()
    if suffix in SQLITE_SUFFIXES:
        return StorageSpec("sqlite", _sqlite_url(path))
    if suffix in JOURNAL_SUFFIXES:
        return StorageSpec("journal", str(path.expanduser().resolve()))
    raise ValueError(
        f"cannot tell what storage {storage!r} is: give a SQLite file ({', '.join(SQLITE_SUFFIXES)}), "
        f"a journal file ({', '.join(JOURNAL_SUFFIXES)}) or a database URL ({', '.join(RDB_SCHEMES)}://...)"
    )


def _sqlite_file(url: str) -> Path | None:
    """The file of a ``sqlite:///path`` URL (None for in-memory ones)."""
    rest = url.split("://", 1)[1]
    if not rest.startswith("/") or rest in ("/", "/:memory:"):
        return None
    return Path(rest[1:].split("?", 1)[0])


def open_storage(
    storage: str | os.PathLike | StorageSpec | BaseStorage | None,
    *,
    folder: str | os.PathLike = ".",
    heartbeat: bool = True,
) -> BaseStorage:
    """Open a storage argument (or an already opened Optuna storage, returned as is).

    Parameters
    ----------
    storage : str, PathLike, StorageSpec, optuna.storages.BaseStorage or None
        See :func:`parse_storage`.
    folder : str or PathLike
        Folder of the default SQLite file.
    heartbeat : bool
        Give RDB storages a heartbeat (:data:`HEARTBEAT_INTERVAL_S`), so trials of killed
        workers are marked failed after :data:`GRACE_PERIOD_S`.

    Returns
    -------
    optuna.storages.BaseStorage

    Raises
    ------
    ValueError
        On an argument :func:`parse_storage` refuses.
    """
    if isinstance(storage, BaseStorage):
        return storage
    spec = storage if isinstance(storage, StorageSpec) else parse_storage(storage, folder=folder)
    logger.info("study storage: %s", spec.describe())
    if spec.kind == "journal":
        path = Path(spec.target)
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    if spec.kind not in ("sqlite", "rdb"):
        raise ValueError(f"unknown storage kind {spec.kind!r}")
    engine_kwargs: dict[str, Any] = {}
    if spec.kind == "sqlite":
        file = _sqlite_file(spec.target)
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
        engine_kwargs["connect_args"] = {"timeout": SQLITE_TIMEOUT_S}
    else:
        engine_kwargs["pool_pre_ping"] = True
    beat: dict[str, Any] = {}
    if heartbeat:
        beat = {"heartbeat_interval": HEARTBEAT_INTERVAL_S, "grace_period": GRACE_PERIOD_S}
    return _open_rdb(spec, engine_kwargs, beat)


def _open_rdb(spec: StorageSpec, engine_kwargs: dict[str, Any], beat: dict[str, Any]) -> RDBStorage:
    """``RDBStorage``, retried: workers that open a new database at once race to create its
    tables (Optuna's schema set-up is not atomic: the losers get an ``IntegrityError``)."""
    from sqlalchemy.exc import SQLAlchemyError

    for attempt in range(1, _OPEN_ATTEMPTS + 1):
        try:
            with warnings.catch_warnings():  # the heartbeat is marked experimental
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return RDBStorage(spec.target, engine_kwargs=dict(engine_kwargs), **beat)
        except ImportError as exc:  # a database driver that is not installed
            cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
            raise ValueError(
                f"cannot open {spec.describe()}: {exc}{cause}; install the driver, or name an installed one "
                "in the URL (e.g. postgresql+psycopg2://...)"
            ) from exc
        except (SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
            if attempt == _OPEN_ATTEMPTS:
                raise ValueError(f"cannot open {spec.describe()}: {exc}") from exc
            logger.debug("opening %s failed (%s); retrying", spec.describe(), exc)
            time.sleep(_OPEN_BACKOFF_S * attempt * (1.0 + random.random()))
    raise AssertionError("unreachable")  # pragma: no cover
