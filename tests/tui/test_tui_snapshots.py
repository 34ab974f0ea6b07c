"""Snapshot tests of `localdiff chat` at 80x24, 120x40 and 40x12 (pytest-textual-snapshot), driving the real engine on the embedded
`tiny` model with a fixed seed. Two values are pinned because they depend on the machine, not on the app:
process memory (RSS) and tokens/second. Update the SVGs with `pytest tests/tui/test_tui_snapshots.py --snapshot-update`
after an intended change (e.g. a retrained tiny model) and look at them."""

from __future__ import annotations

import threading

import pytest
from tuihelpers import hold_first_step, make_app, send, wait_for

from localdiff.tui.settings import ChatSettings

SIZE = (80, 24)


async def steady(pilot, app):
    """Pin machine-dependent numbers (memory, the live elapsed time) and stop the cursor blinking."""
    app.status.memory_fn = lambda: 300 * 2**20
    real_live = app.status.show_live
    app.status.show_live = lambda elapsed, tokens, forwards: real_live(1.0, tokens, forwards)
    app.prompt.cursor_blink = False
    await wait_for(pilot, lambda: app.model is not None)
    app.status.set_state(app.status.state)


def test_canvas_panel_mid_generation(snap_compare, tiny, tmp_path):
    settings = ChatSettings(seed=7, sampler={"max_denoising_steps": 8})
    app = make_app(tiny, tmp_path, settings=settings)
    paused, release = threading.Event(), threading.Event()
    pause_at = {"step": None}

    def hook(ev):  # worker thread: hold the engine right after step 2 of the first canvas (or its last step)
        if ev.canvas_index == 0 and pause_at["step"] is None and (ev.step == 2 or ev.step == ev.max_steps):
            pause_at["step"] = ev.step
            paused.set()
            while not release.wait(0.05) and not app.cancel_event.is_set():
                pass

    async def run_before(pilot):
        await steady(pilot, app)
        app.step_hook = hook
        await pilot.press(*"What is 12 + 34?", "enter")
        await wait_for(pilot, paused.is_set)
        await wait_for(pilot, lambda: app.canvas.frame is not None and app.canvas.frame.step == pause_at["step"])
        await pilot.pause()

    try:
        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
    finally:
        release.set()
    assert app.canvas.frame.canvas_index == 0 and not app.canvas.frame.final


def test_finished_two_turn_chat(snap_compare, tiny, tmp_path):
    app = make_app(tiny, tmp_path, settings=ChatSettings(seed=1))

    async def run_before(pilot):
        await steady(pilot, app)
        await send(pilot, app, "What is 12 + 34?")
        await send(pilot, app, "What is 5 + 7?")
        app.status.tps = 100.0  # tokens/second depends on the machine
        app.status.set_state("ready")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
    assert len(app.store.load(app.conversation_id).turns) == 4


def test_light_theme_after_one_answer(snap_compare, tiny, tmp_path):
    app = make_app(tiny, tmp_path, settings=ChatSettings(seed=0))

    async def run_before(pilot):
        await steady(pilot, app)
        await pilot.press("ctrl+t")  # dark → light
        await send(pilot, app, "Sort the letters: s u m m e r")
        app.status.tps = 100.0
        app.status.set_state("ready")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
    assert app.theme == "textual-light"


@pytest.mark.parametrize("size", [(120, 40), (40, 12)])
def test_three_turns_on_a_single_turn_model(snap_compare, tiny, tmp_path, size):
    """#23: the start-up line, three answered turns, user text verbatim (a `#` stays a `#`), the canvas panel
    pinned; at 40x12 the prompt box stays on screen (the canvas panel and the footer give way)."""
    app = make_app(tiny, tmp_path, settings=ChatSettings(seed=1))

    async def run_before(pilot):
        await steady(pilot, app)
        await send(pilot, app, "What is 41 + 93?")
        await send(pilot, app, "Reverse the letters: d r a g o n")
        await send(pilot, app, "Sort these words: elk cat gnu")
        await pilot.press(*"# not a heading")
        app.status.tps = 100.0
        app.status.set_state("ready")
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)
    assert [m["content"] for m in app.messages][1::2] == ["41 + 93 = 134.", "n o g a r d", "cat elk gnu"]


def test_mid_generation_at_40x12(snap_compare, tiny, tmp_path):
    """#23 item 3: while answering at 40x12 the canvas panel shrinks and the prompt stays visible (the live
    figures' elapsed time is pinned by ``steady``)."""
    app = make_app(tiny, tmp_path, settings=ChatSettings(seed=7, sampler={"max_denoising_steps": 8}))
    hook, paused, release = hold_first_step(app)

    async def run_before(pilot):
        await steady(pilot, app)
        app.step_hook = hook
        await pilot.press(*"What is 12 + 34?", "enter")
        await wait_for(pilot, paused.is_set)
        await wait_for(pilot, lambda: app.canvas.frame is not None)
        await pilot.pause()

    try:
        assert snap_compare(app, terminal_size=(40, 12), run_before=run_before)
    finally:
        release.set()
