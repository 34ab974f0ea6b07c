"""`localdiff chat` (issue 6): history store, /set, run_chat guards, canvas frames, and Pilot tests that drive the
real engine on the embedded `tiny` model (no fakes)."""
from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

import pytest
import torch

import localdiff
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
    assert conv.messages() == [{"role": "user", "content": "first  question\nwith two lines"},
                               {"role": "assistant", "content": "answer"}]
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
    assert s.stream_kwargs() == {"max_new_tokens": 64, "seed": 1, "max_denoising_steps": 8, "threshold": 0.9,
                                 "entropy_bound": 0.3}
    assert "max_denoising_steps=8*" in apply_set(s, "", {"max_denoising_steps": 48, "t_min": 0.4})
    assert apply_set(s, "seed none") == "seed = none" and s.seed is None
    assert apply_set(s, "steps default") == "max_denoising_steps = model default"
    assert "max_denoising_steps" not in s.sampler
    for args, msg in [("steps 0", "outside"), ("steps 2.5", "whole number"), ("threshold 1.5", "outside"),
                      ("threshold abc", "expected a number"), ("bogus 1", "unknown setting"),
                      ("steps", "usage"), ("correction maybe", "on/off"), ("entropy_bound nan", "finite")]:
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
    assert run_chat(resume="last", db_path=str(db), sampler_options={"max_new_tokens": 64, "seed": 5,
                                                                      "entropy_bound": 0.2}) == 0
    app = started[-1]
    assert app.conversation_id == cid and app.model_name == "some-model"
    assert (app.settings.max_new_tokens, app.settings.seed, app.settings.sampler) == (64, 5, {"entropy_bound": 0.2})
    assert run_chat("tiny", resume=str(old), db_path=str(db)) == 0
    assert started[-1].conversation_id == old and started[-1].model_name == "tiny"
    assert run_chat(resume="999", db_path=str(db)) == 2
    assert "no saved conversation with id 999" in capsys.readouterr().err
    assert len(started) == 2


# ---------------------------------------------------------------------------------------------- frames
def _step(step, accepted, reopened=None, conf=None):
    c = len(accepted)
    acc = torch.tensor([accepted])
    return StepEvent(0, step, 4, torch.arange(c)[None], torch.arange(c)[None], acc, ~acc,
                     torch.tensor([reopened or [False] * c]), torch.tensor([conf or [0.5] * c]), torch.zeros(1, c))


def test_frame_states_tell_locked_new_noisy_and_reopened_apart():
    names = TokenText(None)
    f1 = frame_from_step(_step(1, [True, False, False, True]), names, None)
    assert f1.states == [NEW, NOISY, NOISY, NEW] and f1.tokens == ["<0>", "<1>", "<2>", "<3>"]
    f2 = frame_from_step(_step(2, [True, True, False, False], [False, False, False, False], [0.9, 0.8, 0.1, 0.2]),
                         names, [True, False, False, True])
    assert f2.states == [LOCKED, NEW, NOISY, REOPENED] and f2.confidence == pytest.approx([0.9, 0.8, 0.1, 0.2])
    f3 = frame_from_step(_step(3, [True, True, False, False], [True, False, False, False]), names,
                         [True, True, False, False])
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
            view.show(CanvasFrame(0, 5, 16, ["He", "llo", " x", "q"], [LOCKED, NEW, NOISY, REOPENED],
                                  [0.9, 0.8, 0.1, 0.3]))
            await pilot.pause()
            assert view.border_title == "canvas 1 · step 5/16"
            assert view.border_subtitle == "locked 2/4 · new 1 · noisy 1 · reopened 1"
            text = view.render()
            assert text.plain.splitlines() == ["Hello xq", "█▇▁▃"]
            styles = {text.plain[sp.start:sp.end]: sp.style for sp in text.spans}
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


# ---------------------------------------------------------------------------------------------- Pilot, real engine
@pytest.fixture(scope="module")
def tiny():
    return localdiff.load("tiny", device="cpu")


async def wait_for(pilot, cond, timeout=60.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)


def make_app(model, tmp_path, **kw):
    kw.setdefault("settings", ChatSettings(seed=kw.pop("seed", 0)))
    return ChatApp("tiny", store=ChatStore(tmp_path / "h.sqlite3"), loader=lambda name, **_: model, **kw)


async def send(pilot, app, text):
    await wait_for(pilot, lambda: app.model is not None and not app.generating)
    done = app.finished_count
    await pilot.press(*text)
    assert app.prompt.text == text
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.finished_count > done)
    assert not app.generating and app.prompt.text == ""
    return app.last_finish


def test_token_cells_keep_leading_spaces_and_show_control_tokens(tiny):
    tok = tiny.tokenizer
    names = TokenText(tok)
    ids = tok.encode("What is 12 + 34?\nok")
    cells = [names(i) for i in ids]
    assert "".join(cells).lstrip() == "What is 12 + 34?↵ok"  # (a first-token leading space is the tokenizer's)
    assert " is" in cells and "".join(cells).count(" ") >= 4
    assert all(names(i) == "∎" for i in tok.eos_token_ids)


def test_two_turns_are_answered_saved_and_reuse_the_cache(tiny, tmp_path):
    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            first = await send(pilot, app, PROMPT)
            assert first.error is None and first.finish_reason in ("eos", "length") and first.text.strip()
            shown = app.transcript.messages
            assert [m.role for m in shown] == ["user", "assistant"] and shown[1].text == first.text
            conv = app.store.load(app.conversation_id)
            assert conv.messages() == [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.text}]
            assert conv.turns[1].stats["forwards"] == first.stats.forwards > 0
            cache = app.cache
            second = await send(pilot, app, "What is 5 + 7?")
            assert second.error is None and app.cache is cache
            assert second.stats.prefill_tokens_reused > 0  # turn 2 prefill reused turn 1's prefix
            assert len(app.store.load(app.conversation_id).turns) == 4
            assert "TPF" in app.status.line() and app.status.tpf == pytest.approx(second.stats.tokens_per_forward)
            assert app.canvas.frames_drawn >= 1
    asyncio.run(go())


def test_escape_stops_within_one_step_and_the_next_prompt_works(tiny, tmp_path, monkeypatch):
    forwards = {"n": 0}
    real_denoise = tiny.net.denoise

    def counting_denoise(*a, **k):
        forwards["n"] += 1
        return real_denoise(*a, **k)

    monkeypatch.setattr(tiny.net, "denoise", counting_denoise)
    paused, release = threading.Event(), threading.Event()
    seen = {"steps": 0, "at_pause": None}

    def hook(ev):
        seen["steps"] += 1
        if seen["at_pause"] is None:
            seen["at_pause"] = forwards["n"]
            paused.set()
            release.wait(30)

    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            app.step_hook = hook
            await pilot.press(*PROMPT, "enter")
            await wait_for(pilot, paused.is_set)  # the engine is mid-canvas (first denoising step done)
            await wait_for(pilot, lambda: app.canvas.frame is not None)
            await pilot.press("escape")
            assert app.cancel_event.is_set()
            release.set()
            await wait_for(pilot, lambda: not app.generating)
            fin = app.last_finish
            assert fin.finish_reason == "cancelled" and fin.steps_after_cancel <= 1
            assert app.canvas.border_title == "canvas 1 · stopped at step 1 (dropped)"
            assert forwards["n"] - seen["at_pause"] <= 1  # at most one more decoder forward after Esc
            assert seen["steps"] == 1
            # nothing was final yet: the question left the context and the history
            assert app.messages == [] and app.store.list_conversations() == []
            app.step_hook = None
            nxt = await send(pilot, app, "What is 3 + 4?")
            assert nxt.finish_reason in ("eos", "length") and nxt.text
            assert app.store.load(app.conversation_id).messages()[-1] == {"role": "assistant", "content": nxt.text}
    asyncio.run(go())


def test_history_survives_a_restart(tiny, tmp_path):
    async def first_run():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            fin = await send(pilot, app, PROMPT)
            await pilot.press("ctrl+q")
        assert app.return_code == 0
        return app.conversation_id, fin.text

    cid, answer = asyncio.run(first_run())
    store = ChatStore(tmp_path / "h.sqlite3")
    assert store.latest_id() == cid
    store.add_turn(cid, "user", "What is 5 + 7?", model="tiny")  # as after a crash mid-answer

    async def second_run():
        app = make_app(tiny, tmp_path, conversation_id=cid)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            assert [(m.role, m.text) for m in app.transcript.messages] == [
                ("user", PROMPT), ("assistant", answer), ("user", "What is 5 + 7?")]
            assert app.messages[1] == {"role": "assistant", "content": answer}
            assert "no saved answer" in str(app.transcript.query(".note").last().render())
            fin = await send(pilot, app, "/regen")
            assert fin.error is None and fin.finish_reason in ("eos", "length")  # (tiny's later turns may be empty)
            turns = app.store.load(cid).turns
            assert [t.role for t in turns] == ["user", "assistant", "user", "assistant"]
            assert turns[-1].content == fin.text == app.transcript.messages[-1].text
    asyncio.run(second_run())


def test_set_in_the_prompt_changes_the_next_generation(tiny, tmp_path):
    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            await pilot.press(*"/set steps 2", "enter")
            await pilot.press(*"/set threshold 5", "enter")  # rejected, one-line error
            await pilot.press(*"/set t_min 0.9", "enter")  # the engine's own check: t_max (0.8) < t_min
            await pilot.pause()
            assert app.settings.sampler == {"max_denoising_steps": 2}
            notes = [str(w.render()) for w in app.transcript.query(".note")]
            assert notes[0] == "max_denoising_steps = 2" and "outside" in notes[1]
            assert "temperature max (0.8) must be ≥ min (0.9)" in notes[2]
            assert app.store.list_conversations() == []  # settings are not turns
            fin = await send(pilot, app, PROMPT)
            assert fin.stats.forwards <= 2 * fin.stats.canvases
    asyncio.run(go())


def test_palette_new_chat_regenerate_and_theme(tiny, tmp_path):
    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await send(pilot, app, PROMPT)
            cid, old_cache = app.conversation_id, app.cache
            await pilot.press("ctrl+p")
            await pilot.press(*"Regenerate last")
            await pilot.press("enter")
            await wait_for(pilot, lambda: not app.generating and app.last_finish is not None
                           and len(app.transcript.messages) == 2 and app.transcript.messages[1].text)
            conv = app.store.load(cid)
            assert [t.role for t in conv.turns] == ["user", "assistant"]
            assert conv.turns[1].content == app.transcript.messages[1].text
            await pilot.press("ctrl+p")
            await pilot.press(*"New chat")
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.conversation_id is None)
            assert app.transcript.messages == [] and app.messages == [] and app.cache is not old_cache
            assert len(app.store.load(cid).turns) == 2  # the old conversation stays saved
            dark = app.current_theme.dark
            await pilot.press("ctrl+t")
            assert app.current_theme.dark is (not dark)
    asyncio.run(go())


def test_a_model_that_fails_to_load_shows_the_error_and_exits_non_zero(tmp_path):
    async def go():
        app = ChatApp("no-such-model-xyz", store=ChatStore(tmp_path / "h.sqlite3"))
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.load_error is not None)
            assert "no-such-model-xyz" in app.load_error
            notes = [str(w.render()) for w in app.transcript.query(".error")]
            assert any("could not load no-such-model-xyz" in n for n in notes)
            assert "failed to load" in app.status.line()
            await pilot.press("a", "ctrl+j", "b", "alt+enter", "c")
            assert app.prompt.text == "a\nb\nc"
            await pilot.press("enter")  # no endless spinner: a clear note instead
            await pilot.pause()
            assert not app.generating and app.prompt.text == "a\nb\nc"
            assert "no model" in str(app.transcript.query(".note").last().render())
            await pilot.press("ctrl+q")
        assert app.return_code == 1
    asyncio.run(go())


def test_switch_model_offers_only_loadable_models(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from localdiff.tui.commands import available_models

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    assert available_models() == ["tiny"]  # nothing pulled: the embedded model only
    monkeypatch.setattr("localdiff.hub.list_models", lambda *a, **k: [{"name": "tiny"}, {"name": "org/big@v2"}])
    assert available_models() == ["tiny", "org/big@v2"]


def test_palette_switch_model_keeps_the_conversation_and_reports_failures(tiny, tmp_path):
    from localdiff.errors import ModelNotFoundError

    loads = []

    def loader(name, **_):
        loads.append(name)
        if name == "broken":
            raise ModelNotFoundError("model 'broken' not found")
        return tiny

    async def pick(pilot, app, label):
        await pilot.press("ctrl+p")
        await pilot.press(*label)
        await pilot.pause(0.3)
        await pilot.press("enter")

    async def go():
        app = ChatApp("tiny", store=ChatStore(tmp_path / "h.sqlite3"), loader=loader, settings=ChatSettings(seed=0))
        app.model_choices = lambda: ["tiny", "broken"]
        async with app.run_test(size=(80, 24)) as pilot:
            await send(pilot, app, PROMPT)
            cache = app.cache
            await pick(pilot, app, "Switch model: broken")
            await wait_for(pilot, lambda: app.load_error is not None)
            assert app.model is tiny and app.cache is cache and len(app.messages) == 2
            assert any("could not load broken" in str(w.render()) for w in app.transcript.query(".error"))
            await pick(pilot, app, "Switch model: tiny")
            await wait_for(pilot, lambda: app.load_error is None and app.cache is not cache)
            assert loads == ["tiny", "broken", "tiny"] and len(app.messages) == 2
            assert app.status.line().startswith("ready │ tiny")
            await pilot.press("ctrl+q")
        assert app.return_code == 0
    asyncio.run(go())


def test_a_history_write_failure_is_reported_and_the_chat_goes_on(tiny, tmp_path):
    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            real_add = app.store.add_turn

            def failing_add(cid, role, content, **kw):
                if role == "assistant":
                    raise HistoryError("chat history h.sqlite3: database or disk is full")
                return real_add(cid, role, content, **kw)

            app.store.add_turn = failing_add
            fin = await send(pilot, app, PROMPT)
            assert fin.error is None and app.messages[-1] == {"role": "assistant", "content": fin.text}
            assert "answer not saved: chat history h.sqlite3: database or disk is full" in str(
                app.transcript.query(".error").last().render())
            app.store.add_turn = real_add
            await send(pilot, app, "/regen")  # the unsaved answer is replaced; nothing to delete on disk
            assert [t.role for t in app.store.load(app.conversation_id).turns] == ["user", "assistant"]
    asyncio.run(go())
