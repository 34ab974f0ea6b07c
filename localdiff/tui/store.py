"""Chat history in SQLite: one row per conversation, one row per finished turn.

The database lives at ``<data dir>/chat.sqlite3`` where the data dir is ``$LOCALDIFF_DATA_DIR`` when set, else
``platformdirs.user_data_dir("localdiff")``. Every call opens its own short connection and commits before returning,
so each turn is on disk as soon as it is written (a crash loses at most the answer in flight).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from localdiff.errors import LocaldiffError
from localdiff.safetext import visible

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    created REAL NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    finish_reason TEXT NOT NULL DEFAULT '',
    stats TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS turns_by_conversation ON turns(conversation_id, id);
"""


class HistoryError(LocaldiffError):
    """The chat history database cannot be opened or has no such conversation."""


def default_db_path() -> Path:
    """Path of the history database: ``$LOCALDIFF_DATA_DIR/chat.sqlite3`` or the platformdirs user data dir."""
    env = os.environ.get("LOCALDIFF_DATA_DIR")
    if env:
        return Path(env).expanduser() / "chat.sqlite3"
    import platformdirs

    return Path(platformdirs.user_data_dir("localdiff")) / "chat.sqlite3"


def _why(exc: OSError, folder: Path) -> str:
    """The reason a folder for the history could not be made, in words (no "[Errno N]")."""
    if isinstance(exc, (FileExistsError, NotADirectoryError)):
        there = folder
        while not there.exists() and there != there.parent:
            there = there.parent
        if there.exists() and not there.is_dir():
            return f"{there} is not a folder (set LOCALDIFF_DATA_DIR to a folder)"
    return exc.strerror or str(exc)


@dataclass
class Turn:
    """One finished message. ``role`` is "user" or "assistant"; ``stats`` is GenerationStats.as_dict() or {}."""

    id: int
    role: str
    content: str
    created: float
    model: str = ""
    finish_reason: str = ""
    stats: dict = field(default_factory=dict)


@dataclass
class Conversation:
    """A saved conversation; ``turns`` is filled by ``ChatStore.load`` only (``n_turns`` always)."""

    id: int
    title: str
    model: str
    created: float
    updated: float
    n_turns: int = 0
    turns: list[Turn] = field(default_factory=list)

    def messages(self) -> list[dict]:
        """The turns as chat messages ``[{"role", "content"}, ...]`` (the engine's chat prompt format)."""
        return [{"role": t.role, "content": t.content} for t in self.turns]


class ChatStore:
    """SQLite-backed conversation history.

    Args:
        path: database file; None → ``default_db_path()``. Parent folders are created.

    Raises:
        HistoryError: the file cannot be created or is not a SQLite database.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._connect() as con:
                con.executescript(_SCHEMA)
        except OSError as exc:  # e.g. LOCALDIFF_DATA_DIR=/dev/full: "[Errno 17] File exists" from mkdir
            raise HistoryError(f"cannot open chat history {self.path}: {_why(exc, self.path.parent)}") from None
        except sqlite3.Error as exc:
            raise HistoryError(f"cannot open chat history {self.path}: {exc}") from None

    @contextmanager
    def _connect(self):
        try:
            with closing(sqlite3.connect(self.path, timeout=10)) as con:
                con.execute("PRAGMA foreign_keys = ON")
                with con:  # commit on success, roll back on error
                    yield con
        except sqlite3.Error as exc:  # locked, disk full, read-only, corrupt: one clear line
            raise HistoryError(f"chat history {self.path}: {exc}") from None

    def new_conversation(self, model: str, title: str = "") -> int:
        """Create an empty conversation and return its id."""
        now = time.time()
        with self._connect() as con:
            cur = con.execute(
                "INSERT INTO conversations (title, model, created, updated) VALUES (?, ?, ?, ?)",
                (title[:200], model, now, now),
            )
            return int(cur.lastrowid)

    def add_turn(
        self,
        conversation_id: int,
        role: str,
        content: str,
        *,
        model: str = "",
        finish_reason: str = "",
        stats: dict | None = None,
    ) -> int:
        """Append a finished turn (committed before returning); sets the title from the first user turn.

        Raises:
            HistoryError: unknown conversation id, a role other than "user" / "assistant", or a database error.
        """
        if role not in ("user", "assistant"):
            raise HistoryError(f"turn role must be 'user' or 'assistant', got {role!r}")
        now = time.time()
        with self._connect() as con:
            row = con.execute("SELECT title FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
            if row is None:
                raise HistoryError(f"no conversation with id {conversation_id}")
            cur = con.execute(
                "INSERT INTO turns (conversation_id, role, content, created, model, finish_reason, stats)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, now, model, finish_reason, json.dumps(stats or {}, default=str)),
            )
            title = row[0] or (" ".join(content.split())[:60] if role == "user" else "")
            con.execute(
                "UPDATE conversations SET updated = ?, title = ?, model = CASE WHEN ? = '' THEN model ELSE ? END"
                " WHERE id = ?",
                (now, title, model, model, conversation_id),
            )
            return int(cur.lastrowid)

    def delete_turn(self, turn_id: int | None) -> None:
        """Remove one turn (used by "regenerate last answer"); None (a turn that was never saved) is a no-op."""
        if turn_id is None:
            return
        with self._connect() as con:
            con.execute("DELETE FROM turns WHERE id = ?", (turn_id,))

    def clear_turns(self, conversation_id: int) -> None:
        """Remove all turns of a conversation (the conversation row stays)."""
        with self._connect() as con:
            con.execute("DELETE FROM turns WHERE conversation_id = ?", (conversation_id,))
            con.execute("UPDATE conversations SET title = '', updated = ? WHERE id = ?", (time.time(), conversation_id))

    def recent_prompts(self, limit: int = 500) -> list[str]:
        """The user's last ``limit`` prompts over all conversations, oldest first, consecutive repeats once (the
        prompt box's Up/Down history)."""
        with self._connect() as con:
            rows = con.execute(
                "SELECT content FROM turns WHERE role = 'user' ORDER BY id DESC LIMIT ?", (int(limit),)
            ).fetchall()
        out: list[str] = []
        for (content,) in reversed(rows):
            if not out or out[-1] != content:
                out.append(content)
        return out

    def list_conversations(self, limit: int | None = None) -> list[Conversation]:
        """Conversations with at least one turn, most recently updated first."""
        sql = (
            "SELECT c.id, c.title, c.model, c.created, c.updated, COUNT(t.id) FROM conversations c"
            " JOIN turns t ON t.conversation_id = c.id GROUP BY c.id ORDER BY c.updated DESC, c.id DESC"
        )
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._connect() as con:
            return [Conversation(*row[:5], n_turns=row[5]) for row in con.execute(sql)]

    def latest_id(self) -> int | None:
        """Id of the most recently updated conversation that has turns, or None."""
        convs = self.list_conversations(limit=1)
        return convs[0].id if convs else None

    def load(self, conversation_id: int) -> Conversation:
        """A conversation with its turns in order.

        Raises:
            HistoryError: no conversation with that id.
        """
        with self._connect() as con:
            row = con.execute(
                "SELECT id, title, model, created, updated FROM conversations WHERE id = ?", (conversation_id,)
            ).fetchone()
            if row is None:
                raise HistoryError(f"no saved conversation with id {conversation_id} (see `localdiff chat --list`)")
            turns = [
                Turn(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6] or "{}"))
                for r in con.execute(
                    "SELECT id, role, content, created, model, finish_reason, stats FROM turns"
                    " WHERE conversation_id = ? ORDER BY id",
                    (conversation_id,),
                )
            ]
        return Conversation(*row, n_turns=len(turns), turns=turns)

    def resolve(self, resume: str | int | bool | None) -> int | None:
        """Map a ``--resume`` value to a conversation id: True/""/"last"/"latest" → latest, "7"/7 → 7, None/False → None.

        Raises:
            HistoryError: nothing saved yet, a non-numeric id, or an unknown id.
        """
        if resume is None or resume is False:
            return None
        if resume is True or (isinstance(resume, str) and resume.strip().lower() in ("", "last", "latest")):
            cid = self.latest_id()
            if cid is None:
                raise HistoryError("no saved conversations to resume yet")
            return cid
        try:
            cid = int(str(resume).strip().lstrip("#"))
        except ValueError:
            raise HistoryError(
                f"conversation id must be a number, got {resume!r} (see `localdiff chat --list`)"
            ) from None
        self.load(cid)  # raises if unknown
        return cid


def _stamp(updated) -> str:
    """``updated`` (seconds since the epoch, as stored) as local ``YYYY-MM-DD HH:MM``; "unknown" for a value no
    clock can show (an edited database: 1e300 overflowed time_t with an internal error, NaN, text), left as stored."""
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(updated))
    except (TypeError, ValueError, OverflowError, OSError):
        return "unknown"


def format_listing(convs: list[Conversation]) -> str:
    """The ``localdiff chat --list`` table: id, last update (local time), turns, model, title."""
    if not convs:
        return "no saved conversations"
    width = max(5, *(len(c.model) for c in convs))  # full model names: the column is as wide as the longest
    lines = [f"{'ID':>4}  {'UPDATED':16}  {'TURNS':>8}  {'MODEL':{width}}  TITLE"]
    for c in convs:
        stamp = _stamp(c.updated)
        turns = f"{c.n_turns} turn" + ("" if c.n_turns == 1 else "s")
        lines.append(f"{c.id:>4}  {stamp:16}  {turns:>8}  {visible(c.model):{width}}  {visible(c.title[:60])}".rstrip())
    return "\n".join(lines)
