"""The chat's view of NAP's multi-trajectory answers (localdiff.tui.blocks) and the status line's ARness (#21)."""

from __future__ import annotations

import asyncio

from textual.app import App

from localdiff.events import GenerationStats
from localdiff.tui import blocks
from localdiff.tui.widgets.status import StatusLine
from localdiff.tui.widgets.transcript import Transcript

NAP_TEXT = "<think 1> 1 + 2 = 3. <think 2> 2 + 1 = 3. <think 3> a|b <summary> 3"


def test_render_side_by_side_when_wide_and_stacked_when_narrow():
    wide = blocks.render(NAP_TEXT, 120)
    assert wide.splitlines()[:3] == [
        "| **think 1** | **think 2** | **think 3** |",
        "|---|---|---|",
        "| 1 + 2 = 3. | 2 + 1 = 3. | a\\|b |",
    ]
    assert "**summary** 3" in wide
    narrow = blocks.render(NAP_TEXT, 40)
    assert "|---|" not in narrow
    assert [ln for ln in narrow.splitlines() if ln] == [
        "**think 1** 1 + 2 = 3.",
        "**think 2** 2 + 1 = 3.",
        "**think 3** a\\|b",
        "**summary** 3",
    ]
    assert blocks.render("just an answer", 120) == "just an answer"


def test_status_line_shows_global_arness():
    line = StatusLine()
    line.memory_fn = lambda: 0
    line.show_stats(
        GenerationStats(tokens_per_forward=2.0, tokens_per_second=5.0, arness={"local@1": 0.5, "global@1": 0.734})
    )
    assert "TPF 2.00 · 5.0 tok/s · ARness 0.73" in line.line()
    line.show_stats(GenerationStats(tokens_per_forward=2.0))  # canvas family: no ARness
    assert "ARness" not in line.line()


def test_transcript_shows_the_blocks_as_a_table():
    class Host(App):
        def compose(self):
            yield Transcript()

    async def go():
        app = Host()
        async with app.run_test(size=(120, 30)) as pilot:
            tr = app.query_one(Transcript)
            msg = await tr.add_message("assistant", "")
            await msg.set_text(NAP_TEXT)
            await pilot.pause()
            assert msg.text == NAP_TEXT  # the raw answer is kept (history, /copy)
            assert msg.query("MarkdownTable")  # the think blocks side by side
            streamed = await tr.add_message("assistant", NAP_TEXT)  # streamed as raw text, then final
            await streamed.set_text(NAP_TEXT)
            await pilot.pause()
            assert streamed.query("MarkdownTable")

    asyncio.run(go())
