"""``gen --endpoint``: a server that closes its event stream before ``data: [DONE]`` leaves the text shown and
ends with one error line and exit 1 (it printed the partial answer and exited 0)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli_fixtures import clear_user_settings
from localdiff.cli import main


def _chunk(text: str) -> bytes:
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    return f"data: {json.dumps(body)}\n\n".encode()


@pytest.fixture
def server(request):
    """A fake OpenAI-compatible server that streams two chunks, then ``[DONE]`` only if ``request.param``."""
    finish = request.param

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("connection", "close")
            self.end_headers()
            self.wfile.write(_chunk("Hello") + _chunk(" wor"))
            if finish:
                self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("server", [False], indirect=True)
def test_a_stream_cut_before_done_is_an_error_after_the_partial_text(server, tmp_path, monkeypatch, capsys):
    clear_user_settings(tmp_path, monkeypatch)
    rc = main(["gen", "--endpoint", server, "-m", "m", "-p", "hi", "-q"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert out == "Hello wor\n"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "closed the stream before it finished (no [DONE])" in lines[0] and "incomplete" in lines[0]


@pytest.mark.parametrize("server", [True], indirect=True)
def test_a_stream_with_done_still_ends_cleanly(server, tmp_path, monkeypatch, capsys):
    clear_user_settings(tmp_path, monkeypatch)
    assert main(["gen", "--endpoint", server, "-m", "m", "-p", "hi", "-q"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello wor\n" and err == ""
