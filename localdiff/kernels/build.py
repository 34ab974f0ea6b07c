"""The build-and-cache module of localdiff's native C kernels (``localdiff/kernels/*.c``): find the system C
compiler, build a source into a shared library in the user cache, keyed so a finished build is reused, load the
first flag set that compiles, and keep one loaded library and its status line per kernel (:class:`Kernel`).

It imports no localdiff module (``kernels`` is the lowest layer: tests/project/test_structure.py).

Build: ``$CC`` (else ``cc`` / ``gcc`` / ``clang`` on PATH) ``-O3 -march=native -fPIC -shared`` (without
``-march=native`` when the compiler refuses it) into ``platformdirs.user_cache_dir("localdiff")/native/<key>``, the
key hashing the source text, the compiler's path and version line, the flags and the CPU's feature flags.
Failures are RuntimeError with one line (the compiler's first error line); the callers turn them into a status line
and keep their torch kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

NO_COMPILER = "no C compiler (cc / gcc / clang) on PATH"

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
#: the fallback flag set: the same without ``-march=native`` (a compiler that refuses it; a portable build)
PORTABLE_FLAGS = tuple(f for f in FLAGS if f != "-march=native")
OFF = ("0", "false", "no", "off")


#: the C types the kernels' prototypes use, as ctypes declares them
_C_TYPES = {"void*": ctypes.c_void_p, "long": ctypes.c_long, "int": ctypes.c_int, "float": ctypes.c_float}


def declare(lib: ctypes.CDLL, *prototypes: str) -> ctypes.CDLL:
    """Set the ctypes signature of each exported function from its C prototype without argument names, e.g.
    ``"int localdiff_int8_mm(void*, long, long, long, void*, long, void*, int, void*, long, int)"`` (types:
    ``void*``, ``long``, ``int``, ``float``). Returns ``lib``.

    Raises:
        AttributeError: the library does not export a named function (an outdated build).
        KeyError: a type outside the four above.
    """
    for proto in prototypes:
        head, _, args = proto.rstrip(")").partition("(")
        ret, name = head.split()
        fn = getattr(lib, name)
        fn.restype = _C_TYPES[ret]
        fn.argtypes = [_C_TYPES[a.strip()] for a in args.split(",") if a.strip()]
    return lib


def compiler() -> str | None:
    """Path of the C compiler to use: ``$CC`` when it resolves, else cc / gcc / clang on PATH; None when none."""
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
    """``user_cache_dir("localdiff")/native``: where builds live."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("localdiff")) / "native"


def switched_off(env: str) -> bool:
    """Whether the environment variable ``env`` says 0 / false / no / off."""
    return os.environ.get(env, "1").strip().lower() in OFF


def build(
    source: Path,
    lib_name: str,
    cc: str,
    flags: tuple[str, ...] = FLAGS,
    out_dir: Path | None = None,
    cache: Path | None = None,
) -> Path:
    """Compile ``source`` with ``cc`` and ``flags`` into ``out_dir/lib_name`` (default: the keyed folder under
    ``cache``, itself defaulting to :func:`cache_dir`); returns the library's path (an existing build of the same key
    is reused; the file appears atomically, so concurrent processes see a whole library or none).

    Raises:
        RuntimeError: the compiler failed (message: its first error line) or timed out.
    """
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{cc} --version failed: {e}") from None
    version = version.splitlines()[0] if version else cc
    key = hashlib.sha256("\n".join([source.read_text(), cc, version, " ".join(flags), cpu_flags()]).encode())
    out_dir = out_dir or (cache or cache_dir()) / key.hexdigest()[:16]
    lib = out_dir / lib_name
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        r = subprocess.run(
            [cc, *flags, "-o", tmp, str(source), "-lpthread", "-lm"], capture_output=True, text=True, timeout=300
        )
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


def load_first(
    builder: Callable[[tuple[str, ...]], Path], loader: Callable[[Path], ctypes.CDLL]
) -> tuple[ctypes.CDLL, tuple[str, ...]]:
    """Build and load with :data:`FLAGS`, else without ``-march=native``; returns (library, the flags used).

    Args:
        builder: flags → library path (usually :func:`build` with its other arguments bound).
        loader: path → the loaded library with its ctypes signatures set (may raise OSError / AttributeError).
    Raises:
        RuntimeError: neither flag set gave a loadable library (message: the last error's first line).
    """
    err = ""
    for flags in (FLAGS, PORTABLE_FLAGS):
        try:
            return loader(builder(flags)), flags
        except (RuntimeError, OSError, AttributeError) as e:
            err = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise RuntimeError(err)


class Kernel:
    """One native kernel library, compiled on first use and loaded once per process; the kernel modules
    (:mod:`localdiff.kernels.int8`, ...) keep one each and expose its :meth:`library`, :meth:`status` and
    :meth:`reset`.

    Args:
        source: the ``.c`` file. lib_name: the shared library's file name.
        load: path → the loaded library with its ctypes signatures set (may raise OSError / AttributeError).
        ready: (library, compiler path, flags) → (the library to use or None, the status line).
        unavailable: why → the status line when it cannot run (no compiler, no flag set built).
        off: () → the status line when the user switched it off, else None (read on each first try).
        compiler: () → the compiler path or None (default: this module's :func:`compiler`, looked up on each try so
            that tests can patch it; a kernel module may pass its own name).
    """

    def __init__(
        self,
        source: Path,
        lib_name: str,
        load: Callable[[Path], ctypes.CDLL],
        ready: Callable[[ctypes.CDLL, str, tuple], tuple],
        unavailable: Callable[[str], str],
        off: Callable[[], str | None] = lambda: None,
        compiler: Callable[[], str | None] | None = None,
    ):
        self.source, self.lib_name, self.load, self.ready = source, lib_name, load, ready
        self.unavailable, self.off, self.compiler = unavailable, off, compiler
        self.lib: ctypes.CDLL | None = None
        self.line: str | None = None  # None = not tried yet

    def build(self, cc: str, flags: tuple[str, ...] = FLAGS, out_dir: Path | None = None) -> Path:
        """Compile the source with ``cc`` and ``flags`` (:func:`build`); returns the library's path.
        Raises RuntimeError (the compiler's first error line) when it fails."""
        return build(self.source, self.lib_name, cc, flags, out_dir, cache=cache_dir())

    def library(self) -> ctypes.CDLL | None:
        """The loaded library, built on the first call; None when off or unavailable (see :meth:`status`)."""
        if self.line is not None:
            return self.lib
        off = self.off()
        if off is not None:
            self.line = off
            return None
        cc = self.compiler() if self.compiler is not None else compiler()
        if cc is None:
            self.line = self.unavailable(NO_COMPILER)
            return None
        try:
            lib, flags = load_first(lambda f: self.build(cc, f), self.load)
        except RuntimeError as e:
            self.line = self.unavailable(str(e))
            return None
        self.lib, self.line = self.ready(lib, cc, flags)
        return self.lib

    def require(self) -> ctypes.CDLL:
        """The loaded library (the loaded one at once: a step calls this per matmul). Raises RuntimeError with
        :meth:`status`'s line when the kernel is off or unavailable."""
        lib = self.lib if self.lib is not None else self.library()
        if lib is None:
            raise RuntimeError(self.status())
        return lib

    def status(self) -> str:
        """One line: what runs, or why the kernel does not (builds it first if not tried yet)."""
        self.library()
        return self.line or ""

    def reset(self) -> None:
        """Forget the loaded library / failure (tests that change the environment)."""
        self.lib, self.line = None, None


def built_with(cc: str, flags: tuple[str, ...]) -> str:
    """``"cc -O3 -march=native"``: the compiler and the first two flags, for status lines."""
    return f"{Path(cc).name} {' '.join(flags[:2])}"
