"""Turn what callers pass (Adapters, paths, a ScanReport, a mapping, LoraRefs) into `AdapterView`s.

An `AdapterView` is the part of an adapter an engine check needs: its id and name as the engine keys
it, its `adapter_config.json`, and every tensor name with its shape, in the order SGLang's loader reads
them (files in name order, tensors in name order inside a file, as `safe_open(...).keys()` returns
them). It is built from a header-only scan; no tensor data is read.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lorafast import _core
from lorafast.compat._common import LoraRef, lora_id
from lorafast.header import read_header, read_torch_header

if TYPE_CHECKING:
    from lorafast.adapter import Adapter

Shape = tuple[int, ...]


@dataclass
class AdapterView:
    """An adapter as engine checks see it. Build one with `from_adapter` or `from_tensors`."""

    name: str
    path: str
    lora_id: str
    config: Mapping[str, Any] | None
    tensors: dict[str, Shape | None]
    pinned: bool = False
    config_file: bool = True
    """False: `config` (if any) came from safetensors metadata, not adapter_config.json."""
    is_dir: bool = True
    has_weights: bool = True
    added_tokens: Mapping[str, int] | None = None
    added_tokens_error: str | None = None
    adapter: Adapter | None = field(default=None, repr=False)
    load_error: BaseException | None = None
    """Reading the weights' headers failed (raised where SGLang loads)."""
    config_load_error: BaseException | None = None
    """adapter_config.json is not valid JSON."""
    weights_readable: bool = True
    """False: only .bin/.pt weights, whose tensors lorafast cannot see."""

    @classmethod
    def from_adapter(
        cls,
        adapter: Adapter,
        *,
        name: str | None = None,
        path: str | None = None,
        adapter_id: str | None = None,
        pinned: bool = False,
    ) -> AdapterView:
        """A view of a scanned `lorafast.Adapter`; name/path default to the adapter's own."""
        path = str(adapter.path) if path is None else str(path)
        name = adapter.name if name is None else name
        config = dict(adapter.config) if adapter.config is not None else None
        added, added_error = _read_added_tokens(str(adapter.path))
        return cls(
            name=name,
            path=path,
            lora_id=adapter_id or lora_id(name, path),
            config=config,
            tensors=_tensor_table(adapter),
            pinned=pinned,
            config_file=adapter.config_path is not None,
            is_dir=os.path.isdir(str(adapter.path)),
            has_weights=bool(adapter.weight_files),
            added_tokens=added,
            added_tokens_error=added_error,
            adapter=adapter,
        )

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, Any],
        config: Mapping[str, Any] | None = None,
        *,
        name: str = "adapter",
        path: str = "",
        adapter_id: str | None = None,
        pinned: bool = False,
        added_tokens: Mapping[str, int] | None = None,
    ) -> AdapterView:
        """A view of an in-memory state dict: `{name: shape}` or `{name: tensor}` (only `.shape` is read).

        Names keep the order given, like SGLang's `load_lora_weights_from_tensors`.
        """
        table: dict[str, Shape | None] = {}
        for key, value in tensors.items():
            shape = getattr(value, "shape", value)
            table[key] = None if shape is None else tuple(int(d) for d in shape)
        return cls(
            name=name,
            path=path,
            lora_id=adapter_id or lora_id(name, path),
            config=None if config is None else dict(config),
            tensors=table,
            pinned=pinned,
            added_tokens=added_tokens,
        )

    @classmethod
    def from_path(
        cls,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        adapter_id: str | None = None,
        pinned: bool = False,
    ) -> AdapterView:
        """A view read straight from disk, headers only, choosing files the way SGLang's loader does.

        A folder: every `*.safetensors` in it (filtered by `model.safetensors.index.json` when present), in
        name order, plus `adapter_config.json` and `added_tokens.json`. A file: that file alone, with the
        `adapter_config.json` next to it (SGLang's LLM server itself only loads folders).
        """
        given = os.fspath(path)
        is_dir = os.path.isdir(given)
        folder = given if is_dir else os.path.dirname(given)
        if name is None:
            base = os.path.basename(given.rstrip("/"))
            name = base.removesuffix(".safetensors")
        config: Mapping[str, Any] | None = None
        config_error: BaseException | None = None
        config_path = os.path.join(folder, "adapter_config.json")
        if os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except ValueError as exc:  # json.JSONDecodeError, or bad UTF-8
                config_error = exc
            if config is not None and config_error is None and not isinstance(config, Mapping):
                try:  # LoRAConfig's first lookup on a JSON list or scalar fails with Python's own TypeError
                    config["target_modules"]
                except Exception as exc:
                    config_error = exc
        files: list[str] = []
        has_weights = True
        tensors: dict[str, Shape | None] = {}
        load_error: BaseException | None = None
        try:
            files, has_weights = _weight_files(given, is_dir)
            for file in files:
                tensors.update(read_names_and_shapes(file))
        except Exception as exc:  # what SGLang's loader raises (index errors, OSError); HeaderError is a ValueError
            load_error = exc
        added, added_error = _read_added_tokens(folder) if is_dir else (None, None)
        return cls(
            name=name,
            path=given,
            lora_id=adapter_id or lora_id(name, given),
            config=config if isinstance(config, Mapping) else None,
            tensors=tensors,
            pinned=pinned,
            config_file=is_dir and config is not None,
            config_load_error=config_error,
            is_dir=is_dir,
            has_weights=has_weights,
            weights_readable=bool(files) or not has_weights,
            load_error=load_error,
            added_tokens=added,
            added_tokens_error=added_error,
        )

    def config_error(self) -> BaseException | None:
        """What SGLang's `LoRAConfig(path)` raises when there is no adapter_config.json to read."""
        if self.config_load_error is not None:
            return self.config_load_error
        if self.config is not None and self.config_file:
            return None
        if not os.path.isdir(self.path):  # LoRAConfig hands a non-folder to the hub, which checks the repo id
            hub_error = _repo_id_error(self.path)
            if hub_error is not None:
                return hub_error
        target = os.path.join(self.path, "adapter_config.json")
        return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), target)


def _repo_id_error(path: str) -> BaseException | None:
    """What `huggingface_hub.snapshot_download(path)` raises for a path that is not a valid repo id."""
    try:
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        return None
    try:
        validate_repo_id(path)
    except ValueError as exc:  # HFValidationError
        return exc
    return None


def is_adapter(obj: Any) -> bool:
    return hasattr(obj, "modules") and hasattr(obj, "weight_files") and hasattr(obj, "config")


def view_of(obj: Any, *, name: str | None = None, adapter_id: str | None = None) -> AdapterView:
    if isinstance(obj, AdapterView):
        if name is None and adapter_id is None:
            return obj
        return AdapterView(**{**obj.__dict__, "name": name or obj.name, "lora_id": adapter_id or obj.lora_id})
    if isinstance(obj, LoraRef):
        if obj.adapter is None:
            return AdapterView.from_path(obj.path, name=obj.name, adapter_id=obj.lora_id, pinned=obj.pinned)
        inner = obj.adapter
        if isinstance(inner, AdapterView):
            return AdapterView(
                **{**inner.__dict__, "name": obj.name, "path": obj.path, "lora_id": obj.lora_id, "pinned": obj.pinned}
            )
        return AdapterView.from_adapter(inner, name=obj.name, path=obj.path, adapter_id=obj.lora_id, pinned=obj.pinned)
    if is_adapter(obj):
        return AdapterView.from_adapter(obj, name=name, adapter_id=adapter_id)
    if isinstance(obj, (str, os.PathLike)):
        return AdapterView.from_path(obj, name=name, adapter_id=adapter_id)
    raise TypeError(f"expected an Adapter, a path, a LoraRef or an AdapterView, got {type(obj).__name__}")


def resolve_adapters(adapters: Any) -> list[AdapterView]:
    """Views for everything a compat function accepts, in load order.

    * a mapping `{adapter_id: Adapter | path | AdapterView}`: the key is both SGLang's id and the name;
    * a sequence (or a `ScanReport`) of Adapters / paths: name = folder or file stem, path = as given
      (or `Adapter.path`), id = `lora_id(name, path)` as for `--lora-paths NAME=PATH`. A path is read
      header-only by `AdapterView.from_path`, choosing weight files as SGLang's loader does;
    * `LoraRef`s, for full control of name, path, id and pinning;
    * a single Adapter, path, LoraRef or AdapterView.
    """
    if isinstance(adapters, (str, os.PathLike, AdapterView, LoraRef)) or is_adapter(adapters):
        return [view_of(adapters)]
    if isinstance(adapters, Mapping):
        return [view_of(value, name=str(key), adapter_id=str(key)) for key, value in adapters.items()]
    if isinstance(adapters, Iterable):
        return [view_of(item) for item in adapters]
    raise TypeError(f"cannot read adapters from {type(adapters).__name__}")


def _read_added_tokens(folder: str) -> tuple[Mapping[str, int] | None, str | None]:
    """SGLang's optional `added_tokens.json` (a small JSON file; no tensor data)."""
    path = os.path.join(folder, "added_tokens.json")
    if not os.path.isfile(path):
        return None, None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        return None, str(exc)
    return (data if isinstance(data, dict) else None), None


def _shape(shape: Any) -> Shape | None:
    if shape is None or type(shape) is tuple:
        return shape
    return tuple(int(d) for d in shape)


def _tensor_table(adapter: Any) -> dict[str, Shape | None]:
    """Every tensor name -> shape, in the order SGLang's safetensors iterator yields them.

    The module list gives A/B names and shapes; other tensors (biases, DoRA magnitudes, kohya alphas,
    saved full weights) are named but unshaped there. When that leaves a tensor unaccounted for or
    unshaped, the headers are read again (header only) to fill the gap.
    """
    files = adapter.weight_files
    default_file = files[0] if files else ""
    by_file: dict[str, dict[str, Shape | None]] = {}
    unshaped = False
    for m in adapter.modules:
        file = m.weight_file or default_file
        table = by_file.get(file)
        if table is None:
            table = by_file[file] = {}
        if m.a_key:
            table[m.a_key] = _shape(m.a_shape)
        if m.b_key:
            table[m.b_key] = _shape(m.b_shape)
        if m.bias_key or m.magnitude_key or m.alpha_key or m.extra_keys:
            for extra in (m.bias_key, m.magnitude_key, m.alpha_key, *m.extra_keys):
                if extra and extra not in table:
                    table[extra] = None
                    unshaped = True
    for key in adapter.full_weight_tensors:
        if not any(key in t for t in by_file.values()):
            by_file.setdefault(default_file, {})[key] = None
            unshaped = True
    count = sum(len(t) for t in by_file.values())
    if count != adapter.num_tensors or unshaped:
        by_file = _header_tables(files) or by_file
    ordered: dict[str, Shape | None] = {}
    for file in sorted(by_file):
        table = by_file[file]
        for key in sorted(table):
            ordered[key] = table[key]
    return ordered


_SKIPPED_BIN = frozenset({"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"})


def _weight_files(path: str, is_dir: bool) -> tuple[list[str], bool]:
    """The safetensors files SGLang's loader reads (`DefaultModelLoader._prepare_weights`, sglang 0.5.23), and
    whether it finds any weights at all; raises what the loader raises for a broken index.

    Patterns `*.safetensors`, `*.bin`, `*.pt` in turn, the first that matches wins. Safetensors are filtered by
    `model.safetensors.index.json` (every shard it names must exist) or, without one, `consolidated.safetensors`
    next to `model.safetensors` keeps only the latter. `.bin`/`.pt` files (which lorafast cannot read headers
    of) still count as weights.
    """
    if not is_dir:
        return ([path] if path.endswith(".safetensors") else []), os.path.isfile(path)
    names = sorted(os.listdir(path))
    names = [n for n in names if not n.startswith(".")]  # glob patterns skip hidden files
    tensors = [os.path.join(path, n) for n in names if n.endswith(".safetensors")]
    if tensors:
        return _filter_duplicates(tensors, path), True
    bins = [n for n in names if n.endswith((".bin", ".pt")) and n not in _SKIPPED_BIN]
    return [], bool(bins)


def _filter_duplicates(files: list[str], folder: str) -> list[str]:
    """sglang `filter_duplicate_safetensors_files` with the default index file."""
    index_file = "model.safetensors.index.json"
    index = os.path.join(folder, index_file)
    if not os.path.isfile(index):
        if len(files) == 2 and files[0].endswith("consolidated.safetensors") and files[1].endswith("model.safetensors"):
            return [files[1]]
        return files
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    in_index = set()
    for weight_name in weight_map:
        in_index.add(os.path.join(folder, weight_map[weight_name]))
    missing = sorted(f for f in in_index if not os.path.isfile(f))
    if missing:
        raise RuntimeError(
            f"{index_file} references {len(missing)} shard file(s) missing from {folder} (incomplete download?): "
            f"{[os.path.basename(f) for f in missing]}"
        )
    return [f for f in files if f in in_index]


#: (header bytes, file size) -> `{name: shape}` of a header that parsed and validated. The parse is a function of
#: exactly those two (`parse_header(bytes, file_size)`), and adapters trained from one recipe have byte-identical
#: headers, so each distinct header is parsed once. Emptied when the keys pass `_HEADER_CACHE_BUDGET` bytes.
_HEADER_CACHE: dict[tuple[bytes, int], dict[str, Shape | None]] = {}
_HEADER_CACHE_BUDGET = 64 << 20
_header_cache_used = 0
_SPECULATIVE = 64 << 10
_MAX_CACHED_HEADER = 4 << 20


def _raw_header(file: str) -> tuple[bytes, int] | None:
    """(header bytes, file size) of a regular file, or None when anything is unusual (the core then reads it
    and raises what it raises)."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < 8:
            return None
        data = os.pread(fd, _SPECULATIVE + 8, 0)
        if len(data) < 8:
            return None
        n = int.from_bytes(data[:8], "little")
        if n > _MAX_CACHED_HEADER or 8 + n > st.st_size:
            return None
        if len(data) < 8 + n:
            data += os.pread(fd, 8 + n - len(data), len(data))
            if len(data) < 8 + n:
                return None
        return data[8 : 8 + n], st.st_size
    except OSError:
        return None
    finally:
        os.close(fd)


def read_names_and_shapes(file: str) -> dict[str, Shape | None]:
    """`{name: shape}` of one file's header, in name order (`safe_open(...).keys()` order)."""
    global _header_cache_used
    key = _raw_header(file)
    if key is not None:
        cached = _HEADER_CACHE.get(key)
        if cached is not None:
            return dict(cached)
    header = _core.read_header(file, "pread")  # errors are raised here, never cached
    entries = header["tensors"]  # [(name, dtype, shape, offsets)], names unique
    entries.sort()
    table: dict[str, Shape | None]
    if entries and type(entries[0][2]) is tuple:
        table = {entry[0]: entry[2] for entry in entries}
    else:
        table = {entry[0]: _shape(entry[2]) for entry in entries}
    # Stored only when the core read the same header (the file did not change in between).
    if key is not None and header.get("header_size") == len(key[0]) and header.get("file_size") == key[1]:
        if _header_cache_used + len(key[0]) > _HEADER_CACHE_BUDGET:
            _HEADER_CACHE.clear()
            _header_cache_used = 0
        _HEADER_CACHE[key] = dict(table)
        _header_cache_used += len(key[0])
    return table


def _header_tables(files: Iterable[str]) -> dict[str, dict[str, Shape | None]]:
    out: dict[str, dict[str, Shape | None]] = {}
    for file in files:
        # A scanned PEFT folder's weights may be adapter_model.bin / .pt, read without unpickling.
        header = read_torch_header(file) if file.endswith((".bin", ".pt", ".pth")) else read_header(file)
        out[file] = {name: tuple(int(d) for d in info.shape) for name, info in header.tensors.items()}
    return out
