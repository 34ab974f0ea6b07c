"""ReFusion through the engine, the CLI and the chat's worker: a tiny random checkpoint in the upstream layout with
the embedded model's tokenizer; ``localdiff gen -m <folder>``; the chat's frames name the slots picked each round."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import localdiff
from localdiff.events import CanvasDone, Done, StepEvent
from localdiff.tui.runner import FrameSlot, GenerationJob, run_generation, slots_note
from refusion_ckpt import build_hf, save_upstream

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("refusion_tok")
    hf = build_hf(2, scale=5.0, vocab_size=365)
    save_upstream(hf, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(mask_token_id=6, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5], "pad_token_id": 0}))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        shutil.copy(TINY / f, path / f)
    return path


def test_stream_events_and_result(folder):
    m = localdiff.load(str(folder))
    evs = list(
        m.stream(
            "What is 2 + 3?",
            max_new_tokens=16,
            slot_size=4,
            serial_num_blocks=2,
            slot_threshold=0.3,
            token_threshold=0.3,
            seed=0,
        )
    )
    steps = [e for e in evs if isinstance(e, StepEvent)]
    blocks = [e for e in evs if isinstance(e, CanvasDone)]
    done = evs[-1]
    assert isinstance(done, Done) and steps and 1 <= len(blocks) <= 2
    for e in steps:
        assert e.slots["how"] in ("verify", "infill") and e.slots["picked"] == sorted(e.slots["picked"])
        assert set(e.slots["committed"]) <= set(e.slots["picked"]) and e.canvas_ids.shape == (1, 8)
    assert done.stats.forwards >= 2 * len(steps) and done.options["slot_size"] == 4
    assert len(done.token_ids) <= 16 and len(done.stats.commit_step) == len(done.token_ids)
    again = m.generate(
        "What is 2 + 3?", max_new_tokens=16, slot_size=4, serial_num_blocks=2, slot_threshold=0.3, token_threshold=0.3
    )
    assert again.token_ids == done.token_ids  # temperature 0: deterministic
    kw = dict(max_new_tokens=12, slot_size=4, serial_num_blocks=1, slot_threshold=0.3, token_threshold=0.3)
    both = m.generate(["What is 2 + 3?", "Sort these words: elk cat"], **kw)
    assert both.token_ids == [m.generate(p, **kw).token_ids for p in ("What is 2 + 3?", "Sort these words: elk cat")]
    with pytest.raises(localdiff.UsageError if hasattr(localdiff, "UsageError") else Exception, match="steps"):
        m.generate("hi", steps=4)  # another family's option: one-line usage error


def test_gen_cli_and_bad_option(folder):
    (folder.parent / "config.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALDIFF_", "HF_"))}
    env.update(
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        LOCALDIFF_CONFIG=str(folder.parent / "config.toml"),
        HF_HOME=str(folder.parent / "hf"),
    )
    run = [
        sys.executable,
        "-m",
        "localdiff",
        "gen",
        "-m",
        str(folder),
        "-p",
        "What is 2 + 3?",
        "--max-new-tokens",
        "8",
        "--slot-size",
        "4",
    ]
    ok = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(run[:-1] + ["0"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "slot" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_chat_frames_show_the_picked_slots(folder):
    assert slots_note({"picked": [1, 4], "how": "infill", "committed": [1, 4]}) == "slots 2,5 → infill"
    assert slots_note({"picked": [0, 2], "how": "verify", "committed": [0]}) == "slots 1,3 → verify: 1 committed"
    m = localdiff.load(str(folder))
    slot, posted, notes = FrameSlot(), [], []
    job = GenerationJob(
        [{"role": "user", "content": "What is 2 + 3?"}],
        dict(max_new_tokens=16, slot_size=4, serial_num_blocks=1, slot_threshold=0.3),
    )
    run_generation(
        m,
        None,
        job,
        slot,
        posted.append,
        threading.Event(),
        step_hook=lambda ev: notes.append(slot.take().slots if slot is not None else None),
    )
    assert notes and all(n.startswith("slots ") and "→" in n for n in notes)
    assert type(posted[-1]).__name__ == "GenerationFinished" and posted[-1].error is None


def test_canvas_view_title_names_the_round():
    from textual.app import App

    from localdiff.tui.runner import MASK, NEW, CanvasFrame
    from localdiff.tui.widgets import CanvasView

    class Host(App):
        def compose(self):
            yield CanvasView()

    async def go():
        async with Host().run_test(size=(80, 24)) as pilot:
            view = pilot.app.query_one(CanvasView)
            view.show(
                CanvasFrame(
                    0, 3, 4, ["a", "b", "░", "░"], [NEW, NEW, MASK, MASK], [1, 1, 0, 0], slots="slots 1 → infill"
                )
            )
            await pilot.pause()
            assert view.border_title == "canvas 1 · round 3 · slots 1 → infill"

    import asyncio

    asyncio.run(go())
