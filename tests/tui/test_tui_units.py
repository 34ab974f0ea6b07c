"""Chat (TUI) unit tests: history store, /set, run_chat guards, canvas frames."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
import torch

from localdiff.errors import UsageError
from localdiff.events import StepEvent
from localdiff.tui import run_chat
from localdiff.tui.app import ChatApp
from localdiff.tui.runner import LOCKED, NEW, NOISY, REOPENED, CanvasFrame, FrameSlot, TokenText, frame_from_step
from localdiff.tui.settings import ChatSettings, apply_set
from localdiff.tui.store import ChatStore, HistoryError, format_listing

PROMPT = "What is 12 + 34?"


# ---------------------------------------------------------------------------------------------- store
def test_store_round_trip_and_listing(tmp_path):
    store = ChatStore(tmp_path / "h.sqlite3")
    assert store.latest_id() is None and format_listing(store.list_conversations()) == "no saved conversations"
    a = store.new_conversation("tiny")
    store.add_turn(a, "user", "first  question\nwith two lines", model="tiny")
    store.add_turn(a, "assistant", "answer", model="tiny", finish_reason="eos", stats={"forwards": 3})
    b = store.new_conversation("tiny")
    store.add_turn(b, "user", "later", model="tiny")
    empty = store.new_conversation("tiny")  # no turns: never listed
    # a second handle (as after a crash / restart) sees every committed turn
    other = ChatStore(tmp_path / "h.sqlite3")
    convs = other.list_conversations()
    assert [c.id for c in convs] == [b, a] and empty not in [c.id for c in convs]
    conv = other.load(a)
    assert conv.title == "first question with two lines"
    assert conv.messages() == [
        {"role": "user", "content": "first  question\nwith two lines"},
        {"role": "assistant", "content": "answer"},
    ]
    assert conv.turns[1].stats == {"forwards": 3} and conv.turns[1].finish_reason == "eos"
    assert other.resolve(True) == b and other.resolve("last") == b and other.resolve(str(a)) == a
    assert other.resolve(None) is None
    listing = format_listing(convs).splitlines()
    assert listing[0].split() == ["ID", "UPDATED", "TURNS", "MODEL", "TITLE"]
    assert listing[2].split()[0] == str(a) and listing[2].split()[3] == "2"
    with pytest.raises(HistoryError, match="no saved conversation with id 999"):
        other.resolve("999")
    with pytest.raises(HistoryError, match="must be a number"):
        other.resolve("abc")
    with pytest.raises(HistoryError, match="role"):
        other.add_turn(a, "system", "x")


def test_store_default_path_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALDIFF_DATA_DIR", str(tmp_path / "data"))
    store = ChatStore()
    assert store.path == tmp_path / "data" / "chat.sqlite3" and store.path.is_file()
    with sqlite3.connect(store.path) as con:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"conversations", "turns"} <= tables


def test_store_rejects_a_file_that_is_not_sqlite(tmp_path):
    bad = tmp_path / "x.sqlite3"
    bad.write_text("not a database " * 100)
    with pytest.raises(HistoryError, match="chat history .*x.sqlite3: file is not a database"):
        ChatStore(bad)


# ---------------------------------------------------------------------------------------------- /set
def test_set_commands_change_settings_and_reject_bad_values():
    s = ChatSettings()
    assert apply_set(s, "steps 8") == "max_denoising_steps = 8"
    assert apply_set(s, "threshold 0.9") == "threshold = 0.9"
    assert apply_set(s, "entropy_bound 0.3") == "entropy_bound = 0.3"
    assert apply_set(s, "seed 1") == "seed = 1"
    assert apply_set(s, "max_tokens 64") == "max_new_tokens = 64"
    assert s.stream_kwargs() == {
        "max_new_tokens": 64,
        "seed": 1,
        "max_denoising_steps": 8,
        "threshold": 0.9,
        "entropy_bound": 0.3,
    }
    assert "max_denoising_steps=8*" in apply_set(s, "", {"max_denoising_steps": 48, "t_min": 0.4})
    assert apply_set(s, "seed none") == "seed = none" and s.seed is None
    assert apply_set(s, "steps default") == "max_denoising_steps = model default"
    assert "max_denoising_steps" not in s.sampler
    for args, msg in [
        ("steps 0", r"^/set steps: must be an integer in \[1, "),
        ("steps 2.5", r"^/set steps: must be an integer"),
        ("threshold 1.5", r"^/set threshold: must be a number in \(0, 1\]"),
        ("threshold abc", r"^/set threshold: must be a number"),
        ("bogus 1", "unknown setting"),
        ("steps", "usage"),
        ("correction maybe", r"^/set correction: must be on or off"),
        ("entropy_bound nan", r"^/set entropy_bound: must be a number > 0"),
    ]:
        with pytest.raises(UsageError, match=msg):
            apply_set(s, args)
    assert s.sampler == {"threshold": 0.9, "entropy_bound": 0.3}


# ---------------------------------------------------------------------------------------------- run_chat guards
def test_run_chat_refuses_without_a_terminal(tmp_path, capsys):
    rc = run_chat(db_path=str(tmp_path / "h.sqlite3"))  # pytest captures stdout: not a terminal
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "localdiff gen" in err


def test_run_chat_list_and_bad_resume(tmp_path, capsys):
    db = tmp_path / "h.sqlite3"
    assert run_chat(list_only=True, db_path=str(db)) == 0
    assert capsys.readouterr().out.strip() == "no saved conversations"
    store = ChatStore(db)
    cid = store.new_conversation("tiny")
    store.add_turn(cid, "user", "hello there", model="tiny")
    assert run_chat(list_only=True, db_path=str(db)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[0] == str(cid) and out[1].endswith("hello there")


def test_run_chat_resumes_the_latest_conversation_on_its_model(tmp_path, monkeypatch, capsys):
    db = tmp_path / "h.sqlite3"
    store = ChatStore(db)
    old = store.new_conversation("tiny")
    store.add_turn(old, "user", "old", model="tiny")
    cid = store.new_conversation("some-model")
    store.add_turn(cid, "user", "newer", model="some-model")
    started = []

    def fake_run(self):  # record what the app was built with instead of taking over the terminal
        started.append(self)
        self._return_code = 0

    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr(ChatApp, "run", fake_run)
    loads = []  # the first model loads before the UI starts: the resumed conversation's model

    def loader(name, device=None, quant=None):
        loads.append(name)
        return object()

    assert (
        run_chat(
            resume="last",
            db_path=str(db),
            sampler_options={"max_new_tokens": 64, "seed": 5, "entropy_bound": 0.2},
            loader=loader,
        )
        == 0
    )
    app = started[-1]
    assert app.conversation_id == cid and app.model_name == "some-model"
    assert (app.settings.max_new_tokens, app.settings.seed, app.settings.sampler) == (64, 5, {"entropy_bound": 0.2})
    assert run_chat("tiny", resume=str(old), db_path=str(db), loader=loader) == 0
    assert started[-1].conversation_id == old and started[-1].model_name == "tiny"
    assert loads == ["some-model", "tiny"]
    assert run_chat(resume="999", db_path=str(db)) == 2
    assert "no saved conversation with id 999" in capsys.readouterr().err
    assert len(started) == 2


# ---------------------------------------------------------------------------------------------- frames
def _step(step, accepted, reopened=None, conf=None):
    c = len(accepted)
    acc = torch.tensor([accepted])
    return StepEvent(
        0,
        step,
        4,
        torch.arange(c)[None],
        torch.arange(c)[None],
        acc,
        ~acc,
        torch.tensor([reopened or [False] * c]),
        torch.tensor([conf or [0.5] * c]),
        torch.zeros(1, c),
    )


def test_frame_states_tell_locked_new_noisy_and_reopened_apart():
    names = TokenText(None)
    f1 = frame_from_step(_step(1, [True, False, False, True]), names, None)
    assert f1.states == [NEW, NOISY, NOISY, NEW] and f1.tokens == ["<0>", "<1>", "<2>", "<3>"]
    f2 = frame_from_step(
        _step(2, [True, True, False, False], [False, False, False, False], [0.9, 0.8, 0.1, 0.2]),
        names,
        [True, False, False, True],
    )
    assert f2.states == [LOCKED, NEW, NOISY, REOPENED] and f2.confidence == pytest.approx([0.9, 0.8, 0.1, 0.2])
    f3 = frame_from_step(
        _step(3, [True, True, False, False], [True, False, False, False]), names, [True, True, False, False]
    )
    assert f3.states[0] == REOPENED and f3.count(LOCKED) == 1


def test_frame_slot_keeps_only_the_newest_frame():
    slot = FrameSlot()
    frames = [CanvasFrame(0, i, 9, ["a"], [NOISY], [0.1]) for i in range(1, 4)]
    assert slot.put(frames[0]) is True  # UI must be told
    assert slot.put(frames[1]) is False and slot.put(frames[2]) is False  # a notification is already pending
    assert slot.take() is frames[2] and slot.dropped == 2
    assert slot.take() is None and slot.put(frames[0]) is True


def test_canvas_view_tells_states_apart_by_style_and_fits_long_canvases():
    from textual.app import App

    from localdiff.tui.widgets import CanvasView

    class Host(App):
        def compose(self):
            yield CanvasView()

    async def go():
        app = Host()
        async with app.run_test(size=(80, 24)) as pilot:
            view = app.query_one(CanvasView)
            view.show(
                CanvasFrame(0, 5, 16, ["He", "llo", " x", "q"], [LOCKED, NEW, NOISY, REOPENED], [0.9, 0.8, 0.1, 0.3])
            )
            await pilot.pause()
            assert view.border_title == "canvas 1 · step 5/16"
            assert view.border_subtitle == "locked 2/4 · new 1 · noisy 1 · reopened 1"
            text = view.render()
            assert text.plain.splitlines() == ["Hello xq", "█▇▁▃"]
            styles = {text.plain[sp.start : sp.end]: sp.style for sp in text.spans}
            assert styles["He"].bold and not styles["He"].underline  # locked
            assert styles["llo"].bold and styles["llo"].underline  # just locked
            assert styles[" x"].dim and styles[" x"].italic  # still noise
            assert styles["q"].strike  # reopened
            assert styles["He"].bgcolor != styles[" x"].bgcolor  # confidence shade
            # 256 positions of 4-character tokens do not fit as text: one cell per position
            view.show(CanvasFrame(1, 1, 8, ["abcd"] * 256, [NOISY] * 256, [0.5] * 256))
            await pilot.pause()
            lines = view.render().plain.split("\n")
            assert lines[0] == "a" * 256 and len(lines[1]) == 128  # sparkline: pairs of positions averaged
            assert view.region.height <= 10

    asyncio.run(go())
