"""Newcomer findings of session 5, through the CLI entry point: ``--endpoint`` to a server that accepts the connection
and never answers gives up after ``--timeout`` with one line naming the URL; ``chat`` with a model that cannot be
loaded fails before the terminal UI starts; ``gen -v``'s KV-cache line has units. (The one-line usage errors of the
same check are cases of the bad-input corpus, tests/cli/test_bad_inputs.py.)"""

from __future__ import annotations

import io
import socket
import sys
import time

import pytest

from localdiff.cli import main
from cli_fixtures import isolated  # noqa: F401  (the bad-input corpus' isolation; `home` adds to it)


@pytest.fixture
def home(isolated, monkeypatch):
    """test_bad_inputs' isolation (no LOCALDIFF_*, config and HF cache in tmp, offline) + the chat history in tmp."""
    monkeypatch.setenv("LOCALDIFF_DATA_DIR", str(isolated / "data"))
    return isolated


@pytest.fixture
def silent():
    """http://127.0.0.1:PORT of a socket that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def _err_lines(capsys) -> list[str]:
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return err.splitlines()


@pytest.mark.parametrize("model", [["-m", "m"], []], ids=["named model: the POST waits", "no -m: GET /models waits"])
def test_gen_endpoint_that_never_answers_gives_up_after_the_timeout(model, silent, home, capsys):
    t0 = time.monotonic()
    rc = main(["gen", "--endpoint", silent, *model, "--timeout", "1", "-p", "hi"])
    took = time.monotonic() - t0
    assert rc == 1 and took < 30
    assert _err_lines(capsys) == [
        f"error: {silent}/v1 did not answer within 1 s (wait longer with --timeout SECONDS or LOCALDIFF_TIMEOUT)"
    ]


def test_gen_endpoint_says_it_is_waiting_then_gives_up(silent, home, monkeypatch, capsys):
    from localdiff.backends.remote import RemoteClient

    monkeypatch.setattr(RemoteClient, "wait_note_s", 0.2)
    monkeypatch.setenv("LOCALDIFF_TIMEOUT", "1.5")
    assert main(["gen", "--endpoint", silent, "-m", "m", "-p", "hi"]) == 1
    assert _err_lines(capsys) == [
        f"waiting for {silent}/v1 to answer (gives up after 1.5 s: --timeout)",
        f"error: {silent}/v1 did not answer within 1.5 s (wait longer with --timeout SECONDS or LOCALDIFF_TIMEOUT)",
    ]
    assert main(["gen", "--endpoint", silent, "-m", "m", "-q", "-p", "hi"]) == 1  # -q: the error alone
    assert len(_err_lines(capsys)) == 1


def test_the_default_timeouts_are_the_documented_ones():
    from localdiff.backends.remote import CONNECT_TIMEOUT_S, DEFAULT_TIMEOUT_S, RemoteClient

    c = RemoteClient("http://127.0.0.1:1")
    try:
        assert (c.timeout, c.connect_timeout) == (DEFAULT_TIMEOUT_S, CONNECT_TIMEOUT_S) == (600.0, 10.0)
        t = c._http.timeout
        assert (t.connect, t.read, t.write, t.pool) == (10.0, 600.0, 600.0, 600.0)
    finally:
        c.close()
    c = RemoteClient("http://127.0.0.1:1", timeout=2)
    assert c._http.timeout.connect == 2.0  # the connect wait never exceeds --timeout
    c.close()


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def terminal(monkeypatch):
    """ChatApp.run records the app instead of taking over the terminal; call ``terminal.enter()`` in the test body
    (after capsys has taken the streams for the call) to make stdin and stdout look like a terminal."""
    from localdiff.tui.app import ChatApp

    started = []

    def run(self):
        started.append(self)
        self._return_code = 0

    monkeypatch.setattr(ChatApp, "run", run)

    class Terminal:
        def __init__(self):
            self.started = started

        def enter(self):
            monkeypatch.setattr(sys, "stdin", _Tty())
            monkeypatch.setattr(sys, "stdout", _Tty())

    return Terminal()


@pytest.mark.parametrize(
    "argv,line",
    [
        (["-m", "no-such-model-xyz"], "error: cannot load 'no-such-model-xyz': unknown model 'no-such-model-xyz'"),
        (["-m", "./no/such/dir"], "error: cannot load './no/such/dir': "),
        (
            ["--endpoint", "http://127.0.0.1:1"],
            "error: cannot load the server's first model: cannot reach http://127.0.0.1:1/v1: connection refused",
        ),
        (
            ["--endpoint", "http://127.0.0.1:1", "-m", "tiny"],
            "error: cannot load 'tiny': cannot reach http://127.0.0.1:1/v1",
        ),
        (["-m", ""], "error: empty model name"),
    ],
    ids=["unknown name", "missing folder", "endpoint refused", "endpoint refused, named model", "empty name"],
)
def test_chat_with_a_model_that_cannot_load_fails_before_the_ui(argv, line, terminal, home, capsys):
    terminal.enter()
    assert main(["chat", *argv]) == (2 if argv == ["-m", ""] else 1)
    err = _err_lines(capsys)
    assert len(err) == 1 and err[0].startswith(line) and "Errno" not in err[0], err
    assert terminal.started == []  # the UI never started


def test_chat_endpoint_that_never_answers_fails_before_the_ui(silent, terminal, home, capsys):
    terminal.enter()
    assert main(["chat", "--endpoint", silent, "-m", "m", "--timeout", "1"]) == 1
    assert _err_lines(capsys) == [
        f"error: cannot load 'm': {silent}/v1 did not answer within 1 s (wait longer with "
        "--timeout SECONDS or LOCALDIFF_TIMEOUT)"
    ]
    assert terminal.started == []


def test_chat_starts_the_ui_with_the_model_it_loaded_first(ckpt, terminal, home, capsys):
    terminal.enter()
    assert main(["chat", "-m", str(ckpt)]) == 0
    (app,) = terminal.started
    model = app.loader(app.model_name, device=app.device, quant=app.quant)  # the UI's first load: no second load
    assert getattr(model, "path", None) is not None and str(ckpt) in str(model.path)
    assert app.loader(app.model_name) is not model  # a later switch to the same name loads again
    assert _err_lines(capsys) == []


def test_gen_verbose_kv_cache_line_has_units(ckpt, home, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert (
        main(["gen", "-m", str(ckpt), "--raw", "-p", "one two", "-n", "8", "--seed", "0", "-v", "--kv-budget", "1KiB"])
        == 0
    )
    (line,) = [x for x in _err_lines(capsys) if x.startswith("kv cache:")]
    assert "=" not in line and "_" not in line, line
    assert " tokens, device " in line and "device budget 1.00 KiB" in line and " on host" in line
    assert any(u in line for u in (" KiB", " MiB")), line


def test_kv_cache_line_formats_both_cache_kinds():
    from localdiff.cli.gen import kv_cache_line

    block = {
        "budget_bytes": None,
        "device_bytes": 344064,
        "device_bytes_peak": 344064,
        "host_bytes": 0,
        "host_bytes_peak": 0,
        "staging_bytes": 0,
        "staging_bytes_peak": 0,
        "blocks_device": 4,
        "blocks_host": 0,
        "blocks_to_host": 1,
        "bytes_to_host": 3 * 2**20,
        "blocks_to_device": 12,
        "bytes_to_device": 101376,
        "blocks_freed": 2,
        "prefetched_reads": 5,
        "sync_reads": 7,
        "tokens": 11,
    }
    assert kv_cache_line(block) == (
        "kv cache: 11 tokens, device 336.00 KiB (peak 336.00 KiB), host 0 B (peak 0 B), staging 0 B (peak 0 B), "
        "device budget unlimited, blocks 4 on device / 0 on host, moved 1 blocks to host (3.00 MiB), "
        "12 to device (99.00 KiB), 2 freed, host reads 5 prefetched / 7 synchronous"
    )
    window = {
        "device_bytes": 0,
        "device_peak_bytes": 0,
        "host_bytes": 138240,
        "host_peak_bytes": 138240,
        "staging_peak_bytes": 34560,
        "budget_bytes": 0,
        "layers_on_host": 4,
        "new_counter_bytes": 2**30,
        "new_count": 3,
    }
    assert kv_cache_line(window) == (
        "kv cache: device 0 B (peak 0 B), host 135.00 KiB (peak 135.00 KiB), staging peak 33.75 KiB, "
        "device budget 0 B, 4 layers on host, new count 3, new counter bytes 1.00 GiB"
    )


@pytest.mark.parametrize(
    "term,kind", [("xterm-256color", "RichProgress"), ("dumb", "PlainProgress"), ("unknown", "PlainProgress")]
)
def test_pull_progress_on_a_dumb_terminal_is_plain_lines(term, kind, monkeypatch):
    """(rich draws no live bar on TERM=dumb: a pull showed nothing until it ended)"""
    from localdiff.hub.progress import make_progress

    monkeypatch.setenv("TERM", term)
    assert type(make_progress(stream=_Tty())).__name__ == kind


@pytest.fixture
def web_page():
    """http://127.0.0.1:PORT of a plain web server: 200 with an HTML page for GET and POST, except 404 at /missing/."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Page(BaseHTTPRequestHandler):
        def _page(self):
            code = 404 if self.path.startswith("/missing/") else 200
            body = b"<!DOCTYPE html>\n<html><body><h1>Welcome</h1>\n</body></html>\n"
            self.send_response(code)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _page

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_an_endpoint_that_is_a_web_page_is_one_clear_line(web_page, home, capsys):
    """(a 200 HTML page printed nothing and exited 0; an HTML error page was quoted tag by tag)"""
    assert main(["gen", "--endpoint", web_page, "-m", "m", "-p", "hi"]) == 1
    assert _err_lines(capsys) == [
        f"error: {web_page}/v1/chat/completions answered without server-sent events "
        "(content-type text/html): not an OpenAI-compatible API?"
    ]
    assert main(["gen", "--endpoint", web_page + "/missing/v1", "-p", "hi"]) == 1
    assert _err_lines(capsys) == [
        f"error: {web_page}/missing/v1 answered 404: Not Found (is this an OpenAI-compatible API?)"
    ]


def test_chat_and_serve_pass_load_flags_and_chat_refuses_kv_budget(ckpt, terminal, home, monkeypatch, capsys):
    """(chat and serve accepted --gpu-mem, --threads and --kv-budget and ignored them)"""
    import localdiff
    import localdiff.serve as serve_mod

    loads, served = [], []
    real = localdiff.load
    monkeypatch.setattr(localdiff, "load", lambda name, **kw: loads.append(kw) or real(name, device="cpu"))
    monkeypatch.setattr(serve_mod, "serve", lambda *a, **kw: served.append(kw) or 0)
    terminal.enter()
    assert main(["chat", "-m", str(ckpt), "--gpu-mem", "1GiB", "--threads", "2"]) == 0
    assert loads and loads[0]["gpu_mem"] == 2**30 and loads[0]["threads"] == 2
    assert main(["chat", "-m", str(ckpt), "--kv-budget", "1GiB"]) == 2
    assert main(["chat", "--endpoint", "http://127.0.0.1:1", "--gpu-mem", "1GiB"]) == 2
    assert main(["chat", "--endpoint", "http://127.0.0.1:1", "--device", "cpu"]) == 2
    assert main(["serve", "--gpu-mem", "2GiB", "--threads", "3"]) == 0
    assert served[0]["gpu_mem"] == 2 * 2**30 and served[0]["threads"] == 3
    assert served[0]["max_batch"] == 8 and served[0]["kv_budget"] is None  # batching on by default
    assert main(["serve", "--max-batch", "1", "--kv-budget", "1GiB"]) == 0
    assert served[1]["max_batch"] == 1 and served[1]["kv_budget"] == 2**30
    assert _err_lines(capsys) == [
        "error: --kv-budget: localdiff chat does not apply a KV-cache budget yet (gen does)",
        "error: --gpu-mem applies to local models, not to --endpoint",
        "error: --device applies to local models, not to --endpoint",
    ]
