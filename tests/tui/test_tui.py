"""Chat (TUI) Pilot tests driving the real engine on the embedded model."""

from __future__ import annotations

import asyncio
import threading

import pytest
from tuihelpers import make_app, send, wait_for

from localdiff.tui.app import ChatApp
from localdiff.tui.runner import TokenText
from localdiff.tui.settings import ChatSettings
from localdiff.tui.store import ChatStore, HistoryError

PROMPT = "What is 12 + 34?"


# ---------------------------------------------------------------------------------------------- Pilot, real engine


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
            assert conv.messages() == [
                {"role": "user", "content": PROMPT},
                {"role": "assistant", "content": first.text},
            ]
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
            # nothing was final yet: the question left the context, the history and the screen (#23 item 7);
            # its text is back in the prompt box to edit or resend
            assert app.messages == [] and app.store.list_conversations() == []
            assert app.transcript.messages == [] and app.prompt.text == PROMPT
            assert "the message is back in the prompt box" in str(app.transcript.query(".note").last().render())
            app.step_hook = None
            app.prompt.clear()
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
                ("user", PROMPT),
                ("assistant", answer),
                ("user", "What is 5 + 7?"),
            ]
            assert app.messages[1] == {"role": "assistant", "content": answer}
            assert any("no saved answer" in str(n.render()) for n in app.transcript.query(".note"))
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
            notes = [str(w.render()) for w in app.transcript.query(".note")][1:]  # after the start-up line
            assert notes[0] == "max_denoising_steps = 2"
            assert notes[1] == "/set threshold: must be a number in (0, 1] (got '5')"
            assert notes[2] == "/set t_min: must be ≤ t_max (0.8) (got 0.9)"  # names the key the user typed
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
            await wait_for(
                pilot,
                lambda: (
                    not app.generating
                    and app.last_finish is not None
                    and len(app.transcript.messages) == 2
                    and app.transcript.messages[1].text
                ),
            )
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

    from localdiff.hub.catalog import entries

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    embedded = [e.alias for e in entries() if e.embedded]
    assert "tiny" in embedded
    assert available_models() == embedded  # nothing pulled: the embedded models only
    monkeypatch.setattr("localdiff.hub.models.list_models", lambda *a, **k: [{"name": "tiny"}, {"name": "org/big@v2"}])
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
            await wait_for(
                pilot, lambda: any("could not load broken" in str(w.render()) for w in app.transcript.query(".error"))
            )
            assert app.model is tiny and app.cache is cache and len(app.messages) == 2
            assert app.load_error is None  # tiny still answers: quitting now is not a failure
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
                app.transcript.query(".error").last().render()
            )
            app.store.add_turn = real_add
            await send(pilot, app, "/regen")  # the unsaved answer is replaced; nothing to delete on disk
            assert [t.role for t in app.store.load(app.conversation_id).turns] == ["user", "assistant"]

    asyncio.run(go())
