"""``localdiff chat --list`` with a history whose ``updated`` time was edited to a value no clock shows (1e300
overflowed time_t: ``error: internal error: OverflowError``; or text): the entry is listed with its date "unknown", and the
database is left as it was."""

from __future__ import annotations

import sqlite3

import pytest
from cli_fixtures import clear_user_settings

from localdiff.cli import main
from localdiff.tui.store import ChatStore


@pytest.mark.parametrize("bad", [1e300, -1e300, "yesterday"])
def test_chat_list_shows_an_unreadable_date_as_unknown(bad, tmp_path, monkeypatch, capsys):
    clear_user_settings(tmp_path, monkeypatch)
    monkeypatch.setenv("LOCALDIFF_DATA_DIR", str(tmp_path / "data"))
    store = ChatStore()
    good = store.new_conversation("tiny")
    store.add_turn(good, "user", "a fine question", model="tiny")
    edited = store.new_conversation("tiny")
    store.add_turn(edited, "user", "the edited one", model="tiny")
    with sqlite3.connect(store.path) as con:
        con.execute("UPDATE conversations SET updated = ? WHERE id = ?", (bad, edited))
    con.close()
    before = store.path.read_bytes()
    assert main(["chat", "--list"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert rows[str(edited)].split()[1] == "unknown" and "the edited one" in rows[str(edited)]
    assert rows[str(good)].split()[1][:2] == "20" and "a fine question" in rows[str(good)]
    assert store.path.read_bytes() == before  # nothing rewritten
