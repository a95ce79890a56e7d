"""A run's own store: every run reads and writes only under ``<store.root>/<run.name>/``, stamped.

Two runs with different names never share an object: each component is handed a
:class:`RunStore`, a view of the configured store whose keys all live under the run's prefix
(``weights/``, ``rollouts/``, ``control/`` of that run alone). The prefix is stamped with the
run's identity (``<run.name>/RUN.json``: name, a random run id, creation time), and the run
directory keeps the same identity (``<run_dir>/run.json``), so a store is tied to the run that
made it, not only to its name:

- :func:`claim_run` (``shipyard train``, before any work): a new run stamps an empty prefix; the
  same run re-run (same name, same run directory) resumes; anything else is refused with a
  :class:`RunStoreError` that names the store, the run that owns it and the field to change
  (a prefix that holds another incarnation of the name, unstamped data, or a run directory whose
  store is elsewhere).
- :func:`open_run` (inference servers, rollout workers, ``shipyard serve``, ``relay``, ``eval``):
  attaches to an existing, stamped run; a missing run is an error listing the runs the store holds.
- :func:`read_identity` gives the identity a component stamps into what it writes (a rollout
  batch records its run and run id; the trainer rejects batches of any other run id).

Example::

    store = claim_run(StoreConfig(root="runs/store"), "try2", Path("runs/try2"))
    store.put("rollouts/w0/00000000.json.gz", data)   # -> runs/store/try2/rollouts/w0/...
    print(store.identity.run_id)

Limits: the stamp is checked when a component attaches, not on every request; two drivers that
claim the same new name at the same instant are not serialised (S3 has no conditional PUT here).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from shipyard.config.schema import RUN_NAME_PATTERN, StoreConfig
from shipyard.store.types import IOStats, Store

STAMP_KEY = "RUN.json"
"""The identity stamp, relative to a run's prefix."""
RUN_DIR_RECORD = "run.json"
"""The identity kept in the run directory (``<output_dir>/<name>/run.json``)."""
RUN_NAME = re.compile(RUN_NAME_PATTERN)


class RunStoreError(ValueError):
    """A store (or run directory) belongs to another run; the message says which and what to change."""


@dataclass(frozen=True)
class RunIdentity:
    name: str
    """``run.name``: the store prefix."""
    run_id: str
    """Random id made when the run was first claimed; a new run under an old name gets a new one."""
    created_at: float
    """When the run was claimed (seconds since the epoch)."""

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode() + b"\n"

    @staticmethod
    def from_bytes(data: bytes, where: str) -> RunIdentity:
        try:
            d = json.loads(data)
            return RunIdentity(
                name=str(d["name"]), run_id=str(d["run_id"]), created_at=float(d["created_at"])
            )
        except (ValueError, KeyError, TypeError) as e:
            raise RunStoreError(f"{where} is not a run stamp ({e}); it was not written by Shipyard") from None

    def describe(self) -> str:
        made = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created_at))
        return f"run {self.name!r} (id {self.run_id}, created {made})"


class RunStore:
    """The view of ``inner`` under ``<name>/``: the Store interface, keys relative to the run."""

    def __init__(self, inner: Store, name: str, identity: RunIdentity, where: str) -> None:
        self.inner = inner
        self.prefix = f"{name}/"
        self.identity = identity
        self.where = where
        """Human-readable location (``local store runs/store, run prefix try2/``) for messages."""

    @property
    def stats(self) -> IOStats:
        return self.inner.stats

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(self.prefix + key, data)

    def get(self, key: str) -> bytes:
        return self.inner.get(self.prefix + key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(self.prefix + key, start, end)

    def size(self, key: str) -> int:
        return self.inner.size(self.prefix + key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(self.prefix + key)

    def list(self, prefix: str) -> list[str]:
        n = len(self.prefix)
        return [k[n:] for k in self.inner.list(self.prefix + prefix)]

    def delete(self, key: str) -> None:
        self.inner.delete(self.prefix + key)


def check_run_name(name: str) -> str:
    """``name`` if it can be a store prefix and a directory name; else ValueError naming ``run.name``."""
    if not RUN_NAME.match(name):
        raise ValueError(
            f"run.name={name!r} must be one path component of letters, digits, '.', '_' or '-' "
            "(not starting with '.' or '-'), e.g. run.name=try2"
        )
    return name


def describe_store(cfg: StoreConfig) -> str:
    return f"{cfg.type} store {cfg.root!r}" + (f" at {cfg.endpoint_url}" if cfg.endpoint_url else "")


def list_runs(store: Store) -> list[str]:
    """Names of the stamped runs in ``store`` (a store root, not a run view)."""
    return sorted(
        k[: -len(STAMP_KEY) - 1] for k in store.list("") if k.count("/") == 1 and k.endswith(STAMP_KEY)
    )


def read_identity(store: Store) -> RunIdentity:
    """The stamp of a run view (:class:`RunStore`, or a store whose root is one run's prefix)."""
    where = getattr(store, "where", "this store")
    if not store.exists(STAMP_KEY):
        raise RunStoreError(
            f"{where} has no {STAMP_KEY}: it is not a run's store (start it with `shipyard train`)"
        )
    return RunIdentity.from_bytes(store.get(STAMP_KEY), f"{where}{STAMP_KEY}")


def stamp_new_run(store: Store, name: str, where: str = "store") -> RunStore:
    """Stamp an empty prefix ``<name>/`` of ``store`` with a fresh identity (tests and :func:`claim_run`)."""
    check_run_name(name)
    identity = RunIdentity(name=name, run_id=uuid.uuid4().hex[:16], created_at=time.time())
    view = RunStore(store, name, identity, f"{where}, run prefix {name}/")
    view.put(STAMP_KEY, identity.to_bytes())
    return view


def _open_root(cfg: StoreConfig) -> Store:
    from shipyard.store import open_store

    return open_store(cfg)


def run_exists(cfg: StoreConfig, name: str) -> bool:
    """Does the store ``cfg`` hold a stamped run ``name``? (Reads only; a run not yet trained has none.)"""
    check_run_name(name)
    return _open_root(cfg).exists(f"{name}/{STAMP_KEY}")


def open_run(cfg: StoreConfig, name: str) -> RunStore:
    """Attach to the existing run ``name`` in the store ``cfg`` (servers, workers, serve, relay, eval)."""
    check_run_name(name)
    return _attach(_open_root(cfg), cfg, name)


def _attach(root: Store, cfg: StoreConfig, name: str) -> RunStore:
    """The view of the stamped run ``name`` in ``root`` (the store ``cfg`` opened)."""
    where = f"{describe_store(cfg)}, run prefix {name}/"
    if not root.exists(f"{name}/{STAMP_KEY}"):
        runs = list_runs(root)
        raise RunStoreError(
            f"{describe_store(cfg)} holds no run named {name!r} (runs there: {runs or 'none'}); "
            "set run.name to one of them, or store.root to the store the run uses"
        )
    identity = RunIdentity.from_bytes(root.get(f"{name}/{STAMP_KEY}"), f"{where}{STAMP_KEY}")
    if identity.name != name:
        raise RunStoreError(
            f"{where}{STAMP_KEY} names run {identity.name!r}, not {name!r}; it was copied by hand"
        )
    return RunStore(root, name, identity, where)


def claim_run(cfg: StoreConfig, name: str, run_dir: Path) -> RunStore:
    """The store of the run ``name`` whose outputs are in ``run_dir``: new, or the same run resumed.

    Refuses (:class:`RunStoreError`, before any work) a prefix that another incarnation of the
    name stamped, a prefix with unstamped data, and a run directory whose run's store is not here.
    """
    check_run_name(name)
    root = _open_root(cfg)
    store_desc = describe_store(cfg)
    record = run_dir / RUN_DIR_RECORD
    mine = RunIdentity.from_bytes(record.read_bytes(), str(record)) if record.is_file() else None
    stamped = root.exists(f"{name}/{STAMP_KEY}")
    if not stamped:
        if root.list(f"{name}/"):
            raise RunStoreError(
                f"{store_desc} already holds data under {name}/ that no run stamp claims (an older Shipyard "
                f"or a copy by hand); training run {name!r} there would mix with it. Choose another run.name, "
                "or move that data away"
            )
        if mine is not None:
            raise RunStoreError(
                f"run directory {run_dir} belongs to {mine.describe()}, whose store is not in {store_desc} "
                f"(no {name}/{STAMP_KEY}); set store.root to the store that run used, or remove {run_dir} "
                "to start a new run of that name"
            )
        view = stamp_new_run(root, name, store_desc)
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = record.with_suffix(".tmp")
        tmp.write_bytes(view.identity.to_bytes())
        tmp.replace(record)
        return view
    view = _attach(root, cfg, name)
    if mine is None or mine.run_id != view.identity.run_id:
        here = "has no record of it" if mine is None else f"belongs to {mine.describe()}"
        raise RunStoreError(
            f"{store_desc} already holds {view.identity.describe()} under {name}/, and this run's directory "
            f"{run_dir} {here}: it is another run's data. Choose a new run.name for a new run (or set "
            f"store.root to another store); to start {name!r} over, delete {name}/ from the store and {run_dir}"
        )
    return view


def mirror_run(cfg: StoreConfig, identity: RunIdentity) -> RunStore:
    """The view of run ``identity`` in a region's mirror store ``cfg`` (``shipyard relay``): stamped
    with the origin's identity on first use; refused when it holds another run's data."""
    root = _open_root(cfg)
    name, store_desc = identity.name, describe_store(cfg)
    view = RunStore(root, name, identity, f"{store_desc}, run prefix {name}/")
    if not view.exists(STAMP_KEY):
        if view.list(""):
            raise RunStoreError(
                f"mirror {store_desc} holds data under {name}/ that no run stamp claims; set "
                "relay.mirror.root to another store, or move that data away"
            )
        view.put(STAMP_KEY, identity.to_bytes())
        return view
    theirs = RunIdentity.from_bytes(view.get(STAMP_KEY), f"{view.where}{STAMP_KEY}")
    if theirs.run_id != identity.run_id:
        raise RunStoreError(
            f"mirror {store_desc} holds {theirs.describe()} under {name}/, not the origin's {identity.describe()}; "
            f"set relay.mirror.root to another store, or delete {name}/ from the mirror"
        )
    return view
