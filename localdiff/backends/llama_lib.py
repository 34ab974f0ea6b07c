"""llama.cpp through llama-cpp-python, set up once for every GGUF module: the library (logging kept off the terminal,
its last error lines kept for our one-line messages), its version line, model loading with localdiff's settings and
the ``--gpu-layers`` value."""

from __future__ import annotations

import ctypes

from localdiff.errors import CheckpointError, LocaldiffError, UsageError

EXTRA_HINT = 'GGUF models need the gguf extra: pip install "localdiff[gguf]"'


class BackendMissingError(LocaldiffError):
    """The optional backend's package is not installed (the message names the extra)."""


_LIB = None
GROW = 64  # contexts are sized to the sequence rounded up to this many tokens (never shrunk)
_LOG_TAIL: list[str] = []


def llama_cpp():
    """The ``llama_cpp`` module, initialised once (backend init, llama.cpp's log kept off the terminal: its last
    error lines are kept for our one-line messages). Raises BackendMissingError naming the extra."""
    global _LIB
    if _LIB is not None:
        return _LIB
    try:
        import llama_cpp as lib

        if getattr(lib, "__file__", None) is None:  # a folder named llama_cpp on sys.path, not the package
            raise ImportError
    except ImportError:
        raise BackendMissingError(EXTRA_HINT) from None
    except OSError as e:  # the package is there, its shared library is not loadable
        raise BackendMissingError(
            f"llama-cpp-python is installed but cannot load its library ({e}); "
            f'reinstall the gguf extra: pip install "localdiff[gguf]"'
        ) from None

    @lib.llama_log_callback
    def _log(level, text, user_data):
        if level < 3:  # ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
            return
        _LOG_TAIL.append(text.decode("utf-8", "replace").strip())
        del _LOG_TAIL[:-8]

    lib._localdiff_log = _log  # keep the callback alive
    lib.llama_log_set(_log, ctypes.c_void_p(0))
    lib.llama_backend_init()
    _LIB = lib
    return lib


def version() -> str:
    """ "llama-cpp-python X (ggml V, commit C)" — the backend's identity for ``gen -v`` and ``bench``."""
    lib = llama_cpp()
    out = f"llama-cpp-python {getattr(lib, '__version__', '?')}"
    try:
        from llama_cpp._ggml import libggml

        for fn in ("ggml_version", "ggml_commit"):
            getattr(libggml, fn).restype = ctypes.c_char_p
        out += f" (ggml {libggml.ggml_version().decode()}, commit {libggml.ggml_commit().decode()})"
    except Exception:  # an older build without these symbols
        pass
    return out


def gpu_layers_value(gpu_layers) -> int:
    """``n_gpu_layers`` for llama.cpp: None = every layer when this llama-cpp-python build can offload (Metal /
    CUDA), else 0; "all" = every layer (-1); an int ≥ 0 as given. Raises UsageError for anything else."""
    if gpu_layers is None:
        return -1 if llama_cpp().llama_supports_gpu_offload() else 0
    if str(gpu_layers).strip().lower() == "all":
        return -1
    try:
        n = int(gpu_layers)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise UsageError(f"--gpu-layers: a number of layers >= 0 or 'all' (got {gpu_layers!r})")
    return n


def load_model(lib, path, gpu_layers=None, overrides: dict | None = None):
    """``llama_model_load_from_file`` with localdiff's settings: ``n_gpu_layers`` from :func:`gpu_layers_value`, no
    extra (AMX / repacked) weight buffers — with a native build on an AMX CPU (llama-cpp-python 0.3.36) batches of
    more than one token segfault in them — and metadata ``overrides`` (key → int / float / bool / str; llama.cpp's
    ``kv_overrides``). Returns the model pointer. Raises CheckpointError quoting llama.cpp's last log line."""
    mp = lib.llama_model_default_params()
    mp.n_gpu_layers = gpu_layers_value(gpu_layers)
    if hasattr(mp, "use_extra_bufts"):
        mp.use_extra_bufts = False
    arr = None
    if overrides:
        arr = (lib.llama_model_kv_override * (len(overrides) + 1))()  # zeroed: the last one ends the list
        for o, (k, v) in zip(arr, overrides.items()):
            o.key = k.encode()
            if isinstance(v, bool):
                o.tag, o.value.val_bool = lib.LLAMA_KV_OVERRIDE_TYPE_BOOL, v
            elif isinstance(v, int):
                o.tag, o.value.val_i64 = lib.LLAMA_KV_OVERRIDE_TYPE_INT, v
            elif isinstance(v, float):
                o.tag, o.value.val_f64 = lib.LLAMA_KV_OVERRIDE_TYPE_FLOAT, v
            else:
                o.tag, o.value.val_str = lib.LLAMA_KV_OVERRIDE_TYPE_STR, str(v).encode()
        mp.kv_overrides = ctypes.cast(arr, ctypes.POINTER(lib.llama_model_kv_override))
    _LOG_TAIL.clear()
    model = lib.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        why = _LOG_TAIL[-1] if _LOG_TAIL else "llama.cpp could not load it"
        raise CheckpointError(f"{path}: llama.cpp refused the file ({why})")
    return model
