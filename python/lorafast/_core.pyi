"""Type stubs for the compiled core (rust/py/). Use the typed wrappers in `lorafast` instead."""

from typing import Any, NotRequired, TypedDict, final, type_check_only

import numpy as np

from lorafast.codes import Flag, ModuleKind, ProblemCode

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
    "IndexScan",
    "MappedFile",
    "ModuleCache",
    "ScanResult",
    "_debug_panic_on",
    "build_profile",
    "discover",
    "discover_targets",
    "index_paths",
    "inspect",
    "inspect_many",
    "make_modules",
    "map_file",
    "read_header",
    "read_torch_header",
    "read_url_header",
    "read_url_range",
    "scan",
    "scan_targets",
    "write_parquet",
]

# The code lists, each in documentation order, from the enums of rust/codes.rs (`ALL`) and rust/classify/.
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

# The raw dicts the core returns, as the `lorafast` wrappers read them (stub-only types).

@type_check_only
class RawHeader(TypedDict):
    """`read_header` / `read_torch_header`: tensors in file order."""

    tensors: list[tuple[str, str, tuple[int, ...], tuple[int, int]]]
    """(name, dtype, shape, (begin, end)) of each tensor."""
    metadata: dict[str, str] | None
    header_size: int
    file_size: int
    warnings: list[tuple[ProblemCode, str]]
    """(code, message) of each non-fatal finding."""

@type_check_only
class RawModule(TypedDict):
    """One module of an adapter: exactly the fields of `lorafast.LoraModule`."""

    name: str
    key: str
    kind: ModuleKind
    leaf: str
    layer: int | None
    expert: int | None
    num_experts: int | None
    rank: int | None
    in_features: int | None
    out_features: int | None
    dtype: str | None
    a_key: str | None
    b_key: str | None
    a_shape: tuple[int, ...] | None
    b_shape: tuple[int, ...] | None
    alpha: float | None
    alpha_key: str | None
    bias_key: str | None
    magnitude_key: str | None
    extra_keys: tuple[str, ...]
    config_rank: int | None
    use_rslora: bool
    weight_file: str

@type_check_only
class RawAdapter(TypedDict):
    """One adapter; a summary record (`ScanResult.record`, `records`) has no `modules`."""

    path: str
    weight_files: tuple[str]
    config_path: str | None
    config_json: str | None
    format: str
    peft_type: str | None
    num_tensors: int
    dtypes: list[str]
    layers: list[int]
    base_model_name_or_path: str | None
    target_modules: list[str]
    rank: int
    moe_layout: str
    num_experts: int
    flags: list[Flag]
    variants: list[str]
    full_weight_tensors: list[str]
    problems: list[tuple[ProblemCode, str, str | None]]
    """(code, message, tensor) of each problem."""
    content_hash: str | None
    metadata: dict[str, str] | None
    header_size: int
    file_size: int
    modules: NotRequired[list[RawModule]]

def read_header(path: str, mode: str = "pread") -> RawHeader: ...
def read_torch_header(path: str) -> RawHeader: ...

_StorageOptions = list[tuple[str, str]] | None

def read_url_range(
    url: str, start: int, end: int, storage_options: _StorageOptions = None, timeout: float | None = None
) -> tuple[bytes, int]: ...
def read_url_header(url: str, storage_options: _StorageOptions = None, timeout: float | None = None) -> RawHeader: ...

#: (path, weights, config, error code, error message) of one discovered adapter.
_TargetItem = tuple[str, str | None, str | None, str | None, str | None]

def inspect(
    path: str,
    mode: str = "pread",
    content_hash: bool = False,
    storage_options: _StorageOptions = None,
    timeout: float | None = None,
) -> RawAdapter: ...
def inspect_many(
    paths: list[str],
    mode: str = "pread",
    content_hash: bool = False,
    threads: int | None = None,
    storage_options: _StorageOptions = None,
    timeout: float | None = None,
    concurrency: int | None = None,
) -> list[RawAdapter | Exception]: ...

# `cls` is `lorafast.adapter.LoraModule` (its slots are the fields of a RawModule).
def make_modules(cls: type[Any], dicts: list[RawModule]) -> tuple[Any, ...]: ...
def write_parquet(
    path: str,
    columns: list[tuple[Any, ...]],
    metadata: list[tuple[str, bytes]],
    statistics: list[str],
) -> None: ...
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
def index_paths(chunks: list[Any]) -> list[bytes]: ...
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
class ModuleCache:
    # What the adapters of one `adapter_objects` batch share to build their modules; made by the core only.
    ...

@final
class ScanResult:
    def __len__(self) -> int: ...
    def paths(self) -> list[str]: ...
    def errors(self) -> list[tuple[int, str, str, str]]: ...
    def columns(self) -> dict[str, np.ndarray]: ...
    def record(self, i: int) -> RawAdapter | None: ...
    def target_modules(self, per_row: bool = True) -> tuple[list[str], list[list[int]]]: ...
    def adapters(self, start: int, stop: int) -> list[RawAdapter]: ...
    # `Adapter` objects (modules built on first access by `adapter_modules`) and (position, config text) pairs;
    # `types` is `lorafast.adapter.ADAPTER_TYPES`.
    def adapter_objects(
        self, start: int, stop: int, types: tuple[Any, ...]
    ) -> tuple[list[Any], list[tuple[int, str]]]: ...
    def adapter_modules(
        self, adapter: Any, row: int, types: tuple[Any, ...], cache: ModuleCache | None = None
    ) -> tuple[Any, ...]: ...
    def records(self, start: int, stop: int) -> list[RawAdapter]: ...
    def records_json(self, start: int, stop: int) -> str: ...
    def json_text(self, prefix: str, suffix: str) -> str: ...
    # Columns: numpy arrays, (values, valid) pairs, (codes, names) pairs or lists of str.
    def table(self, strings: bool = True) -> dict[str, Any]: ...
    def string_buffers(self, name: str) -> tuple[Any, Any, Any, bool] | None: ...
    def module_table(self) -> dict[str, Any]: ...

@final
class IndexScan:
    # One `lorafast.Index` rescan: walks and signs on creation; then `plan`, `read`, `result` (rust/py/index.rs).
    def __new__(
        cls,
        paths: list[str],
        recursive: bool,
        threads: int | None,
        context: bytes,
        storage_options: _StorageOptions = None,
        timeout: float | None = None,
        concurrency: int | None = None,
    ) -> IndexScan: ...
    def plan(self, chunks: list[tuple[int, Any]], trust: bool) -> None: ...
    @property
    def reads(self) -> int: ...
    @property
    def added(self) -> list[str]: ...
    @property
    def changed(self) -> list[str]: ...
    @property
    def removed(self) -> list[str]: ...
    def class_ids(self) -> list[bytes]: ...
    def read(self, mode: str, content_hash: bool, progress: bool) -> list[tuple[bytes, bytes]]: ...
    def writes(self, per_chunk: int) -> list[tuple[int | None, bytes | None, bytes, list[bytes]]]: ...
    def result(self, bodies: dict[bytes, bytes]) -> ScanResult: ...

@final
class MappedFile:
    data_start: int
    file_size: int
    path: str
    def array(self) -> np.ndarray: ...
    def intact(self) -> bool: ...
