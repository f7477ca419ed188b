"""Type stubs for the compiled core (rust/py.rs). Use the typed wrappers in `lorafast` instead."""

from typing import Any, final

import numpy as np

__all__ = [
    "ADAPTER_ERROR_CODES",
    "DTYPES",
    "FLAGS",
    "FORMATS",
    "HEADER_ERROR_CODES",
    "MODULE_KINDS",
    "MOE_LAYOUTS",
    "PROBLEM_CODES",
    "TORCH_ERROR_CODES",
    "__version__",
    "MappedFile",
    "ScanResult",
    "_debug_panic_on",
    "assemble",
    "build_profile",
    "discover",
    "discover_target_stats",
    "discover_targets",
    "inspect",
    "inspect_many",
    "map_file",
    "read_header",
    "read_torch_header",
    "read_url_range",
    "scan",
    "scan_targets",
]

# The code lists, each in documentation order, from the enums of rust/codes.rs (`ALL`) and rust/classify.rs.
HEADER_ERROR_CODES: tuple[str, ...]
ADAPTER_ERROR_CODES: tuple[str, ...]
TORCH_ERROR_CODES: tuple[str, ...]
#: Every code an adapter's `problems` can carry.
PROBLEM_CODES: tuple[str, ...]
#: Bit i of the `flags` column is FLAGS[i].
FLAGS: tuple[str, ...]
FORMATS: tuple[str, ...]
MOE_LAYOUTS: tuple[str, ...]
MODULE_KINDS: tuple[str, ...]
__version__: str
DTYPES: tuple[str, ...]
build_profile: str

def read_header(path: str, mode: str = "pread") -> dict[str, Any]: ...
def read_torch_header(path: str) -> dict[str, Any]: ...

_StorageOptions = list[tuple[str, str]] | None

def read_url_range(
    url: str, start: int, end: int, storage_options: _StorageOptions = None, timeout: float | None = None
) -> tuple[bytes, int]: ...

#: (path, weights, config, error code, error message) of one discovered adapter.
_TargetItem = tuple[str, str | None, str | None, str | None, str | None]

def inspect(
    path: str,
    mode: str = "pread",
    content_hash: bool = False,
    storage_options: _StorageOptions = None,
    timeout: float | None = None,
) -> dict[str, Any]: ...
def inspect_many(
    paths: list[str],
    mode: str = "pread",
    content_hash: bool = False,
    threads: int | None = None,
    storage_options: _StorageOptions = None,
    timeout: float | None = None,
    concurrency: int | None = None,
) -> list[dict[str, Any] | Exception]: ...
def scan(
    paths: list[str],
    recursive: bool = True,
    threads: int | None = None,
    mode: str = "pread",
    content_hash: bool = False,
    progress: bool = False,
    storage_options: _StorageOptions = None,
    timeout: float | None = None,
    concurrency: int | None = None,
) -> ScanResult: ...
def discover(paths: list[str], recursive: bool = True) -> list[tuple[str, str | None]]: ...

#: Test hook, not API: loading or reading `path` panics (None disarms), to test panic containment.
def _debug_panic_on(path: str | None) -> None: ...
def discover_targets(
    paths: list[str],
    recursive: bool = True,
    threads: int | None = None,
    storage_options: _StorageOptions = None,
    timeout: float | None = None,
    concurrency: int | None = None,
) -> list[_TargetItem]: ...

#: (size, ETag, last-modified in ns since the epoch) of a remote object, as its listing or a HEAD gave it.
_ObjectStat = tuple[int, str | None, int | None]

def discover_target_stats(
    paths: list[str],
    recursive: bool = True,
    threads: int | None = None,
    storage_options: _StorageOptions = None,
    timeout: float | None = None,
    concurrency: int | None = None,
) -> list[tuple[_TargetItem, _ObjectStat | None, _ObjectStat | None, bool]]: ...
def scan_targets(
    items: list[_TargetItem],
    threads: int | None = None,
    mode: str = "pread",
    content_hash: bool = False,
    progress: bool = False,
    storage_options: _StorageOptions = None,
    timeout: float | None = None,
    concurrency: int | None = None,
) -> ScanResult: ...
def map_file(path: str) -> MappedFile: ...

@final
class ScanResult:
    def __len__(self) -> int: ...
    def paths(self) -> list[str]: ...
    def errors(self) -> list[tuple[int, str, str, str]]: ...
    def columns(self) -> dict[str, np.ndarray]: ...
    def record(self, i: int) -> dict[str, Any] | None: ...
    def target_modules(self) -> tuple[list[str], list[list[int]]]: ...
    def adapters(self, start: int, stop: int) -> list[dict[str, Any]]: ...
    def records(self, start: int, stop: int) -> list[dict[str, Any]]: ...
    def records_json(self, start: int, stop: int) -> str: ...
    # Columns: numpy arrays, (values, valid) pairs, (codes, names) pairs or lists of str.
    def table(self) -> dict[str, Any]: ...
    def module_table(self) -> dict[str, Any]: ...
    def encode(self) -> tuple[list[bytes], list[int | None], list[bytes]]: ...

def assemble(rows: list[bytes], class_ids: list[str | None], classes: dict[str, bytes]) -> ScanResult: ...

@final
class MappedFile:
    data_start: int
    file_size: int
    path: str
    def array(self) -> np.ndarray: ...
    def intact(self) -> bool: ...
