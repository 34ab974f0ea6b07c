"""``localdiff serve`` answers only for the models it offers (issue 40 item 1): the names ``localdiff list`` shows and
the server's own ``-m`` models. A request naming a path — an existing folder, a missing one, ``~``, ``..``, a
percent-encoded spelling, a real checkpoint folder not given with ``-m`` — gets one 404 whose bytes do not depend on
the name or on the disk, and nothing is loaded. Also: DFlash drafts are not offered (item 7), ``stream_options``
needs a stream (item 8)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from servehelpers import Running

import localdiff
from localdiff.serve.names import NOT_OFFERED, ModelNames

ROOT = Path(__file__).resolve().parents[2]
OK = [{"role": "user", "content": "What is 1 + 2?"}]
TINY_DIR = ROOT / "models" / "tiny"  # a real checkpoint folder on the server's disk

# names a request might use to reach the disk: folders that exist, folders that do not, and encoded spellings
EXISTING = [
    "/etc",
    "/",
    "~",
    "..",
    ".",
    "/tmp",
    str(TINY_DIR),
    "models/tiny",
    "./models/tiny",
    "tests/../models/tiny",
    str(ROOT / "models"),
]
MISSING = ["/nonexistent", "~/no-such-folder-40", "../no-such-folder-40", "models/nope", "/etc/no-such-file-40"]
ENCODED = [
    "%2Fetc",
    "..%2F..%2Fetc",
    "%2e%2e%2f",
    "file:///etc",
    "~root",
    "/etc/passwd",
    "tiny/../../etc",
    "\\etc",
    "/etc/",
    "tiny-dflash",
    "qwen3:4b",
    "nobody/nothing",
    "TINY",
    " tiny",
]

ROUTES = [
    ("/v1/chat/completions", {"messages": OK}),
    ("/v1/completions", {"prompt": "1 2 3"}),
    ("/v1/chat/completions", {"messages": OK, "stream": True}),
    ("/api/chat", {"messages": OK, "stream": False}),
    ("/api/chat", {}),  # {}: a load request
    ("/api/generate", {"prompt": "1 2 3", "stream": False}),
    ("/api/generate", {"prompt": ""}),
    ("/api/generate", {"prompt": "1 2 3"}),
]


class Recorder:
    """The worker's loader: records every name it is asked for, then loads it on the CPU."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, name: str):
        self.calls.append(name)
        return localdiff.load(name, device="cpu")


@pytest.fixture(scope="module")
def plain():
    """A server as tests build it (the installed models and "tiny" offered), no model preloaded; (Running,
    Recorder)."""
    loads = Recorder()
    s = Running(model=None, loader=loads)
    yield s, loads
    s.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server without a preloaded model that offers the installed models and one ``-m`` folder (a copy of the
    embedded tiny-mdm); (Running, Recorder, the -m folder)."""
    own = tmp_path_factory.mktemp("own") / "my-mdm"
    shutil.copytree(ROOT / "models" / "tiny-mdm", own)
    loads = Recorder()
    s = Running(model=None, names=ModelNames([str(own)], "tiny"), loader=loads)
    yield s, loads, own
    s.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_a_path_or_unknown_name_is_one_404_the_same_bytes_and_nothing_loads(plain, monkeypatch):
    server, loads = plain
    monkeypatch.chdir(ROOT)  # relative names resolve against a folder that holds models/tiny
    assert all(Path(n).expanduser().exists() for n in EXISTING)
    assert not any(Path(n).expanduser().exists() for n in MISSING)
    client = httpx.Client(base_url=server.url, timeout=120)  # one connection for the ~250 requests
    for path, extra in ROUTES:
        bodies = set()
        for name in EXISTING + MISSING + ENCODED:
            r = client.post(path, json={"model": name, **extra})
            assert r.status_code == 404, (path, name, r.text)
            assert r.headers["content-type"] == "application/json"
            bodies.add(r.content)
        assert len(bodies) == 1, (path, bodies)  # byte-identical: the answer says nothing of the disk
        body = bodies.pop()
        if path.startswith("/api/"):
            assert body == b'{"error":"' + NOT_OFFERED.encode() + b'"}'
        else:
            assert r.json()["error"] == {
                "message": NOT_OFFERED,
                "type": "not_found_error",
                "param": "model",
                "code": "model_not_found",
            }
    for path in ("/api/show", "/api/pull", "/api/delete", "/api/embed", "/v1/embeddings"):  # no such routes here
        bodies = {client.post(path, json={"model": name, "name": name}).content for name in EXISTING + MISSING}
        assert len(bodies) == 1 and b"Not Found" in bodies.pop()
    client.close()
    assert loads.calls == [] and server.worker.model is None  # nothing was loaded, nothing is resident
    assert httpx.get(server.url + "/api/ps", timeout=10).json() == {"models": []}
    assert "Traceback" not in server.logs.text() and "could not load" not in server.logs.text()


def test_the_offered_models_and_only_they_are_listed_and_answer(served):
    server, loads, own = served
    listed = [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]
    tags = [m["name"] for m in httpx.get(server.url + "/api/tags", timeout=30).json()["models"]]
    assert listed[0] == str(own) and {"tiny", "tiny-mdm", "tiny-qwen3"} <= set(listed)
    assert sorted(tags) == sorted(listed)
    assert "tiny-dflash" not in listed and "tiny-dflash" not in tags  # a draft does not run alone (item 7)
    assert str(ROOT / "models" / "tiny-mdm") not in listed
    # the -m folder answers under its path; the installed models by name
    r = _post(
        server,
        "/api/generate",
        {"model": str(own), "prompt": "1 2 3", "raw": True, "stream": False, "options": {"seed": 0, "num_predict": 4}},
    )
    assert r.status_code == 200 and r.json()["model"] == str(own), r.text
    want = localdiff.load(str(own)).generate("1 2 3", max_new_tokens=4, seed=0, chat=False).text
    assert r.json()["response"] == want
    ps = httpx.get(server.url + "/api/ps", timeout=10).json()["models"]
    assert [m["name"] for m in ps] == [str(own)]
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": OK, "seed": 0, "max_tokens": 8})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    assert loads.calls == [str(own), "tiny"]
    # the same checkpoint by another spelling of its path (not the command line's) is still not offered
    for name in (str(own) + "/", str(own / ".."), f"{own.parent}/./{own.name}"):
        assert _post(server, "/v1/completions", {"model": name, "prompt": "x"}).status_code == 404
    assert loads.calls == [str(own), "tiny"]


def test_names_reads_no_file_for_a_request_and_lists_a_model_pulled_later(tmp_path):
    rows = [{"name": "tiny"}, {"name": "tiny-dflash", "draft": True}]
    listed = []

    def installed():
        listed.append(1)
        return list(rows)

    names = ModelNames([str(tmp_path)], "tiny", installed=installed, rescan_after=0.0)
    assert names.default == "tiny" and names.lookup("") == ""
    assert names.resolve(str(tmp_path)) == str(tmp_path) and names.resolve("tiny") == "tiny"
    with pytest.raises(Exception) as e:
        names.resolve("tiny-dflash")
    assert e.value.status == 404 and e.value.message == NOT_OFFERED
    rows.append({"name": "acme/new"})  # pulled while the server runs
    assert names.resolve("acme/new") == "acme/new"
    assert names.names() == [str(tmp_path), "tiny", "acme/new"]
    slow = ModelNames([], "tiny", installed=installed, rescan_after=3600.0)
    slow.rescan(force=True)
    n = len(listed)
    for _ in range(50):  # a burst of unknown names: no listing per request
        with pytest.raises(Exception):
            slow.resolve("/etc")
    assert len(listed) == n


def test_the_servers_own_loader_refuses_a_name_it_does_not_offer(monkeypatch):
    """The second lock: ``serve()``'s loader loads only offered names, whatever reaches it."""
    import localdiff.serve as serve_mod
    from localdiff.serve import worker as worker_mod

    made = {}

    class Stop(Exception):
        pass

    class FakeWorker:
        def __init__(self, loader, default, *a, **kw):
            made["loader"], made["default"] = loader, default
            raise Stop

    monkeypatch.setattr(worker_mod, "ModelWorker", FakeWorker)
    monkeypatch.setattr(serve_mod, "check_port", lambda host, port: None)
    with pytest.raises(Stop):
        serve_mod.serve(["tiny-mdm"], "tiny-mdm")
    loaded = []
    monkeypatch.setattr(localdiff, "load", lambda name, **kw: loaded.append(name) or name)
    assert made["default"] == "tiny-mdm" and made["loader"]("tiny-mdm") == "tiny-mdm"
    for name in ("/etc", str(TINY_DIR), "~"):
        with pytest.raises(Exception) as e:
            made["loader"](name)
        assert NOT_OFFERED in str(getattr(e.value, "message", e.value))
    assert loaded == ["tiny-mdm"]


@pytest.mark.parametrize(
    "body",
    [
        {"stream_options": {"include_usage": True}},
        {"stream_options": {"include_usage": True}, "stream": False},
        {"stream_options": {}, "stream": None},
    ],
)
@pytest.mark.parametrize(
    "path,extra", [("/v1/chat/completions", {"messages": OK}), ("/v1/completions", {"prompt": "1 2 3"})]
)
def test_stream_options_without_a_stream_is_a_400(plain, path, extra, body):
    server, _ = plain
    r = _post(server, path, {"model": "tiny", **extra, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    assert "stream" in r.json()["error"]["message"]
