"""``localdiff serve``, and ``gen`` / ``chat`` against an OpenAI-compatible endpoint (``--endpoint URL``)."""

from __future__ import annotations

import os
import sys

from localdiff.config import load_user_config, sampler_overrides, with_flags
from localdiff.errors import LocaldiffError, UsageError

#: the most requests ``serve --max-batch`` advances together (vLLM's ``--max-num-seqs`` default is 256 too)
MAX_BATCH = 256


def _api_key(args) -> str | None:
    """``--api-key`` else ``$LOCALDIFF_API_KEY`` else None.

    Raises:
        UsageError: an empty ``--api-key``, or a key with characters an ``Authorization`` header cannot carry
            as typed (anything but visible ASCII: a client could never send it to ``serve``; ``--endpoint`` failed
            with an internal error).
    """
    key, where = getattr(args, "api_key", None), "--api-key"
    if key is not None and not key.strip():
        raise UsageError("--api-key: empty key (leave the flag out for no key)")
    if key is None:
        key, where = os.environ.get("LOCALDIFF_API_KEY") or None, "LOCALDIFF_API_KEY"
    if key is not None and not all("!" <= c <= "~" for c in key):
        raise UsageError(f"{where}: use visible ASCII characters only, no spaces (an HTTP header carries no others)")
    return key


def endpoint_timeout(args) -> float:
    """``--timeout SECONDS`` (else ``$LOCALDIFF_TIMEOUT``, else 600): how long ``--endpoint`` waits for the server's
    first byte and between streamed bytes.

    Raises:
        UsageError: not a finite number of seconds > 0, named as the flag or the variable.
    """
    import math

    from localdiff.backends.remote import DEFAULT_TIMEOUT_S

    text, where = getattr(args, "timeout", None), "--timeout"
    if text is None:
        text, where = os.environ.get("LOCALDIFF_TIMEOUT"), "LOCALDIFF_TIMEOUT"
    if text is None or (where == "LOCALDIFF_TIMEOUT" and not text.strip()):
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{where}: expected a number of seconds > 0, e.g. 60 (got {text!r})")
    if value > MAX_TIMEOUT_S:  # a socket deadline past the clock's range: OverflowError deep in the HTTP client
        raise UsageError(f"{where}: at most {MAX_TIMEOUT_S:,} seconds (one year) (got {text!r})")
    return value


#: the longest ``--timeout`` / ``LOCALDIFF_TIMEOUT`` (one year; 1e10 s overflowed the socket's deadline)
MAX_TIMEOUT_S = 365 * 24 * 3600


def check_endpoint_flags(args) -> None:
    """``--api-key`` / ``--timeout`` on ``gen`` / ``chat`` without ``--endpoint`` would be ignored: refuse them.

    Raises:
        UsageError: naming the flag.
    """
    if getattr(args, "endpoint", None) is not None:
        if not args.endpoint.strip():
            raise UsageError("--endpoint: empty URL (e.g. http://127.0.0.1:11436/v1)")
        if args.model is not None and not args.model.strip():  # as without --endpoint (it meant the first model)
            raise UsageError("empty model name (leave -m out for the server's first model)")
        endpoint_timeout(args)
        return
    for flag in ("api_key", "timeout"):
        if getattr(args, flag, None) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} applies to --endpoint URL (a local model has none)")


def _flag_options(args) -> dict:
    """Decoder options given as flags only, by schema name and typed (a remote server keeps its own defaults for
    the rest); ``--temperature MAX:MIN`` gives both options of the pair.

    Raises:
        UsageError: a bad value, named as the flag.
    """
    from localdiff.cli.gen import _flags, flag_names
    from localdiff.decoding.options import all_specs, resolve_key

    specs = {s.name: s for s in all_specs()}
    shown = flag_names(_flags(args))
    out = {}
    for key, value in _flags(args).items():
        spec = specs[resolve_key(key)]
        if isinstance(value, str) and ":" in value and not spec.pair_of:  # "--temperature 0.9:0.1": the pair
            spec = next((s for s in specs.values() if s.pair_of and key in s.aliases), spec)  # (t_max, t_min)
        if spec.pair_of and isinstance(value, str) and ":" in value:
            value, out[spec.pair_of] = spec.split_pair(value, specs[spec.pair_of], shown.get(key, key))
        out[spec.name] = spec.coerce(value, shown.get(key, key))
    return out


def run_serve(args) -> int:
    """Run ``localdiff serve`` in the foreground; returns 0 once stopped by Ctrl-C or SIGTERM (after draining)."""
    from localdiff.cli.gen import _flags, _size
    from localdiff.serve import check_binding, serve

    key = _api_key(args)
    if key and args.insecure:  # --insecure = "serve without a key": with a key it says the opposite of the key
        src = "--api-key" if args.api_key else "LOCALDIFF_API_KEY (set in the environment)"
        raise UsageError(
            f"--insecure contradicts {src}: drop --insecure to require the key, or "
            + ("drop --api-key" if args.api_key else "unset LOCALDIFF_API_KEY")
            + " to serve without one"
        )
    check_binding(args.host, key, args.insecure)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535 (got {args.port})")
    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be ≥ 1 (got {args.max_queue})")
    if not (args.keep_alive >= 0 and args.keep_alive != float("inf")):  # NaN fails both (it was accepted)
        raise UsageError(f"--keep-alive must be a number of seconds ≥ 0; 0 = never unload (got {args.keep_alive:g})")
    if not 1 <= args.max_batch <= MAX_BATCH:
        raise UsageError(f"--max-batch must be between 1 and {MAX_BATCH} (got {args.max_batch})")
    kv_budget = _size(args.kv_budget, "--kv-budget")  # what the batch's requests' caches hold together at most
    models = list(args.model or ())  # -m, repeatable: the first is the default and loads at start
    cfg = with_flags(
        load_user_config(),
        model=models[0] if models else None,
        device=args.device,
        quant=args.quant,
        threads=args.threads,
    )
    sampler = sampler_overrides(_flags(args), cfg)
    from localdiff.cli.gen import flag_names
    from localdiff.decoding.options import check_overrides

    check_overrides(sampler, flag_names(_flags(args)))  # bad values were accepted and failed on every request
    max_body = _size(args.max_body, "--max-body", 1)  # 0 was silently the 1 MiB default
    return serve(
        models,
        cfg.default_model,
        host=args.host,
        port=args.port,
        api_key=key,
        insecure=args.insecure,
        device=cfg.device,
        quant=cfg.quant,
        sampler=sampler,
        max_queue=args.max_queue,
        keep_alive=args.keep_alive or None,
        max_body=max_body,
        gpu_mem=_size(args.gpu_mem, "--gpu-mem", 1),
        threads=cfg.threads or "auto",  # auto: by model size
        gpu_layers=getattr(args, "gpu_layers", None),
        draft=getattr(args, "draft", None),
        max_batch=args.max_batch,
        kv_budget=kv_budget,
        decoder_from=_decoder_from(flag_names(_flags(args)), cfg),
    )


def _decoder_from(typed: dict, cfg) -> str | None:
    """Where a decoder given for this run came from ("--decoder", "LOCALDIFF_DECODER"); None for the config file's
    (saved for the models that can run it) or none."""
    if "decoder" in typed:
        return typed["decoder"]
    origin = cfg.origins.get("decoder", "")
    return origin[len("env:") :] if origin.startswith("env:") else None


# flags a server ignores
LOCAL_ONLY = ("device", "quant", "dtype", "gpu_mem", "kv_budget", "draft", "threads", "gpu_layers")


def refuse_local_flags(args) -> None:
    """``gen`` / ``chat --endpoint``: the flags that choose how a local model runs would be ignored by a server.

    Raises:
        UsageError: naming the first one given.
    """
    for flag in LOCAL_ONLY:
        if getattr(args, flag, None) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} applies to local models, not to --endpoint")


def run_gen_remote(args) -> int:
    """``localdiff gen --endpoint URL``: stream the answer from the server to stdout (or one JSON object)."""
    from localdiff.backends.remote import RemoteClient, RemoteModel, request_fields
    from localdiff.cli.gen import _text_filter
    from localdiff.cli.prompt_input import assemble_prompt
    from localdiff.safetext import json_dumps

    prompt = assemble_prompt(args)
    refuse_local_flags(args)
    quiet = args.quiet

    def note(seconds):
        if not quiet:
            sys.stderr.write(f"waiting for {client.url} to answer (gives up after {client.timeout:g} s: --timeout)\n")
            sys.stderr.flush()

    client = RemoteClient(args.endpoint, _api_key(args), endpoint_timeout(args), on_wait=note)
    try:
        name = args.model or os.environ.get("LOCALDIFF_MODEL") or RemoteModel(client).name
        if args.chat:
            msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            payload = msgs
        else:
            payload = prompt  # --system with --raw was refused by assemble_prompt
        fields = request_fields(args.max_new_tokens, args.seed, _flag_options(args))
        out, parts, info = sys.stdout, [], {}
        show = _text_filter(args, out)  # a server's text is model output too: control characters made visible
        stream = client.stream(payload, name, args.chat, fields)
        try:
            for kind, value in stream:
                if kind == "text":
                    parts.append(value)
                    if not args.json:
                        out.write(show(value))
                        out.flush()
                else:
                    info = value
        except KeyboardInterrupt:
            stream.close()
            sys.stderr.write("interrupted\n")
            return 130
        except LocaldiffError:  # cut short: the text shown stays, ended by a newline before the error line
            if parts and not args.json and not parts[-1].endswith("\n"):
                out.write("\n")
                out.flush()
            raise
        text = "".join(parts)
        if args.json:
            ext = info.get("localdiff") if isinstance(info.get("localdiff"), dict) else {}
            seed = args.seed if args.seed is not None else ext.get("seed")  # the seed the server used (as gen's)
            out.write(
                json_dumps(
                    {
                        "text": text,
                        "model_name": name,
                        "endpoint": client.url,
                        "seed": seed,
                        "finish_reason": info.get("finish_reason"),
                        "usage": info.get("usage"),
                        "localdiff": info.get("localdiff"),
                    }
                )
                + "\n"
            )
        elif text and not text.endswith("\n"):
            out.write("\n")
        out.flush()
        if getattr(args, "verbose", False):
            sys.stderr.write(_remote_stats(info, client.url, name, args.seed) + "\n")
        return 0
    finally:
        client.close()


def _remote_stats(info: dict, url: str, name: str, seed) -> str:
    """``gen --endpoint -v``: the answer's numbers as the server reported them (``usage``; a ``localdiff serve``
    also sends forwards, canvases, seconds and the seed under ``localdiff``)."""
    usage = info.get("usage") if isinstance(info.get("usage"), dict) else {}
    ext = info.get("localdiff") if isinstance(info.get("localdiff"), dict) else {}
    parts = [f"{usage.get('completion_tokens', '?')} new tokens", f"{usage.get('prompt_tokens', '?')} prompt tokens"]
    if ext:
        parts += [
            f"{ext.get('canvases')} canvas(es)",
            f"{ext.get('forwards')} forwards",
            f"TPF {float(ext.get('tokens_per_forward') or 0):.2f}",
            f"{float(ext.get('seconds') or 0):.2f} s",
        ]
        seed = seed if seed is not None else ext.get("seed")
    if seed is not None:
        parts.append(f"seed {seed}")
    return f"stats: {', '.join(parts)} (from {url}, model {name}; finish {info.get('finish_reason')})"


def remote_loader(endpoint: str, api_key: str | None, timeout: float | None = None):
    """A chat ``loader(name, device=, quant=)`` that connects to ``endpoint`` instead of loading weights
    (``timeout``: seconds, see :func:`endpoint_timeout`; None = the client's default)."""
    from localdiff.backends.remote import RemoteClient, RemoteModel

    def load(name, device=None, quant=None):
        client = RemoteClient(endpoint, api_key) if timeout is None else RemoteClient(endpoint, api_key, timeout)
        return RemoteModel(client, name or None)

    return load
