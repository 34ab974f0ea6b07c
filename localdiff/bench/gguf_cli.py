"""llama.cpp's own diffusion sampling loop for the ``gguf`` bench section, from the llama.cpp that llama-cpp-python
vendors in its sdist — the same llama.cpp our gguf backend calls:

* :func:`build_cli` / :func:`run_cli` — the ``llama-diffusion-cli`` program itself (``examples/diffusion``), built
  by cmake from the vendored source with its own libllama / ggml / llama-common (the wheel's flags, ``GGML_NATIVE=OFF``,
  Release) into the bench cache, once. The bench uses it. The first build compiles ~140 units (30-60 minutes on one
  loaded core), so it is not part of CI's tests.
* :func:`build` / :func:`run` — ``examples/diffusion/diffusion.cpp`` (``diffusion_generate``) compiled unchanged with
  a small driver (``gguf_driver.cpp``) in place of ``diffusion-cli.cpp``'s argument parsing, linked against the
  installed wheel's ``libllama`` / ``libggml`` (~15 s to build): token ids in and out, CPU time of the call. CI's
  test of the loop's tokens against ours uses it; so can token-level comparisons.

Both cache under the user cache dir (``$LOCALDIFF_BENCH_CACHE`` overrides), keyed by the sdist version. The sdist:
``$LOCALDIFF_LLAMA_CPP_SDIST`` (a ``.tar.gz`` or an unpacked folder), else ``pip download
llama-cpp-python==<installed version> --no-binary :all: --no-deps``. Builds run at ``nice 19`` pinned to CPU 0.

Timing: ``diffusion_generate`` logs ``total time: X ms`` (model load and tokenization excluded).
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


class CliUnavailable(LocaldiffError):
    """The example program cannot be built here (no compiler / cmake / sdist): the bench skips with this line."""


def _cache_root() -> Path:
    import platformdirs

    return Path(os.environ.get("LOCALDIFF_BENCH_CACHE") or platformdirs.user_cache_dir("localdiff")) / "llama-cli"


def _sdist(version: str, work: Path) -> Path:
    """The unpacked sdist folder (containing ``vendor/llama.cpp``), unpacked under ``work / "src"``."""
    src = os.environ.get("LOCALDIFF_LLAMA_CPP_SDIST")
    if src and Path(src).is_dir():
        return Path(src)
    if not src:
        work.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"llama-cpp-python=={version}",
                "--no-binary",
                ":all:",
                "--no-deps",
                "-d",
                str(work),
                "-q",
            ],
            capture_output=True,
            text=True,
        )
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
    """(path of the built driver, a description of how). Cached; builds when absent.

    Raises:
        CliUnavailable: no C++ compiler, no sdist, no llama-cpp-python library, or the build failed (its first error
            line quoted).
    """
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise CliUnavailable("no C++ compiler (c++ / g++ / clang++) on PATH: cannot build llama.cpp's diffusion loop")
    try:
        import llama_cpp
    except ImportError:
        raise CliUnavailable('llama-cpp-python is not installed (pip install "localdiff[gguf]")') from None
    lib = Path(llama_cpp.__file__).parent / "lib"
    if not (lib / "libllama.so").is_file():
        raise CliUnavailable(f"{lib}: no libllama.so to link the driver against")
    stamp = int((lib / "libllama.so").stat().st_mtime)
    import hashlib

    drv = hashlib.sha1(Path(__file__).with_name("gguf_driver.cpp").read_bytes()).hexdigest()[:8]
    work = _cache_root() / f"{version}-{stamp}-{drv}"
    exe = work / "llama-diffusion-driver"
    how = f"diffusion.cpp of llama-cpp-python {version}'s vendored llama.cpp + gguf_driver.cpp, c++ -O2, {lib}"
    if exe.is_file():
        return exe, how
    src = _sdist(version, work) / "vendor" / "llama.cpp"
    log(f"gguf: compiling llama.cpp's diffusion loop ({src / 'examples' / 'diffusion' / 'diffusion.cpp'})")
    pin = ["nice", "-n", "19"] + (["taskset", "-c", "0"] if shutil.which("taskset") else [])
    cmd = [
        *pin,
        cxx,
        "-O2",
        "-std=c++17",
        f"-I{src / 'include'}",
        f"-I{src / 'ggml' / 'include'}",
        f"-I{src / 'common'}",
        f"-I{src / 'examples' / 'diffusion'}",
        str(src / "examples" / "diffusion" / "diffusion.cpp"),
        str(Path(__file__).with_name("gguf_driver.cpp")),
        f"-L{lib}",
        "-lllama",
        "-lggml",
        "-lggml-base",
        f"-Wl,-rpath,{lib}",
        "-o",
        str(exe),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not exe.is_file():
        err = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[-200:] or "?")
        raise CliUnavailable(f"compiling llama.cpp's diffusion loop failed: {err[:200]}")
    return exe, how


def run(
    exe: Path,
    gguf: Path,
    ids: list[int],
    max_length: int,
    steps: int,
    threads: int,
    block_length: int | None = None,
    eps: float = 1e-3,
    algorithm: int = 4,
    top_k: int = 1,
    seed: int = 0,
) -> dict:
    """One generation by llama.cpp's loop: prompt ``ids`` then masks up to ``max_length``; ``block_length`` (LLaDA's
    block schedule) or ``eps`` (Dream's timestep schedule); ``algorithm`` 4 = confidence-based; temperature 0 as
    ``--temp 0`` (the loop then still samples from the top-k / top-p 0.95 softmax with its ``dist`` sampler:
    ``top_k`` = 1 is greedy, its confidence then 1 everywhere, so positions go left to right).

    Returns:
        {"ms": generation wall ms (its log), "cpu_ms": the process's CPU ms over the same call, "ids": the generated
        ids (max_length − len(ids))}.
    Raises:
        LocaldiffError: the program failed.
    """
    cmd = [
        str(exe),
        str(gguf),
        str(threads),
        str(max_length),
        str(steps),
        str(block_length or 0),
        str(eps),
        str(algorithm),
        str(top_k),
        str(seed),
    ]
    r = subprocess.run(cmd, input=" ".join(map(str, ids)), capture_output=True, text=True)
    m = re.search(r"total time:\s*([0-9.]+)\s*ms", r.stderr)
    cpu = re.search(r"cpu time:\s*([0-9.]+)\s*ms", r.stderr)
    if r.returncode != 0 or not m or not cpu:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise LocaldiffError(f"llama.cpp's diffusion loop failed (exit {r.returncode}): {tail[:200]}")
    return {"ms": float(m.group(1)), "cpu_ms": float(cpu.group(1)), "ids": [int(x) for x in r.stdout.split()]}


#: the vendored llama.cpp configured as llama-cpp-python builds its wheel (``CMakeLists.txt`` of the sdist: shared
#: libraries, llama-common on, curl off; ``GGML_NATIVE=OFF`` as our wheel), plus the examples, Release
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


def build_cli(version: str, log=print) -> tuple[Path, str]:
    """llama.cpp's own ``llama-diffusion-cli`` program (``examples/diffusion/diffusion-cli.cpp``), built from the
    vendored llama.cpp of the llama-cpp-python ``version`` sdist with its own libllama / ggml / llama-common
    (:data:`CMAKE_FLAGS`; ``cmake --build --target llama-diffusion-cli -j1`` at ``nice 19`` pinned to CPU 0). Cached
    under the bench cache (``cmake-<version>/``, reused by later runs; the build time is kept in
    ``build-seconds.txt``). The first build compiles ~140 units: 30-60 minutes on one loaded core.

    Returns:
        (the program, a description of how it was built).
    Raises:
        CliUnavailable: no cmake / C++ compiler / sdist, or the build failed (its log's first error line quoted).
    """
    import time

    cmake, cxx = shutil.which("cmake"), shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cmake is None or cxx is None:
        raise CliUnavailable(
            f"no {'cmake' if cmake is None else 'C++ compiler'} on PATH: cannot build llama.cpp's llama-diffusion-cli"
        )
    work = _cache_root() / f"cmake-{version}"
    exe = work / "build" / "bin" / "llama-diffusion-cli"
    secs = work / "build-seconds.txt"

    def how():
        took = f", built in {float(secs.read_text()) / 60:.0f} min" if secs.is_file() else ""
        return f"llama-diffusion-cli of llama-cpp-python {version}'s vendored llama.cpp (cmake {' '.join(CMAKE_FLAGS)}{took})"

    if exe.is_file():
        return exe, how()
    src = (_sdist(version, work) / "vendor" / "llama.cpp").resolve()
    pin = ["nice", "-n", "19"] + (["taskset", "-c", "0"] if shutil.which("taskset") else [])
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    log(f"gguf: building llama.cpp's llama-diffusion-cli from {src} (once; 30-60 min on one core)")
    t0 = time.monotonic()
    with open(work / "build.log", "w") as out:
        for cmd in (
            [*pin, cmake, "-S", str(src), "-B", str(work / "build"), *gen, *CMAKE_FLAGS],
            [*pin, cmake, "--build", str(work / "build"), "--target", "llama-diffusion-cli", "-j1"],
        ):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                break
    if not exe.is_file():
        text = (work / "build.log").read_text(errors="replace").splitlines()
        err = next((ln for ln in text if "error" in ln.lower()), text[-1] if text else "?")
        raise CliUnavailable(f"building llama-diffusion-cli failed: {err.strip()[:200]}")
    secs.write_text(f"{time.monotonic() - t0:.0f}")
    return exe, how()


def run_cli(
    exe: Path,
    gguf: Path,
    prompt: str,
    max_length: int,
    steps: int,
    threads: int,
    block_length: int | None = None,
    eps: float = 1e-3,
    algorithm: int = 4,
    top_k: int = 1,
    seed: int = 0,
) -> dict:
    """One generation by ``llama-diffusion-cli`` itself: ``prompt`` is the user message (the program renders the
    GGUF's chat template and tokenizes it); ``-ub`` / ``-b`` / ``-c`` = ``max_length`` (its canvas: prompt + masks),
    ``--temp 0``, ``--top-k``, ``--seed``, ``-fa off``, ``--diffusion-steps`` / ``-algorithm`` and
    ``--diffusion-block-length`` or ``--diffusion-eps`` (the timestep schedule), ``-t`` threads.

    Returns:
        {"ms": diffusion_generate's own "total time" (ms), "cpu_ms": the whole process's CPU ms (load and
        tokenization included), "text": the answer it prints (special tokens not rendered)}.
    Raises:
        LocaldiffError: the program failed.
    """
    import resource

    n = str(max_length)
    cmd = [
        str(exe),
        "-m",
        str(gguf),
        "-p",
        prompt,
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        n,
        "-b",
        n,
        "-ub",
        n,
        "--temp",
        "0",
        "--top-k",
        str(top_k),
        "--seed",
        str(seed),
        "-fa",
        "off",
        "-ngl",
        "0",
        "--diffusion-steps",
        str(steps),
        "--diffusion-algorithm",
        str(algorithm),
    ]
    cmd += ["--diffusion-block-length", str(block_length)] if block_length else ["--diffusion-eps", str(eps)]
    for _ in range(3):  # its log is written by a worker thread: at exit the last lines are sometimes lost (seen
        before = resource.getrusage(resource.RUSAGE_CHILDREN)  # on a loaded core): run it again then
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = 1e3 * (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        out = r.stderr if "total time:" in r.stderr else r.stdout  # its log (timings, then the answer): stderr
        m = re.search(r"total time:\s*([0-9.]+)\s*ms[^\n]*\n", out)
        if r.returncode != 0 or (m and out[m.end() :].strip()):
            break
    if r.returncode != 0 or not m:
        tail = ((r.stderr + r.stdout).strip().splitlines() or ["?"])[-1]
        raise LocaldiffError(f"llama-diffusion-cli failed (exit {r.returncode}): {tail[:200]}")
    # after the timing line: LOG_INF("\n%s\n", answer), the log's "0.00.273.081 I " prefix on its first line
    text = re.sub(r"^\s*\d+\.\d+\.\d+\.\d+ [A-Z] ", "", out[m.end() :])
    return {"ms": float(m.group(1)), "cpu_ms": cpu, "text": text.strip()}
