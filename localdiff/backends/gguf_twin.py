"""Load a GGUF file under another llama.cpp architecture (``llama_model_init_from_user``): the file's metadata read
with ggml's GGUF reader, ``general.architecture`` and the ``<arch>.*`` keys renamed, the tensors' bytes copied from
the file into llama.cpp's buffers as it creates them. llama.cpp's metadata overrides cannot do this: the head and
FFN counts are read only from keys present in the file. Used by :mod:`localdiff.backends.gguf_window` (the masked
models' caches need the autoregressive twin's K/V memory). The twin holds its own copy of the weights in memory.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from pathlib import Path

from localdiff.backends.llama_lib import _LOG_TAIL, gpu_layers_value
from localdiff.errors import CheckpointError

# gguf_type
_U8, _I8, _U16, _I16, _U32, _I32, _F32, _BOOL, _STR, _ARR, _U64, _I64, _F64 = range(13)
_SCALAR = {
    _U8: ("u8", ctypes.c_uint8),
    _I8: ("i8", ctypes.c_int8),
    _U16: ("u16", ctypes.c_uint16),
    _I16: ("i16", ctypes.c_int16),
    _U32: ("u32", ctypes.c_uint32),
    _I32: ("i32", ctypes.c_int32),
    _F32: ("f32", ctypes.c_float),
    _BOOL: ("bool", ctypes.c_bool),
    _U64: ("u64", ctypes.c_uint64),
    _I64: ("i64", ctypes.c_int64),
    _F64: ("f64", ctypes.c_double),
}


class _InitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def _ggml():
    """libggml(-base) with the argument types of the functions used here."""
    from llama_cpp._ggml import libggml as g

    vp, i64, sz, cp = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t, ctypes.c_char_p
    sig = {
        "gguf_init_from_file": ([cp, _InitParams], vp),
        "gguf_free": ([vp], None),
        "gguf_get_n_kv": ([vp], i64),
        "gguf_get_key": ([vp, i64], cp),
        "gguf_get_kv_type": ([vp, i64], ctypes.c_int),
        "gguf_find_key": ([vp, cp], i64),
        "gguf_set_val_str": ([vp, cp, cp], None),
        "gguf_get_val_str": ([vp, i64], cp),
        "gguf_get_arr_type": ([vp, i64], ctypes.c_int),
        "gguf_get_arr_n": ([vp, i64], sz),
        "gguf_get_arr_data": ([vp, i64], vp),
        "gguf_set_arr_data": ([vp, cp, ctypes.c_int, vp, sz], None),
        "gguf_find_tensor": ([vp, cp], i64),
        "gguf_get_tensor_offset": ([vp, i64], sz),
        "gguf_get_data_offset": ([vp], sz),
        "ggml_get_name": ([vp], cp),
        "ggml_nbytes": ([vp], sz),
        "ggml_backend_tensor_set": ([vp, vp, sz, sz], None),
    }
    for name, (ctype, _) in _SCALAR.items():
        sig[f"gguf_get_val_{ctype}"] = ([vp, i64], _)
        sig[f"gguf_set_val_{ctype}"] = ([vp, cp, _], None)
    for name, (args, res) in sig.items():
        fn = getattr(g, name)
        fn.argtypes, fn.restype = args, res
    return g


class Twin:
    """A model loaded from ``path`` as architecture ``twin`` (its ``arch.*`` keys renamed ``twin.*``).

    Attributes: ``model`` (the llama.cpp model pointer). Raises CheckpointError quoting llama.cpp's last log line.
    """

    def __init__(self, lib, path: Path, arch: str, twin: str, gpu_layers=None):
        g = _ggml()
        self.lib, self.g = lib, g
        self.meta = g.gguf_init_from_file(str(path).encode(), _InitParams(True, None))
        if not self.meta:
            raise CheckpointError(f"{path}: ggml could not read the GGUF header")
        keys = [g.gguf_get_key(self.meta, i).decode() for i in range(g.gguf_get_n_kv(self.meta))]
        for k in keys:
            if k.startswith(arch + "."):
                self._copy(k, twin + k[len(arch) :])
        g.gguf_set_val_str(self.meta, b"general.architecture", twin.encode())
        base = g.gguf_get_data_offset(self.meta)
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

        missing = []

        def fill(tensor, _ud):
            name = g.ggml_get_name(tensor)
            i = g.gguf_find_tensor(self.meta, name)
            n = g.ggml_nbytes(tensor)
            if i >= 0:
                off = base + g.gguf_get_tensor_offset(self.meta, i)
                buf = ctypes.create_string_buffer(data[off : off + n], n)
            else:  # an optional tensor the file lacks, created anyway (F32): what its absence computes
                one = name.endswith((b"rope_freqs.weight", b"scale"))
                if not (one or name.endswith(b".bias")):
                    missing.append(name.decode())
                buf = ctypes.create_string_buffer(struct.pack("<f", 1.0) * (n // 4) if one else b"", n)
            g.ggml_backend_tensor_set(tensor, buf, 0, n)

        self._fill = lib.llama_model_set_tensor_data_t(fill)
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = gpu_layers_value(gpu_layers)
        _LOG_TAIL.clear()
        try:
            self.model = lib.llama_model_init_from_user(self.meta, self._fill, None, mp)
        finally:
            data.close()
        if not self.model or missing:
            why = (
                f"no tensor {sorted(set(m.split('.', 2)[-1] for m in missing))}"
                if missing
                else _LOG_TAIL[-1]
                if _LOG_TAIL
                else "llama.cpp could not load it"
            )
            self.close()
            raise CheckpointError(f"{path}: llama.cpp refused the file as {twin!r} ({why})")

    def _copy(self, src: str, dst: str) -> None:
        g, m = self.g, self.meta
        i = g.gguf_find_key(m, src.encode())
        t = g.gguf_get_kv_type(m, i)
        if t in _SCALAR:
            name = _SCALAR[t][0]
            getattr(g, f"gguf_set_val_{name}")(m, dst.encode(), getattr(g, f"gguf_get_val_{name}")(m, i))
        elif t == _STR:
            g.gguf_set_val_str(m, dst.encode(), g.gguf_get_val_str(m, i))
        elif t == _ARR and g.gguf_get_arr_type(m, i) in _SCALAR:
            g.gguf_set_arr_data(
                m, dst.encode(), g.gguf_get_arr_type(m, i), g.gguf_get_arr_data(m, i), g.gguf_get_arr_n(m, i)
            )

    def close(self) -> None:
        """Free the model and the metadata."""
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None
        if getattr(self, "meta", None):
            self.g.gguf_free(self.meta)
            self.meta = None
