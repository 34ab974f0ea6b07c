"""A small random-weight DiffusionGemma checkpoint with the embedded model's tokenizer, for CLI tests.

Built with the reference (transformers, a test-only dependency) from ``refmodels.CONFIGS["small"]`` with the
vocabulary resized to the tokenizer's. ``generation_config.json`` sets few denoising steps (fast) and, when
``endless=True``, an EOS id outside the vocabulary so a generation always runs to ``max_new_tokens`` (for the
Ctrl-C test).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build_checkpoint(path: Path, endless: bool = False, steps: int = 4) -> Path:
    """Write the checkpoint into ``path`` (created) and return it."""
    import torch
    from tokenizers import Tokenizer
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from refmodels import CONFIGS, MINIMAL_VISION

    src = ROOT / "models" / "tiny"
    vocab = Tokenizer.from_file(str(src / "tokenizer.json")).get_vocab_size()
    cfg = DiffusionGemmaConfig(
        text_config=dict(CONFIGS["small"], vocab_size=vocab, eos_token_id=1, pad_token_id=0, bos_token_id=2),
        canvas_length=8,
        vision_config=dict(MINIMAL_VISION),
    )
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, path / name)
    gen = {
        "max_denoising_steps": steps,
        "eos_token_id": [vocab] if endless else [1],
        "pad_token_id": 0,
        "max_new_tokens": 16,
    }
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def shared_checkpoint(tmp_path_factory) -> Path:
    """The default checkpoint, built once per pytest session (shared by the test modules that need it)."""
    path = tmp_path_factory.getbasetemp() / "shared-small-ckpt"
    if not (path / ".complete").is_file():
        if path.exists():
            shutil.rmtree(path)
        build_checkpoint(path)
        (path / ".complete").write_text("ok")
    return path
