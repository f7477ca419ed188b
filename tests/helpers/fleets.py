"""The failed entries scan tests put into their fleets, written one way: `write_failed(folder, kind, ...)`.

Each kind is one way an adapter fails to scan, under a fixed name, so a test names what it needs and reads
the error codes back (`FAILED_CODES`) instead of writing its own broken files.
"""

from __future__ import annotations

import os
from pathlib import Path

from lorafast.testing import write_safetensors

_TENSORS = {"lora_unet_x.lora_down.weight": ("F16", (4, 8)), "lora_unet_x.lora_up.weight": ("F16", (8, 4))}

#: kind -> the error code a scan reports for it (a bad config's row is its `adapter_config.json`)
FAILED_CODES = {
    "tiny": "header_too_small",  # two bytes: no room for the length prefix
    "zeros": "invalid_json",  # a zero length prefix: an empty header
    "not_safetensors": "header_too_large",  # text read as a length prefix
    "truncated": "incomplete_buffer",  # the data ends before the header says
    "bad_config": "invalid_config",  # adapter_config.json is not JSON
    "list_config": "invalid_config",  # adapter_config.json is a list
    "no_weights": "missing_weights",  # a config and no weights file
    "dangling": "dangling_link",
    "loop": "symlink_loop",
    "fifo": "not_regular_file",
    "locked": "permission_denied",  # mode 000 (not written as root, who reads it anyway)
}

#: kind -> the entry's name in the folder
NAMES = {
    "tiny": "tiny.safetensors",
    "zeros": "zeros.safetensors",
    "not_safetensors": "junk.safetensors",
    "truncated": "cut.safetensors",
    "bad_config": "bad-config",
    "list_config": "list-config",
    "no_weights": "no-weights",
    "dangling": "dangling.safetensors",
    "loop": "loop.safetensors",
    "fifo": "pipe.safetensors",
    "locked": "locked.safetensors",
}


def write_failed(folder: str | os.PathLike[str], *kinds: str) -> dict[str, Path]:
    """Write one failed entry of each kind into `folder`; returns kind -> its path (kinds not written as root:
    left out)."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for kind in kinds:
        path = root / NAMES[kind]
        if kind == "tiny":
            path.write_bytes(b"\x01\x00")
        elif kind == "zeros":
            path.write_bytes(b"\x00" * 20)
        elif kind == "not_safetensors":
            path.write_bytes(b"this is not a safetensors file at all")
        elif kind == "truncated":
            write_safetensors(path, _TENSORS)
            os.truncate(path, os.path.getsize(path) - 10)
        elif kind in ("bad_config", "list_config", "no_weights"):
            path.mkdir()
            config = {"bad_config": "{not json", "list_config": "[1, 2]", "no_weights": "{}"}[kind]
            (path / "adapter_config.json").write_text(config)
            if kind != "no_weights":
                write_safetensors(path / "adapter_model.safetensors", {"x.lora_A.weight": ("F32", (2, 4))})
        elif kind == "dangling":
            os.symlink("nowhere.safetensors", path)
        elif kind == "loop":
            os.symlink(path.name, path)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "locked":
            if os.geteuid() == 0:
                continue
            write_safetensors(path, _TENSORS)
            os.chmod(path, 0)
        else:
            raise ValueError(f"unknown failed entry kind {kind!r}")
        out[kind] = path
    return out
