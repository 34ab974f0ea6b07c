"""Writing the chat's choices back to the user config file (``localdiff config path``), so they outlive a restart.

``/set`` values go where ``localdiff.config`` reads them: ``seed`` and ``max_new_tokens`` at the top level, sampler
options in the ``[sampler]`` table; the theme (ctrl+t) is the top-level ``theme``. The file is edited with tomlkit,
so the user's comments and layout stay, and replaced atomically (a crash leaves the old file or the new one).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from localdiff.errors import UsageError

TOP_LEVEL = ("seed", "max_new_tokens", "theme")


def save_settings(path: str | os.PathLike, values: dict) -> None:
    """Set (or, for a None value, remove) keys in the TOML config file at ``path``; other content is kept.

    Args:
        path: the config file; created with its folder when missing.
        values: key → value; ``TOP_LEVEL`` names go to the top level, any other key (a decoder option, already
            checked by ``/set``; ``localdiff.config`` checks it again on reading) to the ``[sampler]`` table.
    Raises:
        UsageError: the file cannot be read, parsed or written (one line naming the file).
    """
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    path = Path(path)
    try:
        doc = tomlkit.parse(path.read_text(encoding="utf-8")) if path.is_file() else tomlkit.document()
    except (OSError, UnicodeDecodeError, TOMLKitError) as exc:
        raise UsageError(f"cannot update {path}: {exc}") from None
    for key, value in values.items():
        if key in TOP_LEVEL:
            table = doc
        else:
            if "sampler" not in doc:
                if value is None:
                    continue
                doc["sampler"] = tomlkit.table()
            table = doc["sampler"]
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value
    if "sampler" in doc and not doc["sampler"]:
        del doc["sampler"]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".toml", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(tomlkit.dumps(doc))
        os.replace(tmp, path)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc}") from None
