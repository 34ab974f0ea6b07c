"""Slash commands of ``localdiff chat`` (typed into the prompt), their Tab completion, and the texts they show.

``/set``, ``/model NAME``, ``/system TEXT``, ``/show``, ``/stats``, ``/verbose``, ``/copy``, ``/clear`` (asks first),
``/new``, ``/regen``, ``/help``, ``/bye`` ``/exit`` ``/quit``. Mixed into :class:`localdiff.tui.app.ChatApp`; every
handler writes one note to the transcript (errors as error notes) and never raises.
"""

from __future__ import annotations

import os

from localdiff.errors import LocaldiffError
from localdiff.tui.settings import aliases, apply_set_checked, known

HELP = (
    "Enter sends · ctrl+j / alt+enter newline · ↑/↓ earlier prompts · Tab completes /commands · PgUp/PgDn scroll\n"
    "ctrl+c or Esc stops the answer · ctrl+c when idle, ctrl+d on an empty prompt, /bye: quit · f2 copies the answer\n"
    "ctrl+p commands · ctrl+t theme · ctrl+o canvas panel · ctrl+n new chat\n"
    "/set (list) · /set steps 8 · /set threshold 0.9 · /set entropy_bound 0.3 · /set seed 1 · /set max_tokens 128\n"
    "/model NAME · /system TEXT · /show · /stats · /verbose · /copy · /new · /clear · /regen · /help · /bye"
)
COMMANDS = (
    "bye",
    "clear",
    "copy",
    "exit",
    "help",
    "model",
    "new",
    "quit",
    "regen",
    "set",
    "show",
    "stats",
    "system",
    "verbose",
)
_TAKES_ARGS = {"model", "set", "system"}


def format_stats(stats) -> str:
    """Per-answer figures, like ``ollama run --verbose``: durations, prompt and answer tokens, forwards, rates; with
    DFlash drafts, this answer's acceptance length τ (tokens per verification step) over its drafted blocks."""
    d = stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)
    reused = d.get("prefill_tokens_reused", 0)

    def n(key: str, word: str) -> str:  # "1 canvas", "2 canvases"
        k = d.get(key, 0)
        return f"{k} {word if k == 1 else word + ('es' if word.endswith('s') else 's')}"

    return (
        f"total {d.get('seconds', 0.0):.2f} s · prefill {d.get('prefill_seconds', 0.0):.2f} s"
        f" · prompt {n('prompt_tokens', 'token')} ({reused} reused from the cache)\n"
        f"answer {n('new_tokens', 'token')} in {n('canvases', 'canvas')}"
        f" · {n('forwards', 'forward')} · TPF {d.get('tokens_per_forward', 0.0):.2f}"
        f" · {d.get('tokens_per_second', 0.0):.1f} tok/s" + _tau(d)
    )


def _tau(d: dict) -> str:
    """ " · DFlash τ 3.20 over 5 drafted blocks" ("" without drafts)."""
    n = len(d.get("acceptance_lengths") or ())
    return f" · DFlash τ {d.get('acceptance_length', 0.0):.2f} over {n} drafted block{'s' * (n != 1)}" if n else ""


def clipboard_note(n_chars: int, env=None) -> str:
    """What to tell after an OSC 52 clipboard write: it cannot be confirmed, and some terminals ignore it."""
    env = os.environ if env is None else env
    if env.get("TERM_PROGRAM") == "Apple_Terminal" or env.get("TERM") == "linux":
        return (
            f"this terminal does not support OSC 52 clipboard writes; the answer ({n_chars} characters) is in "
            "the chat's own clipboard (ctrl+v pastes it into the prompt) — select it with the mouse to copy it"
        )
    if env.get("TMUX"):
        return (
            f"copied the last answer ({n_chars} characters) with OSC 52; in tmux this needs "
            "`set -g set-clipboard on` (otherwise ctrl+v in the prompt still pastes it)"
        )
    return (
        f"copied the last answer ({n_chars} characters) with OSC 52 (if nothing arrives, your terminal ignores OSC 52)"
    )


class SlashMixin:
    """Slash commands for ChatApp (uses its transcript, settings, model, store and actions)."""

    def complete_prompt(self, text: str) -> list[str]:
        """Tab completion candidates (whole prompt texts) for a prompt starting with "/"."""
        cmd, space, arg = text[1:].partition(" ")
        if not space:
            return [f"/{c}" + (" " if c in _TAKES_ARGS else "") for c in COMMANDS if c.startswith(cmd.lower())]
        if cmd.lower() == "model":
            return [f"/model {n}" for n in self.model_choices() if n.startswith(arg)]
        if cmd.lower() == "set" and " " not in arg:
            keys = sorted({*aliases(), *known(), "seed"})
            return [f"/set {k} " for k in keys if k.startswith(arg.lower())]
        return []

    async def _slash(self, text: str) -> None:
        cmd, _, args = text[1:].partition(" ")
        cmd, args = cmd.lower(), args.strip()
        if cmd != "clear":
            self._clear_pending = False
        handler = getattr(self, f"_cmd_{cmd}", None) if cmd in COMMANDS else None
        if cmd in ("bye", "exit", "quit"):
            await self.action_quit()
        elif cmd in ("regen", "regenerate"):
            await self.action_regenerate()
        elif handler is not None:
            await handler(args)
        else:
            await self.transcript.add_note(f"unknown command /{cmd} — /help lists them", error=True)

    async def _cmd_help(self, args: str) -> None:
        await self.transcript.add_note(HELP)

    async def _cmd_new(self, args: str) -> None:
        await self.action_new_chat()

    async def _cmd_set(self, args: str) -> None:
        before = self.settings.persisted()
        try:
            note = apply_set_checked(self.settings, args, self.model)
        except LocaldiffError as exc:
            await self.transcript.add_note(str(exc), error=True)
            return
        after = self.settings.persisted()
        changed = {k: after.get(k) for k in {*before, *after} if before.get(k) != after.get(k)}
        await self.transcript.add_note(note + self._save_prefs(changed))

    def _save_prefs(self, values: dict) -> str:
        """Write ``values`` to the config file (when the app has one); returns a suffix for the note."""
        if not values or self.config_file is None:
            return ""
        from localdiff.tui.prefs import save_settings

        try:
            save_settings(self.config_file, values)
        except LocaldiffError as exc:
            return f"  (not saved: {exc})"
        return "  (saved)"

    async def _cmd_system(self, args: str) -> None:
        if not args:
            current = self.settings.system
            await self.transcript.add_note(
                f"system prompt: {current!r}"
                if current
                else "no system prompt (/system TEXT sets one, /system off clears it)"
            )
            return
        self.settings.system = None if args.lower() in ("off", "none", "clear") else args
        await self.transcript.add_note(
            "system prompt cleared"
            if self.settings.system is None
            else f"system prompt set ({len(args)} characters) for the next turns"
        )

    async def _cmd_model(self, args: str) -> None:
        if not args:
            names = ", ".join(self.model_choices()) or "none"
            await self.transcript.add_note(
                f"current model: {self.model_name} · ready to load: {names} (/model NAME switches; Tab completes)"
            )
            return
        await self.switch_model(args)

    async def _cmd_show(self, args: str) -> None:
        await self.transcript.add_note(self.model_summary())

    async def _cmd_stats(self, args: str) -> None:
        if self.last_stats is None:
            await self.transcript.add_note("no answer yet — /stats shows the last answer's figures")
        else:
            await self.transcript.add_note(format_stats(self.last_stats))

    async def _cmd_verbose(self, args: str) -> None:
        self.verbose = not self.verbose if args.lower() not in ("on", "off") else args.lower() == "on"
        await self.transcript.add_note(f"verbose {'on: figures after every answer' if self.verbose else 'off'}")

    async def _cmd_copy(self, args: str) -> None:
        await self.action_copy_last()

    async def _cmd_clear(self, args: str) -> None:
        await self.action_clear_chat()

    def model_summary(self) -> str:
        """The ``/show`` text: what the model is, its size and shape, where it runs, its sampler defaults."""
        m = self.model
        if m is None:
            return f"no model loaded ({self.load_error or f'{self.model_name} is still loading'})"
        card = self.card or {}
        cfg = getattr(m, "config", None)  # (a remote model has no local config or weights)
        try:
            params = sum(p.numel() for p in m.net.parameters())
        except Exception:
            params = 0
        shape = " · ".join(
            f"{label} {getattr(cfg, key)}"
            for key, label in (
                ("num_hidden_layers", "layers"),
                ("hidden_size", "hidden"),
                ("num_attention_heads", "heads"),
                ("num_experts", "experts"),
                ("vocab_size", "vocab"),
                ("canvas_length", "canvas"),
                ("max_position_embeddings", "context"),
            )
            if getattr(cfg, key, None) is not None
        )
        try:
            defaults = "  ".join(f"{k}={v}" for k, v in sorted(m.sampler_options().items()))
        except Exception:
            defaults = "?"
        dtype = str(getattr(m, "dtype", "")).replace("torch.", "")
        lines = [
            f"{self.model_name}: {card.get('description') or getattr(cfg, 'model_type', '') or 'checkpoint'}",
            f"{getattr(cfg, 'model_type', '?')} · {params / 1e6:.1f} M parameters · {shape}",
            f"{getattr(m, 'device', '?')} · {dtype} · quant {getattr(m, 'quant', None) or 'none'} · "
            + ("single-turn (each message starts fresh)" if card.get("single_turn") else "multi-turn"),
            f"path {getattr(m, 'path', None) or '—'}",
            f"sampler defaults: {defaults}",
        ]
        return "\n".join(lines)

    def welcome_text(self) -> str:
        """The start-up line: what the loaded model can do (catalog entry), single-turn handling, /help."""
        card = self.card or {}
        parts = [
            f"{self.model_name}: {card['description']}." if card.get("description") else f"{self.model_name} is ready."
        ]
        if card.get("prompt_examples"):
            parts.append("It knows prompts like: " + " · ".join(card["prompt_examples"]))
        if card.get("single_turn"):
            parts.append("Single-turn model: each message starts fresh (earlier turns are not sent to it).")
        parts.append("/help lists the commands.")
        return " ".join(parts)
