"""llama.cpp's own diffusion front end for the ``gguf`` bench section: ``llama-diffusion-cli``
(``examples/diffusion/diffusion-cli.cpp`` + ``diffusion.cpp``), built from the llama.cpp that llama-cpp-python
vendors in its sdist — the same llama.cpp our gguf backend calls — and run on the same GGUF file.

Build (once, cached under the user cache dir, keyed by the sdist's version and the cmake flags): only the
``llama-diffusion-cli`` target, at ``nice 19``, pinned to CPU 0, one compile job (this machine's second core is
someone else's). The sdist comes from ``$LOCALDIFF_LLAMA_CPP_SDIST`` (a ``.tar.gz`` or an unpacked folder), else
``pip download llama-cpp-python==<installed version> --no-binary :all: --no-deps``. Flags: ``$LOCALDIFF_LLAMA_CMAKE_ARGS``
(default ``-DGGML_NATIVE=OFF``, as the wheel here was built), plus curl / tests / server off.

Timing: the program logs ``total time: X ms`` for ``diffusion_generate`` (model load and tokenization excluded),
which is what we compare with our in-process generation time.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from localdiff.errors import LocaldiffError

TARGET = "llama-diffusion-cli"


class CliUnavailable(LocaldiffError):
    """The example program cannot be built here (no compiler / cmake / sdist): the bench skips with this line."""


def _cache_root() -> Path:
    import platformdirs

    return Path(os.environ.get("LOCALDIFF_BENCH_CACHE") or platformdirs.user_cache_dir("localdiff")) / "llama-cli"


def _sdist(version: str, work: Path) -> Path:
    """The unpacked sdist folder (containing ``vendor/llama.cpp``)."""
    src = os.environ.get("LOCALDIFF_LLAMA_CPP_SDIST")
    if src and Path(src).is_dir():
        return Path(src)
    if not src:
        work.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary",
                            ":all:", "--no-deps", "-d", str(work), "-q"], capture_output=True, text=True)
        hits = sorted(work.glob("llama_cpp_python-*.tar.gz"))
        if r.returncode != 0 or not hits:
            raise CliUnavailable(f"cannot get the llama-cpp-python {version} sdist (set LOCALDIFF_LLAMA_CPP_SDIST)")
        src = str(hits[0])
    out = work / "src"
    if not (out / "done").is_file():
        shutil.rmtree(out, ignore_errors=True)
        with tarfile.open(src) as t:
            t.extractall(out, filter="data")
        (out / "done").write_text("")
    return next(p for p in out.iterdir() if (p / "vendor" / "llama.cpp").is_dir())


def build(version: str, log=print) -> tuple[Path, str]:
    """(path of the built ``llama-diffusion-cli``, the cmake flags used). Cached; builds when absent.

    Raises:
        CliUnavailable: no C++ compiler or cmake, no sdist, or the build failed (its last output line quoted).
    """
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise CliUnavailable(f"no {tool} on PATH: cannot build llama.cpp's {TARGET}")
    flags = os.environ.get("LOCALDIFF_LLAMA_CMAKE_ARGS", "-DGGML_NATIVE=OFF").split()
    key = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{version}-{'-'.join(flags)}")
    work = _cache_root() / key
    exe = work / "build" / "bin" / TARGET
    if exe.is_file():
        return exe, " ".join(flags)
    src = _sdist(version, work) / "vendor" / "llama.cpp"
    log(f"gguf: building {TARGET} from {src} (once; nice 19, CPU 0, one job)")
    pin = ["nice", "-n", "19"] + (["taskset", "-c", "0"] if shutil.which("taskset") else [])
    cfg = [*pin, "cmake", "-S", str(src), "-B", str(work / "build"), "-DCMAKE_BUILD_TYPE=Release",
           "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
           "-DLLAMA_BUILD_EXAMPLES=ON", "-DBUILD_SHARED_LIBS=OFF", *flags]
    for cmd in (cfg, [*pin, "cmake", "--build", str(work / "build"), "--target", TARGET, "-j", "1"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["?"]
            raise CliUnavailable(f"building {TARGET} failed: {tail[0][:200]}")
    if not exe.is_file():
        raise CliUnavailable(f"{TARGET} was not produced by the build")
    return exe, " ".join(flags)


def run(exe: Path, gguf: Path, prompt: str, n_ctx: int, steps: int, threads: int, block_length: int | None = None,
        eps: float | None = None, algorithm: int = 4, seed: int = 0, top_k: int = 1) -> dict:
    """One ``llama-diffusion-cli`` generation: ``--temp 0`` (the program then still samples from the top-k softmax
    with its ``dist`` sampler: ``top_k`` = 1 makes it greedy, its confidence then 1 everywhere), ``n_ctx`` = n_ubatch = prompt + answer tokens (the
    program's max_length), ``--diffusion-block-length`` (LLaDA schedule) or ``--diffusion-eps`` (Dream's).

    Returns:
        {"ms": total generation ms (its log), "text": the answer, "seconds_wall": process wall time}.
    Raises:
        LocaldiffError: the program failed.
    """
    import time

    cmd = [str(exe), "-m", str(gguf), "-p", prompt, "-c", str(n_ctx), "-b", str(n_ctx), "-ub", str(n_ctx),
           "-t", str(threads), "-tb", str(threads), "--diffusion-steps", str(steps), "--temp", "0", "--top-k", str(top_k), "-fa", "off",
           "--diffusion-algorithm", str(algorithm), "--seed", str(seed)]
    cmd += ["--diffusion-block-length", str(block_length)] if block_length else ["--diffusion-eps", str(eps or 1e-3)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    m = re.search(r"total time:\s*([0-9.]+)\s*ms", r.stderr + r.stdout)
    if r.returncode != 0 or not m:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise LocaldiffError(f"{TARGET} failed (exit {r.returncode}): {tail[:200]}")
    text = (r.stderr + r.stdout)[m.end():].strip()
    return {"ms": float(m.group(1)), "text": text, "seconds_wall": wall}
