"""Torch-free reading of a GGUF file's header: metadata key/values, tensor descriptors, and a completeness check.

The format (ggml ``docs/gguf.md``; llama.cpp ``ggml/src/gguf.cpp``): magic ``GGUF``, version (u32, 2 or 3), tensor
count and key/value count (u64), the key/values (string key, u32 type, value; arrays carry an element type and u64
count), the tensor descriptors (name, u32 n_dims, u64 dims, u32 ggml type, u64 offset relative to the data section),
padding to ``general.alignment`` (default 32), then the tensor data. Little-endian throughout.

``show``, ``list``, ``pull`` and the loader read files with this module, so they work without llama-cpp-python and
give one-line errors for a file that is not GGUF or is cut short (llama.cpp itself would print a log and return NULL).
What model a header describes (its config, family and caches) is :mod:`localdiff.backends.gguf_config`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from localdiff.errors import CheckpointError

MAGIC = b"GGUF"
#: ggml type id → (elements per block, bytes per block) — ggml.c ``type_traits``, as gguf-py ``GGML_QUANT_SIZES``
TYPE_SIZES = {
    0: (1, 4),
    1: (1, 2),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    9: (32, 40),
    10: (256, 84),
    11: (256, 110),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
    15: (256, 292),
    16: (256, 66),
    17: (256, 74),
    18: (256, 98),
    19: (256, 50),
    20: (32, 18),
    21: (256, 110),
    22: (256, 82),
    23: (256, 136),
    24: (1, 1),
    25: (1, 2),
    26: (1, 4),
    27: (1, 8),
    28: (1, 8),
    29: (256, 56),
    30: (1, 2),
    34: (256, 54),
    35: (256, 66),
    39: (32, 17),
}
#: ggml type id → name (``ggml_type``)
TYPE_NAMES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}
#: ``general.file_type`` (``llama_ftype``) → the quantization label used in file names and tags
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
#: arrays longer than this are kept as their length only (the vocabulary and merges: 100k+ strings)
_ARRAY_KEEP = 64


@dataclass(frozen=True)
class TensorInfo:
    """One tensor descriptor: ``name``, ``shape`` (ggml order: ne0 = the contiguous row length first), ggml
    ``type`` id, ``offset`` (bytes from the data section's start)."""

    name: str
    shape: tuple
    type: int
    offset: int

    @property
    def nbytes(self) -> int | None:
        """Bytes of the tensor's data, or None for a type this reader does not know."""
        if self.type not in TYPE_SIZES:
            return None
        block, size = TYPE_SIZES[self.type]
        n = 1
        for s in self.shape:
            n *= s
        return n // block * size


@dataclass
class GGUFHeader:
    """A parsed GGUF header. ``metadata``: key → value (long arrays as ``ArrayLen``), ``tensors``, ``data_start``
    (byte offset of the data section), ``file_size`` (bytes)."""

    path: Path
    version: int
    metadata: dict
    tensors: list = field(default_factory=list)
    data_start: int = 0
    file_size: int = 0

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` (e.g. "llada", "llada-moe", "dream", "llama")."""
        return self.metadata.get("general.architecture")

    def arch_key(self, name: str, default=None):
        """``<architecture>.<name>`` (e.g. ``llada.block_count``), or ``default``."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    @property
    def quant(self) -> str:
        """The file's quantization label: ``general.file_type`` when present, else the most common tensor type of
        the 2-D weights (e.g. "Q8_0", "Q4_K_M", "F32")."""
        ft = self.metadata.get("general.file_type")
        if isinstance(ft, int) and ft in FILE_TYPES:
            return FILE_TYPES[ft]
        counts: dict[int, int] = {}
        for t in self.tensors:
            if len(t.shape) >= 2:
                counts[t.type] = counts.get(t.type, 0) + 1
        return TYPE_NAMES.get(max(counts, key=counts.get), "?") if counts else "?"

    def data_end(self) -> int:
        """The byte offset one past the last tensor's data (known types only)."""
        ends = [self.data_start + t.offset + t.nbytes for t in self.tensors if t.nbytes is not None]
        return max(ends, default=self.data_start)


@dataclass(frozen=True)
class ArrayLen:
    """A long metadata array kept as its element ``type`` id and length ``n`` only."""

    type: int
    n: int


class _Reader:
    def __init__(self, f, path: Path, size: int):
        self.f, self.path, self.size = f, path, size

    def take(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise CheckpointError(
                f"{self.path}: truncated GGUF file (header ends early at byte {self.f.tell()} of {self.size})"
            )
        return b

    def scalar(self, t: int):
        fmt = _SCALARS[t]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar(10)
        if n > self.size:
            raise CheckpointError(
                f"{self.path}: corrupt GGUF header (a string of {n} bytes in a {self.size}-byte file)"
            )
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, t: int):
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.scalar(4), self.scalar(10)
            if n > self.size:
                raise CheckpointError(f"{self.path}: corrupt GGUF header (an array of {n} items)")
            if n > _ARRAY_KEEP:
                self.skip_array(et, n)
                return ArrayLen(et, n)
            return [self.value(et) for _ in range(n)]
        if t not in _SCALARS:
            raise CheckpointError(f"{self.path}: corrupt GGUF header (unknown value type {t})")
        return self.scalar(t)

    def skip_array(self, et: int, n: int) -> None:
        if et in _SCALARS:
            self.take(struct.calcsize(_SCALARS[et]) * n)
        else:
            for _ in range(n):
                self.value(et)


def read_header(path) -> GGUFHeader:
    """Parse ``path``'s GGUF header (metadata + tensor descriptors; the data is not read).

    Raises:
        CheckpointError: not a GGUF file (bad magic), an unsupported version, or a header cut short / corrupt.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        f = path.open("rb")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    with f:
        r = _Reader(f, path, size)
        if f.read(4) != MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (no 'GGUF' magic)")
        if size < 24:
            raise CheckpointError(f"{path}: truncated GGUF file ({size} bytes, shorter than its header)")
        version = r.scalar(4)
        if version not in (2, 3):
            raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = r.scalar(10), r.scalar(10)
        if n_tensors > size or n_kv > size:
            raise CheckpointError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
        meta = {}
        for _ in range(n_kv):
            key = r.string()
            meta[key] = r.value(r.scalar(4))
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            nd = r.scalar(4)
            if nd > 8:
                raise CheckpointError(f"{path}: corrupt GGUF header (tensor {name!r} has {nd} dimensions)")
            shape = tuple(r.scalar(10) for _ in range(nd))
            tensors.append(TensorInfo(name, shape, r.scalar(4), r.scalar(10)))
        align = int(meta.get("general.alignment", 32) or 32)
        pos = f.tell()
        start = (pos + align - 1) // align * align
    return GGUFHeader(path, version, meta, tensors, start, size)


def check_complete(h: GGUFHeader) -> None:
    """Raise CheckpointError (one line) when the file is shorter than its tensors' data (a cut download)."""
    end = h.data_end()
    if end > h.file_size:
        raise CheckpointError(
            f"{h.path}: truncated GGUF file ({h.file_size} bytes, its tensors need {end}); "
            "download it again (localdiff pull resumes)"
        )


def is_gguf(path) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False
