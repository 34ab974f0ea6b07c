"""Pilot tests for issue #23: the habits of `ollama run`, oterm and elia users, on the embedded model (real engine).
Each test names the issue's item number it covers."""

from __future__ import annotations

import asyncio
import threading

import pytest
from tuihelpers import hold_first_step, make_app, send, wait_for
from textual import events

from localdiff.config import load_user_config
from localdiff.tui.app import ChatApp
from localdiff.tui.paste import PASTE_END, PASTE_START, guarded_parser_class, visible_controls
from localdiff.tui.settings import ChatSettings
from localdiff.tui.store import ChatStore, format_listing
from localdiff.tui.widgets.transcript import UserMessage

THREE = [
    ("What is 41 + 93?", "134"),
    ("Reverse the letters: d r a g o n", "n o g a r d"),
    ("Sort these words: elk cat gnu", "cat elk gnu"),
]


async def command(pilot, app, text):
    await pilot.press(*text, "enter")
    await pilot.pause()


def notes(app):
    return [str(w.render()) for w in app.transcript.query(".note")]


# ------------------------------------------------------------------------------------------------ 1, 6: the CLI
def test_cli_resume_keeps_the_conversation_model_and_seed_reaches_the_chat(tmp_path, monkeypatch, capsys):
    """#23 items 1 and 6."""
    from localdiff.cli.dispatch import main

    monkeypatch.setenv("LOCALDIFF_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "config.toml"))
    (tmp_path / "config.toml").write_text('default_model = "tiny"\nmax_new_tokens = 64\ntheme = "textual-light"\n')
    store = ChatStore(tmp_path / "chat.sqlite3")
    cid = store.new_conversation("org/other-model")
    store.add_turn(cid, "user", "hi", model="org/other-model")
    started = []

    def fake_run(self):
        started.append(self)
        self._return_code = 0

    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr(ChatApp, "run", fake_run)
    assert main(["chat", "--resume", "--seed", "5"]) == 1  # the first model loads before the UI: not pulled
    assert capsys.readouterr().err == (
        f"error: cannot load 'org/other-model' (conversation #{cid}'s model; -m MODEL "
        "resumes it on another): org/other-model@main is not pulled: run `localdiff "
        "pull org/other-model`\n"
    )
    assert started == []
    loads = []
    monkeypatch.setattr("localdiff.tui.app._default_loader", lambda name, **kw: loads.append(name) or object())
    assert main(["chat", "--resume", "--seed", "5"]) == 0
    app = started[-1]
    assert app.conversation_id == cid and app.model_name == "org/other-model"  # not the default "tiny"
    assert app.settings.seed == 5 and app.settings.max_new_tokens == 64  # flag and config file both arrive
    assert app._start_theme == "textual-light" and str(app.config_file) == str(tmp_path / "config.toml")
    assert main(["chat", "--resume", "-m", "tiny"]) == 0  # an explicit -m still wins
    assert started[-1].model_name == "tiny" and started[-1].settings.seed is None
    assert main(["chat"]) == 0 and started[-1].model_name == "tiny" and started[-1].conversation_id is None
    assert loads == ["org/other-model", "tiny", "tiny"]


# ------------------------------------------------------------------------------------------------ 2: paste
def test_escape_sequences_inside_a_bracketed_paste_stay_text():
    """#23 item 2, the input parser: Textual alone turns the pasted ESC sequence's tail into keys (an Enter)."""
    from textual._xterm_parser import XTermParser

    data = "x" + PASTE_START + "a\x1b[31mred\x1b\rsent?" + PASTE_END + "y"

    def run(cls, step):
        parser, out = cls(), []
        for i in range(0, len(data), step):
            out += list(parser.feed(data[i : i + step]))
        return [(type(e).__name__, getattr(e, "key", None) or getattr(e, "text", None)) for e in out]

    assert ("Key", "enter") in run(XTermParser, len(data))  # the bug this guards against
    for step in (1, 2, 3, 7, len(data)):
        assert run(guarded_parser_class(), step) == [("Key", "x"), ("Paste", "a␛[31mred␛\rsent?"), ("Key", "y")]
    assert visible_controls("a␛\x07b\r\nc\x7f\x9b") == "a␛␇b\nc␡<U+009B>"  # the one sanitizer (localdiff.safetext)


def test_a_paste_is_inserted_as_visible_text_and_never_sends(tiny, tmp_path):
    """#23 item 2, the prompt box."""

    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            app.prompt.post_message(events.Paste("What is\x1b[2J 1 + 2?\x07\r\nsecond line\r"))
            await pilot.pause()
            assert app.prompt.text == "What is␛[2J 1 + 2?␇\nsecond line\n"
            assert app.transcript.messages == [] and not app.generating and app.store.list_conversations() == []

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ 3: small screens
@pytest.mark.parametrize("size", [(40, 10), (40, 12), (80, 24), (120, 40)])
def test_the_prompt_stays_visible_at_every_size(tiny, tmp_path, size):
    """#23 item 3: after an answer (canvas panel pinned) and while answering."""

    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=size) as pilot:
            await send(pilot, app, "What is 2 + 3?")
            for _ in range(3):
                await app.transcript.add_note("a long note " * 10)
            await pilot.pause()
            region = app.prompt.region
            assert region.height >= 3 and region.y >= 0 and region.bottom <= size[1]
            assert app.transcript.region.height >= 1
            hook, paused, release = hold_first_step(app)
            app.step_hook = hook
            await pilot.press(*"What is 4 + 4?", "enter")
            await wait_for(pilot, paused.is_set)
            await pilot.pause()
            assert app.prompt.region.bottom <= size[1] and app.prompt.region.height >= 3
            release.set()
            await wait_for(pilot, lambda: not app.generating)

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ 4: verbatim
def test_the_users_message_is_shown_verbatim(tiny, tmp_path):
    """#23 item 4: `# …` is not a heading, `*x*` not emphasis; line breaks are kept."""

    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            await pilot.press(*"# What is 1 + 2? *now*", "ctrl+j", *"[b]x[/b]", "enter")
            await wait_for(pilot, lambda: app.finished_count == 1)
            user = app.transcript.messages[0]
            assert isinstance(user, UserMessage)
            assert str(user.render()) == "# What is 1 + 2? *now*\n[b]x[/b]"

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ 5, 15
def test_single_turn_model_answers_every_turn_and_says_so_once(tiny, tmp_path):
    """#23 items 5 and 15: three turns of different task families, every answer non-empty and right."""

    async def go():
        app = make_app(tiny, tmp_path, seed=1)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            start = notes(app)
            assert len(start) == 1 and "What is 41 + 93?" in start[0] and "/help lists the commands" in start[0]
            assert "Single-turn model: each message starts fresh" in start[0]
            for prompt, want in THREE:
                fin = await send(pilot, app, prompt)
                assert fin.text.strip() and want in fin.text, (prompt, fin.text)
                assert fin.stats.prompt_tokens == len(tiny.encode_prompt(prompt)[0])  # only this message was sent
            assert [m["role"] for m in app.messages] == ["user", "assistant"] * 3  # the conversation keeps them all
            assert len(app.store.load(app.conversation_id).turns) == 6
            assert sum("Single-turn" in n for n in notes(app)) == 1

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ 8: quitting
def test_ctrl_c_stops_the_answer_then_quits(tiny, tmp_path):
    """#23 item 8: ctrl+c stops a running answer, the next prompt works, ctrl+c when idle quits."""

    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            hook, paused, release = hold_first_step(app)
            app.step_hook = hook
            await pilot.press(*"What is 12 + 34?", "enter")
            await wait_for(pilot, paused.is_set)
            await pilot.press("ctrl+c")
            await wait_for(pilot, lambda: not app.generating)
            assert app.last_finish.finish_reason == "cancelled" and app.is_running
            app.step_hook = None
            app.prompt.clear()
            fin = await send(pilot, app, "What is 27 + 58?")
            assert "85" in fin.text
            await pilot.press("ctrl+c")
            await pilot.pause()
        assert app.return_code == 0

    asyncio.run(go())


def test_a_second_ctrl_c_while_stopping_quits(tiny, tmp_path):
    """#23 item 8."""

    async def go():
        app = make_app(tiny, tmp_path)
        release = threading.Event()

        def hook(ev):  # ignores the cancel: the answer is still "stopping" when the second ctrl+c comes
            release.wait(10)

        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            app.step_hook = hook
            await pilot.press(*"What is 1 + 1?", "enter")
            await wait_for(pilot, lambda: app.generating)
            await pilot.press("ctrl+c")
            assert app.cancel_event.is_set() and app.is_running
            await pilot.press("ctrl+c")
            release.set()
            await pilot.pause()
        assert app.return_code == 0

    asyncio.run(go())


@pytest.mark.parametrize("how", ["ctrl+d", "/bye", "/exit", "/quit"])
def test_ctrl_d_on_an_empty_prompt_and_bye_exit_quit(tiny, tmp_path, how):
    """#23 item 8: ctrl+d quits only on an empty prompt (else it deletes, as in a shell)."""

    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            if how == "ctrl+d":
                await pilot.press("a", "b", "left", "ctrl+d")
                assert app.prompt.text == "a" and app.is_running
                await pilot.press("backspace", "ctrl+d")
            else:
                await pilot.press(*how, "enter")
            await pilot.pause()
        assert app.return_code == 0 and not app.is_running

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ 9: history
def test_up_and_down_recall_earlier_prompts_across_restarts(tiny, tmp_path):
    """#23 item 9."""
    store = ChatStore(tmp_path / "h.sqlite3")
    cid = store.new_conversation("tiny")
    for text in ("What is 1 + 2?", "Reverse the letters: a b c"):
        store.add_turn(cid, "user", text, model="tiny")
        store.add_turn(cid, "assistant", "x", model="tiny")

    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            await pilot.press("d", "r", "a", "f", "t", "up")
            assert app.prompt.text == "Reverse the letters: a b c"
            await pilot.press("up")
            assert app.prompt.text == "What is 1 + 2?"
            await pilot.press("up")  # the oldest stays
            assert app.prompt.text == "What is 1 + 2?"
            await pilot.press("down")
            assert app.prompt.text == "Reverse the letters: a b c"
            await pilot.press("down")  # past the newest: the draft comes back
            assert app.prompt.text == "draft"
            app.prompt.clear()
            await send(pilot, app, "What is 2 + 2?")
            await pilot.press("up")
            assert app.prompt.text == "What is 2 + 2?"

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ 10: scrolling
def test_page_keys_scroll_the_transcript_while_the_prompt_has_focus(tiny, tmp_path):
    """#23 item 10."""

    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            for i in range(40):
                await app.transcript.add_note(f"note {i}")
            await pilot.pause()
            bottom = app.transcript.scroll_y
            assert bottom > 0
            await pilot.press("pageup")
            await pilot.pause()
            assert app.transcript.scroll_y < bottom and app.focused is app.prompt
            await pilot.press("home")
            await pilot.pause()
            assert app.transcript.scroll_y == 0
            await pilot.press("pagedown")
            await pilot.pause()
            assert app.transcript.scroll_y > 0
            await pilot.press("end")
            await pilot.pause()
            assert app.transcript.scroll_y == bottom
            await pilot.press("a", "b", "home")  # with text, Home moves the cursor as in any editor
            await pilot.pause()
            assert app.prompt.cursor_location == (0, 0) and app.transcript.scroll_y == bottom

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ 11: figures
def test_live_figures_while_answering_and_stats_on_demand(tiny, tmp_path):
    """#23 item 11: elapsed, tokens so far, tok/s and TPF in the status line; /stats and /verbose."""

    async def go():
        app = make_app(tiny, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            hook, paused, release = hold_first_step(app)
            app.step_hook = hook
            await pilot.press(*"What is 41 + 93?", "enter")
            await wait_for(pilot, paused.is_set)
            await wait_for(pilot, lambda: app.status.live is not None and app.status.live[2] >= 1)
            await pilot.pause(0.6)  # the 0.25 s tick moves the elapsed time on (slow on a loaded machine)
            line = app.status.line()
            assert line.startswith("generating ") and " tok · " in line and " tok/s · TPF " in line
            assert app.status.live[0] > 0.2
            release.set()
            await wait_for(pilot, lambda: not app.generating)
            assert app.status.live is None and "TPF" in app.status.line()
            await command(pilot, app, "/stats")
            stats = notes(app)[-1]
            assert f"{app.last_stats.forwards} forwards" in stats and "tok/s" in stats and "prefill" in stats
            await command(pilot, app, "/verbose")
            assert notes(app)[-1].startswith("verbose on")
            app.step_hook = None
            fin = await send(pilot, app, "What is 1 + 2?")
            await pilot.pause()
            assert f"{fin.stats.forwards} forwards" in notes(app)[-1]

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ 12: copy
def test_copy_the_last_answer_with_a_key_and_slash_copy(tiny, tmp_path, monkeypatch):
    """#23 item 12."""

    async def go():
        app = make_app(tiny, tmp_path)
        copied = []
        app.copy_to_clipboard = copied.append
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            await pilot.press("f2")
            await pilot.pause()
            assert copied == [] and notes(app)[-1] == "no answer to copy yet"
            fin = await send(pilot, app, "What is 41 + 93?")
            monkeypatch.delenv("TMUX", raising=False)
            monkeypatch.delenv("TERM_PROGRAM", raising=False)
            await pilot.press("f2")
            await pilot.pause()
            assert copied == [fin.text] and "OSC 52" in notes(app)[-1]
            monkeypatch.setenv("TMUX", "/tmp/tmux-0/default,1,0")
            await command(pilot, app, "/copy")
            assert copied == [fin.text] * 2 and "set -g set-clipboard on" in notes(app)[-1]
            monkeypatch.setenv("TERM_PROGRAM", "Apple_Terminal")
            await command(pilot, app, "/copy")
            assert "does not support OSC 52" in notes(app)[-1]

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ 13: commands
def test_model_system_show_and_clear(tiny, tmp_path, monkeypatch):
    """#23 item 13: /model with Tab completion, /system, /show, /clear asks first."""
    loads, seen = [], []
    real_stream = tiny.stream

    def stream(prompt, **kw):
        seen.append(kw.get("system"))
        return real_stream(prompt, **kw)

    monkeypatch.setattr(tiny, "stream", stream)

    async def go():
        app = ChatApp(
            "tiny",
            store=ChatStore(tmp_path / "h.sqlite3"),
            settings=ChatSettings(seed=0),
            loader=lambda name, **_: loads.append(name) or tiny,
        )
        app.model_choices = lambda: ["tiny", "org/big"]
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            await pilot.press("/", "m", "o", "tab")
            assert app.prompt.text == "/model "
            await pilot.press("t", "tab")
            assert app.prompt.text == "/model tiny"
            await pilot.press("enter")
            await wait_for(pilot, lambda: loads == ["tiny", "tiny"] and app.model is not None)
            await pilot.press("/", "s", "tab")  # several: listed
            await pilot.pause()
            assert app.prompt.text == "/s" and "/set" in notes(app)[-1] and "/show" in notes(app)[-1]
            app.prompt.clear()
            await command(pilot, app, "/show")
            show = notes(app)[-1]
            assert show.startswith("tiny: Embedded tiny") and "M parameters" in show and "single-turn" in show
            await command(pilot, app, "/system Answer briefly.")
            assert app.settings.system == "Answer briefly."
            await send(pilot, app, "What is 2 + 2?")
            assert seen[-1] == "Answer briefly."
            await command(pilot, app, "/system off")
            await send(pilot, app, "What is 3 + 3?")
            assert seen[-1] is None
            cid = app.conversation_id
            await command(pilot, app, "/clear")  # asks
            assert len(app.store.load(cid).turns) == 4 and "/clear again confirms" in notes(app)[-1]
            await command(pilot, app, "/help")  # anything else keeps it
            await command(pilot, app, "/clear")
            assert len(app.transcript.messages) == 4
            await command(pilot, app, "/clear")
            assert app.store.load(cid).turns == [] and app.transcript.messages == [] and app.messages == []

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ 14: persistence
def test_set_values_and_the_theme_persist_in_the_config_file(tiny, tmp_path):
    """#23 item 14: saved to the config file (comments kept), read back at the next start."""
    cfg = tmp_path / "config.toml"
    cfg.write_text('# my settings\ndefault_model = "tiny"  # keep me\n')

    async def first():
        app = make_app(tiny, tmp_path, config_file=cfg)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            for text in ("/set steps 8", "/set eb 0.5", "/set seed 3", "/set max_tokens 64", "/set eb default"):
                await command(pilot, app, text)
            assert notes(app)[-1] == "entropy_bound = model default  (saved)"
            await command(pilot, app, "/set t_min 0.9")  # rejected: nothing saved, the typed key named
            assert notes(app)[-1].startswith("/set t_min:")
            await pilot.press("ctrl+t")
            await pilot.pause()
            return app.theme

    theme = asyncio.run(first())
    text = cfg.read_text()
    assert "# my settings" in text and "# keep me" in text
    loaded = load_user_config(env={}, path=cfg)
    assert dict(loaded.sampler) == {"max_denoising_steps": 8}
    assert (loaded.seed, loaded.max_new_tokens, loaded.theme) == (3, 64, theme)

    async def second():
        app = make_app(
            tiny,
            tmp_path,
            config_file=cfg,
            theme=loaded.theme,
            settings=ChatSettings(seed=loaded.seed, sampler=dict(loaded.sampler)),
        )
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            assert app.theme == theme
            await command(pilot, app, "/set steps default")
            await command(pilot, app, "/set seed none")

    asyncio.run(second())
    again = load_user_config(env={}, path=cfg)
    assert dict(again.sampler) == {} and again.seed is None and again.theme == theme


# ------------------------------------------------------------------------------------------------ 16: --list
def test_list_shows_full_model_names_and_singular_turns(tmp_path):
    """#23 item 16."""
    store = ChatStore(tmp_path / "h.sqlite3")
    long_name = "google/diffusiongemma-26b-a4b-it@0123456789ab"
    a = store.new_conversation(long_name)
    store.add_turn(a, "user", "one", model=long_name)
    b = store.new_conversation("tiny")
    store.add_turn(b, "user", "two", model="tiny")
    store.add_turn(b, "assistant", "2", model="tiny")
    lines = format_listing(store.list_conversations()).splitlines()
    row_a = next(line for line in lines if line.endswith("one"))
    row_b = next(line for line in lines if line.endswith("two"))
    assert long_name in row_a and " 1 turn " in row_a and " 2 turns " in row_b
    assert row_a.index("one") == row_b.index("two")  # the title column lines up
