"""The ``localdiff`` argument parser: every subcommand's flags (``localdiff COMMAND --help``). The decoder options'
flags come from the option schema (:mod:`localdiff.decoding.options`); ``convert`` adds its own
(:func:`localdiff.cli.convert.add_parser`). :mod:`localdiff.cli.dispatch` runs what it parses."""

from __future__ import annotations

import argparse

from localdiff.usage_parser import UsageParser as _Parser

SAMPLER_HELP = "sampler settings (flag > LOCALDIFF_* env > config file > checkpoint generation_config > built-in)"


def _dtype(value: str) -> str:
    from localdiff.setting_values import dtype_name

    return dtype_name(value, "--dtype")


def _threads(value: str) -> int:
    """``--threads N``: 1 … 4 × the CPU count (``setting_values.check_threads``; 100,000 crashed torch)."""
    from localdiff.setting_values import check_threads

    return check_threads(value, "--threads")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")


def _add_sampler(p: argparse.ArgumentParser) -> None:
    from localdiff.decoding.options import cli_flags, flag_envs

    g = p.add_argument_group(SAMPLER_HELP)
    g.add_argument("-n", "--max-new-tokens", type=int, metavar="N", help="generate at most N tokens")
    for flag, key, spec in cli_flags():  # every decoder option, from the one schema (localdiff.decoding.options)
        helptext = f"{spec.help} ({spec.rule()}; {', '.join(flag_envs(flag))})"
        if spec.kind is bool:
            g.add_argument(flag, dest="opt_" + key, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        else:
            g.add_argument(flag, dest="opt_" + key, metavar=spec.metavar or key.upper(), help=helptext)
    g.add_argument("--seed", type=int, help="random seed (reproducible output)")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: CUDA when available)")
    g.add_argument(
        "--quant",
        choices=["int8", "int4", "none"],
        help="weight quantization at load (gen default: bf16, int8 or int4, the first that fits)",
    )
    g.add_argument(
        "--draft",
        metavar="MODEL",
        help="DFlash draft for a Qwen3 / Llama target: speculative decoding, "
        "same output (alias, org/repo or folder; 'auto' = the catalog's)",
    )
    g.add_argument(
        "--gpu-mem",
        metavar="SIZE",
        help="CUDA memory budget for the memory plan, e.g. 24GiB (default: free memory measured at load)",
    )
    g.add_argument(
        "--kv-budget",
        metavar="SIZE",
        help="device bytes for the KV cache, e.g. 2GiB; older blocks of "
        "full-attention layers move to host memory beyond it",
    )
    g.add_argument(
        "--threads",
        type=_threads,
        metavar="N",
        help="CPU threads, 1 to 4 × the CPU count (torch's intra-op threads, or llama.cpp's for a GGUF "
        "model; default: 1 for a model under 10M parameters, else all cores; LOCALDIFF_THREADS)",
    )
    g.add_argument(
        "--gpu-layers",
        metavar="N|all",
        help="GGUF models: layers llama.cpp offloads to the GPU of a Metal "
        "or CUDA build of llama-cpp-python (n_gpu_layers; default: "
        "all when the build can offload, else 0)",
    )


def _add_endpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--endpoint",
        metavar="URL",
        help="use an OpenAI-compatible server (localdiff serve, vLLM, "
        "SGLang) instead of a local model, e.g. http://127.0.0.1:11436/v1",
    )
    p.add_argument("--api-key", help="API key for --endpoint (default: $LOCALDIFF_API_KEY)")
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        help="--endpoint: give up when the server sends nothing for "
        "SECONDS, before its first byte or mid-answer (default 600; "
        "connecting: at most 10; $LOCALDIFF_TIMEOUT)",
    )


def _add_gen(sub) -> None:
    """The ``gen`` subcommand's arguments."""
    g = sub.add_parser(
        "gen",
        help="generate text once (for scripts and pipelines)",
        description="Generate text. Piped stdin is placed before the prompt. Only generated text "
        "goes to stdout, canvas by canvas; diagnostics go to stderr.",
    )
    g.add_argument("prompt_words", nargs="*", metavar="PROMPT", help="prompt text (or use -p)")
    g.add_argument("-m", "--model", help="model name, org/repo[@rev] or folder (default: config's default_model)")
    g.add_argument("-p", "--prompt", help="prompt text")
    g.add_argument("-f", "--file", help="read the prompt from FILE ('-' = stdin)")
    g.add_argument("--system", help="system message (chat mode)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=True,
        help="wrap the prompt in the model's chat template (default)",
    )
    mode.add_argument("--raw", dest="chat", action="store_false", help="feed the prompt text as is")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, settings, stats)")
    g.add_argument(
        "--raw-bytes",
        action="store_true",
        help="write the model's text exactly, control characters included, when stdout is not a "
        "terminal (default: they are shown as visible symbols, e.g. ESC as ␛)",
    )
    talk = g.add_mutually_exclusive_group()
    talk.add_argument("-q", "--quiet", action="store_true", help="no stats line on stderr (shown on a terminal)")
    talk.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="stats and KV-cache accounting (device/host bytes, blocks moved, prefill computed vs "
        "reused) on stderr, terminal or not",
    )
    g.add_argument(
        "--dtype",
        type=_dtype,
        metavar="{float32,bfloat16,float16}",
        help="compute dtype (default on CPU: bfloat16 where the CPU has native bf16 GEMM and the model "
        "is large or stored in 16 bits, else float32; float32 = the reference-exact path; "
        "env LOCALDIFF_DTYPE)",
    )
    _add_endpoint(g)
    _add_sampler(g)
    _add_common(g)


def _add_chat(sub) -> None:
    """The ``chat`` subcommand's arguments."""
    c = sub.add_parser("chat", help="interactive chat that shows the canvas denoising (terminal UI)")
    c.add_argument("-m", "--model", help="model to start with (default: config's default_model)")
    which = c.add_mutually_exclusive_group()
    which.add_argument("--resume", nargs="?", const="last", metavar="ID", help="resume a conversation (default: last)")
    which.add_argument("--list", dest="list_only", action="store_true", help="list saved conversations and exit")
    _add_endpoint(c)
    _add_sampler(c)
    _add_common(c)


def _add_serve(sub) -> None:
    """The ``serve`` subcommand's arguments."""
    sv = sub.add_parser(
        "serve",
        help="OpenAI- and Ollama-compatible HTTP API (127.0.0.1 by default)",
        description="Serve models over HTTP: OpenAI /v1/chat/completions, /v1/completions, "
        "/v1/models; Ollama /api/chat, /api/generate, /api/tags, /api/ps; /health.",
    )
    sv.add_argument(
        "-m",
        "--model",
        action="append",
        metavar="MODEL",
        help="serve this model besides the installed ones (a name or a path; repeatable; the first "
        "loads at start and answers requests that name none). Requests name models only by the "
        "names GET /v1/models lists, never by a path",
    )
    sv.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; another address needs --api-key or --insecure)",
    )
    sv.add_argument("--port", type=int, default=11436, help="port (default 11436)")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $LOCALDIFF_API_KEY)")
    sv.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-local --host without an API key (a usage error with --api-key or $LOCALDIFF_API_KEY)",
    )
    sv.add_argument("--max-queue", type=int, default=32, metavar="N", help="requests waiting at most (then 503)")
    sv.add_argument(
        "--max-batch", type=int, default=8, metavar="N", help="requests advanced together, 1 to 256 (default 8)"
    )
    sv.add_argument("--keep-alive", type=float, default=300.0, metavar="SECONDS", help="unload after SECONDS idle")
    sv.add_argument("--max-body", metavar="SIZE", help="request size limit, e.g. 1MiB (default 1MiB)")
    _add_sampler(sv)
    _add_common(sv)


def _add_pull(sub) -> None:
    """The ``pull`` subcommand's arguments."""
    pl = sub.add_parser("pull", help="download a model from the Hugging Face Hub (resumable)")
    pl.add_argument("name", help="catalog alias (see `localdiff list --all`) or org/repo[@revision]")
    pl.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    pl.add_argument("--verify", action="store_true", help="re-hash files already in the cache")
    pl.add_argument(
        "--quant",
        metavar="LABEL",
        help="a GGUF repo: pull the one file of this quantization (e.g. Q4_K_M; same as NAME:Q4_K_M)",
    )
    pl.add_argument(
        "--no-space-check",
        dest="check_space",
        action="store_false",
        help="download even when free disk is below what is left to fetch + a 64 MiB margin",
    )
    pl.add_argument(
        "--force",
        action="store_true",
        help="download even when the model fits this machine's GPU memory / RAM in no precision (bf16, int8, int4)",
    )
    _add_common(pl)


def _add_list(sub) -> None:
    """The ``list`` subcommand's arguments."""
    ls = sub.add_parser("list", aliases=["ls"], help="list models ready to run")
    ls.add_argument("--json", action="store_true", help="JSON output")
    ls.add_argument("--all", action="store_true", help="also show catalog models that are not pulled")
    _add_common(ls)


def _add_rm(sub) -> None:
    """The ``rm`` subcommand's arguments."""
    rm = sub.add_parser("rm", help="remove a pulled model from the Hugging Face cache")
    rm.add_argument("name")
    _add_common(rm)


def _add_show(sub) -> None:
    """The ``show`` subcommand's arguments."""
    sh = sub.add_parser("show", help="architecture summary and memory plan (works before a pull)")
    sh.add_argument("name", nargs="?", help="model (default: config's default_model)")
    sh.add_argument("--plan", action="store_true", help="print the memory plan for a device budget")
    sh.add_argument(
        "--gpu-mem", metavar="SIZE", help="device memory budget, e.g. 24GiB (default: measured; implies --plan)"
    )
    sh.add_argument(
        "--quant",
        choices=["int8", "int4", "none", "bf16"],
        default=None,
        help="precision for the plan (default: int8; implies --plan)",
    )
    sh.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="plan for a GPU or for the CPU alone (RAM: --ram); default: the GPU when one is found "
        "or --gpu-mem is given, else the CPU",
    )
    sh.add_argument(
        "--kv-budget",
        metavar="SIZE",
        help="KV-cache bytes in the plan, e.g. 512MiB (default: min(context, 32768) tokens)",
    )
    sh.add_argument(
        "--ram",
        metavar="SIZE",
        help="RAM for the plan, e.g. 32GiB (default: measured): the budget "
        "with --device cpu; what host expert layers must fit on a GPU plan",
    )
    sh.add_argument("--json", action="store_true", help="JSON output")
    _add_common(sh)


def _add_config(sub) -> None:
    """The ``config`` subcommand's arguments."""
    cf = sub.add_parser("config", help="show where the config file is, or the effective settings")
    cf.add_argument("action", nargs="?", choices=["path", "show"], default="show")
    cf.add_argument("--json", action="store_true", help="JSON output (show)")
    _add_common(cf)


def _add_bench(sub) -> None:
    """The ``bench`` subcommand's arguments."""
    b = sub.add_parser("bench", help="benchmarks (speed, memory, accuracy)", add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER)


def _add_quantize(sub) -> None:
    """The ``quantize`` subcommand's arguments."""
    q = sub.add_parser("quantize", help="write a pre-quantized int8 / int4 checkpoint")
    q.add_argument("name", help="model to quantize")
    q.add_argument("--recipe", help="quantization recipe name (default: the model's)")
    q.add_argument(
        "--quant",
        choices=["int8", "int4"],
        default=None,
        help="precision of the recipe's quantized tensors (default: as the recipe says, int8)",
    )
    q.add_argument("-o", "--output", required=True, metavar="DIR", help="output folder")
    q.add_argument("--device", help="device used while quantizing")
    q.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    _add_common(q)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (used by :func:`main` and by the docs)."""
    p = _Parser(prog="localdiff", description="Run diffusion language models on this machine.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_gen(sub)
    _add_chat(sub)
    _add_serve(sub)
    _add_pull(sub)
    _add_list(sub)
    _add_rm(sub)
    _add_show(sub)
    _add_config(sub)
    _add_bench(sub)
    _add_quantize(sub)

    from localdiff.cli.convert import add_parser as add_convert

    add_convert(sub)
    return p
