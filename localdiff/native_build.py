"""Compile-on-first-use for localdiff's small native C kernels (``quantize/native_int8.c``,
``decoding/native_vocab.c``), loaded with ctypes by their modules.

Build: ``$CC`` (else ``cc`` / ``gcc`` / ``clang`` on PATH) with the caller's flags (``-O3 -march=native -fPIC
-shared``, retried without ``-march=native`` when the compiler refuses it) into the user cache dir
(``platformdirs.user_cache_dir("localdiff")/native/<key>``), keyed by the source's text, the compiler and its version
line, the flags and the CPU's feature flags; a finished build is reused, and a build is written atomically (a
concurrent process sees a whole library or none).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
PORTABLE_FLAGS = tuple(f for f in FLAGS if f != "-march=native")


def compiler() -> str | None:
    """Path of the C compiler to use (``$CC`` when it exists, else cc / gcc / clang on PATH), or None."""
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cpu_flags() -> str:
    """The CPU's feature-flag line from /proc/cpuinfo (else platform strings): part of the build key."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() + platform.machine()


def cache_dir() -> Path:
    """Folder holding the keyed builds."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("localdiff")) / "native"


def build(source: Path, lib_name: str, cc: str, flags: tuple[str, ...] = FLAGS, out_dir: Path | None = None) -> Path:
    """Compile C ``source`` with ``cc`` and ``flags`` (linked with pthread and libm) into ``out_dir/lib_name``
    (default folder: the keyed cache folder); returns the shared library's path (an existing build of the same key
    is reused).

    Raises:
        RuntimeError: the compiler failed (message: its first error line) or timed out.
    """
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{cc} --version failed: {e}") from None
    version = version.splitlines()[0] if version else cc
    key = hashlib.sha256("\n".join([source.read_text(), cc, version, " ".join(flags), cpu_flags()]).encode())
    out_dir = out_dir or cache_dir() / key.hexdigest()[:16]
    lib = out_dir / lib_name
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lpthread", "-lm"], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            err = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[:200] or "failed")
            raise RuntimeError(f"{Path(cc).name} {' '.join(flags)}: {err.strip()}")
        os.replace(tmp, lib)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{Path(cc).name} timed out") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib
