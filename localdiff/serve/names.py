"""The models a ``localdiff serve`` answers for, by name (README: "Model names").

A request's ``"model"`` is looked up here and nowhere else: it is never read as a path on the server's disk. The
names offered are those ``localdiff list`` shows (embedded and fully pulled models, DFlash drafts left out: they do
not run alone) and the models of the server's own command line (``serve -m NAME_OR_PATH``, repeatable; the default
model of the operator's config too). A folder or a ``.gguf`` file is offered only when given there, under the name
that ``localdiff.load`` reports for it (a folder: the path with ``~`` expanded) or as written on the command line.

Every other name — a path, ``~``, ``..``, a percent-encoded spelling, a catalog model not pulled — gets the same
404 (:func:`not_offered`), whose text depends neither on the name nor on what exists on the server's disk: the
lookup reads no file for it (the pulled models are listed again, at most every ``rescan_after`` seconds, only when
a name is not among those already known, so a model pulled while the server runs is offered too).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from localdiff.serve.errors import ApiError

NOT_OFFERED = "unknown model: this server answers only for the models that GET /v1/models lists (Ollama: GET /api/tags)"


def not_offered() -> ApiError:
    """The one 404 of a model name the server does not offer (the same bytes for every such name)."""
    return ApiError(404, NOT_OFFERED, type="not_found_error", param="model", code="model_not_found")


def canonical(name: str) -> str:
    """A command-line model's name as ``localdiff.load`` labels it: a folder as its path with ``~`` expanded
    (``str(Path(name).expanduser())``), anything else (a catalog alias, a ``.gguf`` file) as written."""
    p = Path(name).expanduser()
    return str(p) if p.is_dir() else name


def _installed() -> list[dict]:
    from localdiff.engine import installed_models

    return installed_models()


class ModelNames:
    """The names a server offers and the model each one loads.

    Args:
        command_line: the server's ``-m`` models (names or paths, as the operator wrote them), first = preloaded.
        default: the model for requests that name none (the operator's config; offered too). "" = the first of
            ``command_line``.
        installed: ``() -> list[dict]`` rows as ``localdiff.engine.installed_models`` (``name``, ``draft``, ...);
            default: that function.
        rescan_after: seconds between two listings of the installed models (only on a name not known yet).
    """

    def __init__(self, command_line=(), default: str = "", installed=None, rescan_after: float = 2.0) -> None:
        self._own: dict[str, str] = {}  # request name → canonical name (the loader's argument)
        self._order: list[str] = []  # canonical names of the command line's models, in order
        for name in [*command_line, default]:
            if not name:
                continue
            canon = canonical(name)
            self._own.setdefault(name, canon)
            self._own.setdefault(canon, canon)
            if canon not in self._order:
                self._order.append(canon)
        self.default = canonical(default) if default else (self._order[0] if self._order else "")
        self._list = installed or _installed
        self.rescan_after = rescan_after
        self._rows: dict[str, dict] = {}
        self._scanned = float("-inf")
        self._lock = threading.Lock()

    def lookup(self, name: str) -> str | None:
        """The canonical name that ``name`` loads ("" stays "": the resident or default model), or None when it is
        not known yet (:meth:`resolve` lists the installed models again). Reads no file."""
        if not name:
            return ""
        own = self._own.get(name)
        if own is not None:
            return own
        return name if name in self._rows else None

    def resolve(self, name: str) -> str:
        """:meth:`lookup`, listing the installed models again first when the name is not known (at most every
        ``rescan_after`` seconds; may read the model cache, so call it off the event loop).

        Raises:
            ApiError: 404 :func:`not_offered` for a name the server does not offer.
        """
        got = self.lookup(name)
        if got is None:
            self.rescan()
            got = self.lookup(name)
        if got is None:
            raise not_offered()
        return got

    def rescan(self, force: bool = False) -> None:
        """List the installed models again (not more often than every ``rescan_after`` s unless ``force``)."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._scanned < self.rescan_after:
                return
            self._scanned = now
            rows = {}
            for row in self._list():
                name = str(row.get("name") or "")
                if name and not row.get("draft") and name not in rows:
                    rows[name] = row
            self._rows = rows

    def rows(self) -> list[dict]:
        """Every offered model as an ``installed_models`` row (the command line's first, then the installed ones):
        for ``/v1/models`` and ``/api/tags``. Lists the installed models again."""
        self.rescan(force=True)
        installed = dict(self._rows)
        out = []
        for canon in self._order:
            row = installed.pop(canon, None)
            out.append(row if row is not None else _path_row(canon))
        return out + list(installed.values())

    def names(self) -> list[str]:
        """The offered names, in :meth:`rows` order."""
        return [str(r["name"]) for r in self.rows()]


def _path_row(name: str) -> dict:
    """An ``installed_models``-like row for a command-line model that ``localdiff list`` does not show (a folder,
    a ``.gguf`` file): its size on disk (0 when it cannot be read)."""
    p = Path(name).expanduser()
    try:
        size = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    except OSError:
        size = 0
    return {"name": name, "path": str(p) if p.exists() else None, "size_bytes": size, "embedded": False}
