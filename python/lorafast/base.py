"""`read_base`: a base model's weight names, dtypes and shapes, read from safetensors headers only.

Handles a single `.safetensors`, a sharded checkpoint (`*.safetensors.index.json`), a diffusers pipeline folder
(`model_index.json` plus one folder per component) and single-file diffusion checkpoints (kohya/ComfyUI style,
split into components by their key prefixes). Quantized weights are reported with their logical shape and the
scheme (`fp8`, `int4`, `mxfp4`, ...), never read as plain matrices of the packed shape.

Local headers go through the Rust reader (`_core.read_header`, validated like every other header). URLs
(`http(s)://`, `hf://org/repo[@rev]/path`, `s3://`, `gs://`, `az://`) go through the Rust remote layer that
`scan` uses (`_core.read_url_header`, `_core.read_url_range`): only headers and JSON files are fetched, with range
requests, under its credentials, redirect policy, timeouts and size bounds (docs/remote.md).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import _core
from .errors import AdapterError, CodedError, HeaderError
from .formats.moe import NUMBERED_EXPERT_WEIGHT, SGLANG_W_RENAMES

PathLike = str | os.PathLike[str]

#: Key prefixes of single-file diffusion checkpoints -> pipeline component names.
SINGLE_FILE_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.diffusion_model.", "denoiser"),  # renamed to unet / transformer below
    ("cond_stage_model.transformer.", "text_encoder"),  # SD 1.x
    ("cond_stage_model.model.", "text_encoder"),  # SD 2.x (open_clip names)
    ("conditioner.embedders.0.transformer.", "text_encoder"),  # SDXL
    ("conditioner.embedders.1.model.", "text_encoder_2"),  # SDXL (open_clip names)
    ("first_stage_model.", "vae"),
    ("text_encoders.clip_l.transformer.", "text_encoder"),  # SD3 / Flux ComfyUI bundles
    ("text_encoders.clip_g.transformer.", "text_encoder_2"),
    ("text_encoders.t5xxl.transformer.", "text_encoder_3"),
)
#: Top-level names of original-layout denoisers stored without a prefix (BFL Flux, Wan, HunyuanVideo releases).
_BARE_DENOISER_KEYS = ("double_blocks.", "single_blocks.", "joint_blocks.", "blocks.", "input_blocks.")
_ANY_SINGLE_FILE = tuple(p for p, _ in SINGLE_FILE_PREFIXES) + _BARE_DENOISER_KEYS
_QUANT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E8M0", "U8"})
_QUANT_SUFFIXES = (".weight_packed", "_blocks", ".weight.absmax")
#: Weight files tried, in order, in a model or component folder.
_INDEX_NAMES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")
_FILE_NAMES = ("model.safetensors", "diffusion_pytorch_model.safetensors")


class BaseModelError(CodedError):
    """A base checkpoint cannot be read: `code` is one of `missing_file`, `missing_shard`, `bad_index`,
    `missing_config`, `bad_config`, `no_weights`, `unsupported_url`, or for an object store the remote layer's
    (`timeout`, `connection_error`, `remote_error`, `store_config`, ...); `path` names the file."""


class Weight(NamedTuple):
    """One base weight. `shape` is the logical shape (what a LoRA factor must fit); for a quantized weight
    `stored_shape` is what the file holds and `quantized` names the scheme. A tuple: a base of 100,000 tensors
    builds 100,000 of them."""

    dtype: str
    shape: tuple[int, ...] | None
    """None: the logical shape is not in the header (bitsandbytes 4-bit)."""
    file: str
    quantized: str | None = None
    stored_shape: tuple[int, ...] | None = None


@dataclass
class BaseModel:
    """A base checkpoint as seen from its headers. For a pipeline, `weights` holds every component's weights as
    `<component>.<name>` and `components` the components themselves."""

    path: str
    kind: str
    """"checkpoint", "sharded", "pipeline" or "single_file_diffusion"."""
    weights: dict[str, Weight]
    config: dict[str, Any] | None = None
    architecture: str | None = None
    components: dict[str, BaseModel] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    quantization: str | None = None
    """The scheme when any weight is quantized."""

    @property
    def loaded_weights(self) -> dict[str, Weight]:
        """The weights under the names transformers 5 gives them after loading (its checkpoint conversion: a
        Llava-style wrapper's `language_model.model.` becomes `model.language_model.`, per-expert MoE weights
        become fused `experts.gate_up_proj` / `experts.down_proj`). Only the names that change are listed."""
        view = self.__dict__.get("_loaded")
        if view is None:
            view = self.__dict__["_loaded"] = _loaded_view(self.weights, self.config)
        return view

    @property
    def renamed_on_load(self) -> dict[str, str]:
        """Loaded name -> stored name, for the weights that transformers 5 only renames on load (not the fused
        experts): the names `check` looks up besides the stored ones, and `merge_file` too."""
        return _renames(self.weights, self.loaded_weights)

    @property
    def num_weights(self) -> int:
        return len(self.weights)

    @property
    def name(self) -> str:
        base = os.path.basename(self.path.rstrip("/"))
        return base or self.path

    def __repr__(self) -> str:
        comps = f", components={sorted(self.components)}" if self.components else ""
        return f"BaseModel({self.path!r}, kind={self.kind!r}, {len(self.weights)} weights{comps})"


# ---------------------------------------------------------------------------------------------------------------
# Where the files come from


class LocalFiles:
    """A local folder as the base reader reads it (`Remote` is the same for a URL)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def at(self, root: str) -> LocalFiles:
        return LocalFiles(root)

    def join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts) if parts else self.root

    def exists(self, rel: str) -> bool:
        return os.path.isfile(self.join(rel))

    def is_dir(self) -> bool:
        return os.path.isdir(self.root)

    def text(self, rel: str) -> str:
        with open(self.join(rel), encoding="utf-8") as f:
            return f.read()

    def header(self, rel: str) -> _core.RawHeader:
        return _core.read_header(self.join(rel), "pread")

    def listdir(self) -> list[str]:
        return sorted(os.listdir(self.root))


#: Largest JSON file (`config.json`, a shard index, `model_index.json`) read from a URL: the limit `scan` puts on
#: a remote `adapter_config.json`.
_MAX_JSON_BYTES = 16 << 20


class _Remote:
    """A folder or file at a URL (`http(s)://`, `hf://org/repo[@rev]/path`, `s3://`, `gs://`, `az://`), read
    through the Rust remote layer that `scan` uses, so base reads get its stores, credentials, redirect policy,
    retries, timeouts, size bounds and error codes. Headers come from `_core.read_url_header` (checked as `scan`
    checks a remote weights file), JSON files whole up to 16 MiB. Web servers and the Hub cannot be listed, so the
    standard file names are tried in turn."""

    def __init__(self, url: str, timeout: float | None, storage_options: Mapping[str, Any] | None) -> None:
        from .scanning._common import storage_items

        self.root = url
        self.timeout = timeout
        self.options = storage_items(storage_options)
        self._missing: set[str] = set()

    def at(self, root: str) -> _Remote:
        """The same store and options, at another folder."""
        sub = _Remote.__new__(_Remote)
        sub.__dict__.update(self.__dict__, root=root, _missing=set())
        return sub

    def join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts]) if parts else self.root

    def is_dir(self) -> bool:
        return not self.root.endswith(".safetensors")

    def _range(self, url: str, start: int, end: int) -> tuple[bytes, int]:
        try:
            body, size = _core.read_url_range(url, start, end, self.options, self.timeout)
        except AdapterError as e:  # the remote layer's codes (timeout, connection_error, ...), for a base
            raise BaseModelError(str(e), str(e.code), url) from None
        return bytes(body), size

    def exists(self, rel: str) -> bool:
        if rel in self._missing:
            return False
        try:
            self._range(self.join(rel), 0, 1)
            return True
        except FileNotFoundError:
            self._missing.add(rel)
            return False

    def text(self, rel: str) -> str:
        url = self.join(rel)
        # One byte past the limit tells "too large" without reading a huge object.
        body, size = self._range(url, 0, _MAX_JSON_BYTES + 1)
        if size > _MAX_JSON_BYTES:
            raise BaseModelError(
                f"{url}: {size} bytes is too large for a JSON file (at most {_MAX_JSON_BYTES})", "bad_config", url
            )
        return body.decode("utf-8")

    def header(self, rel: str) -> _core.RawHeader:
        url = self.join(rel) if rel else self.root
        try:
            return _core.read_url_header(url, self.options, self.timeout)
        except AdapterError as e:
            raise BaseModelError(str(e), str(e.code), url) from None

    def listdir(self) -> list[str]:
        return []


#: The URL schemes of the remote layer (rust/remote/url.rs).
_URL_SCHEMES = tuple(
    f"{s}://" for s in ("http", "https", "hf", "s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss")
)


def _opener(path: str, timeout: float | None, storage_options: Mapping[str, Any] | None) -> LocalFiles | _Remote:
    if path.startswith(_URL_SCHEMES):
        return _Remote(path, timeout, storage_options)
    if "://" in path:
        scheme = path.split("://", 1)[0]
        raise BaseModelError(
            f"read_base reads local paths and http(s)://, hf://, s3://, gs:// and az:// URLs, not {scheme}://",
            "unsupported_url",
            path,
        )
    return LocalFiles(path)


# ---------------------------------------------------------------------------------------------------------------
# Reading


def read_base(
    path_or_url: PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    allow_outside_shards: bool = True,
) -> BaseModel:
    """Read a base checkpoint header-only: a `.safetensors` file, a sharded checkpoint folder (or its index
    file), a diffusers pipeline folder, or a single-file diffusion checkpoint. Local, `http(s)://`, `hf://`, or in
    an object store (`s3://`, `gs://`, `az://`); URLs are read through `scan`'s remote layer, with the same
    `storage_options` (e.g. `endpoint`, `region`; `token` and `headers` for web servers and the Hub) and `timeout`.

    An index may name shards outside the model folder (`../x.safetensors`, an absolute path), and a pipeline's
    `model_index.json` components outside the pipeline folder; they are read, as transformers and diffusers
    would. `allow_outside_shards=False` refuses them with a `BaseModelError` (`bad_index`) naming the file.

    Raises `BaseModelError` (missing shard, index naming absent files, missing config, a remote failure, ...) or
    `HeaderError` for a malformed shard, each naming the file; `FileNotFoundError` when the path does not exist.
    """
    path = os.fspath(path_or_url)
    src = _opener(path, timeout, storage_options)
    if isinstance(src, LocalFiles) and not os.path.exists(path):
        raise FileNotFoundError(2, f"no such base model: {path}", path)
    if path.endswith(".index.json"):
        folder, index = _split(src, path)
        return _read_model(src.at(folder), index, allow_outside_shards)
    if not src.is_dir():
        return _read_single(src, path)
    if src.exists("model_index.json"):
        return _read_pipeline(src, allow_outside_shards)
    return _read_model(src, None, allow_outside_shards)


def _split(src: LocalFiles | _Remote, path: str) -> tuple[str, str]:
    """(folder, file name) of a path or URL."""
    if isinstance(src, _Remote):
        folder, _, name = path.rpartition("/")
        return folder, name
    folder, name = os.path.split(path)
    return folder or ".", name


def _read_single(src: LocalFiles | _Remote, path: str) -> BaseModel:
    folder, name = _split(src, path)
    sub = src.at(folder)
    try:
        weights, meta_quant = _weights_of(sub, [name])
    except BaseModelError as e:
        if e.code == "missing_file":  # the path given is not there: as for a local path
            raise FileNotFoundError(2, f"no such base model: {path}", path) from None
        raise
    config = optional_json(sub, "config.json")
    comps = _split_single_file(weights, path)
    if comps:
        return BaseModel(
            path, "single_file_diffusion", weights, config, _single_file_arch(comps), comps, (path,), meta_quant
        )
    return BaseModel(path, "checkpoint", weights, config, _architecture(config), {}, (path,), meta_quant)


def _read_model(src: LocalFiles | _Remote, index_name: str | None, allow_outside: bool) -> BaseModel:
    """A transformers model folder or a diffusers component folder: config.json plus weights."""
    index = index_name or next((n for n in _INDEX_NAMES if src.exists(n)), None)
    if index is not None:
        files = _index_files(src, index, allow_outside)
        kind = "sharded"
    else:
        single = next((n for n in _FILE_NAMES if src.exists(n)), None)
        if single is None:
            found = [n for n in src.listdir() if n.endswith(".safetensors")]
            if len(found) != 1:
                why = "no" if not found else f"{len(found)}"
                raise BaseModelError(
                    f"{src.join()}: {why} safetensors weights (expected {' or '.join(_INDEX_NAMES + _FILE_NAMES)})",
                    "no_weights",
                    src.join(),
                )
            single = found[0]
        files = [single]
        kind = "checkpoint"
    weights, quant = _weights_of(src, files)
    config = _required_json(src, "config.json")
    qcfg = (config or {}).get("quantization_config")
    if isinstance(qcfg, dict):
        weights = _apply_quant_config(weights, qcfg)
        quant = quant or str(qcfg.get("quant_method") or "quantized")
    return BaseModel(
        src.join(), kind, weights, config, _architecture(config), {}, tuple(src.join(f) for f in files), quant
    )


def _read_pipeline(src: LocalFiles | _Remote, allow_outside: bool) -> BaseModel:
    index = _json(src, "model_index.json", "bad_config")
    comps: dict[str, BaseModel] = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] is None:
            continue
        lib = value[0]
        if lib not in ("diffusers", "transformers"):
            continue
        if not allow_outside:
            _refuse_outside(src, "model_index.json", [name], "component folder")
        sub = src.at(src.join(name))
        if not any(sub.exists(n) for n in _INDEX_NAMES + _FILE_NAMES + ("config.json",)):
            continue  # schedulers, tokenizers: no weights, no config of their own
        comps[name] = _read_model(sub, None, allow_outside)
    weights = {f"{c}.{k}": w for c, m in comps.items() for k, w in m.weights.items()}
    quant = next((m.quantization for m in comps.values() if m.quantization), None)
    files = tuple(f for m in comps.values() for f in m.files)
    return BaseModel(src.join(), "pipeline", weights, index, index.get("_class_name"), comps, files, quant)


def _outside(name: str) -> bool:
    """Whether a name an index gives lies outside its folder: an absolute path, a URL, or one that climbs out."""
    if "://" in name or name.startswith(("/", "\\")) or os.path.isabs(name):
        return True
    return posixpath.normpath(name.replace("\\", "/")).split("/")[0] == ".."


def _refuse_outside(src: LocalFiles | _Remote, index: str, names: list[str], what: str) -> None:
    """`allow_outside_shards=False`: an index naming a file outside its folder is refused, naming the file."""
    outside = [n for n in names if _outside(n)]
    if outside:
        raise BaseModelError(
            f"{src.join(index)} names a {what} outside {src.join()}: {outside[0]!r} (allow_outside_shards=False)",
            "bad_index",
            src.join(index),
        )


def _index_files(src: LocalFiles | _Remote, index: str, allow_outside: bool) -> list[str]:
    data = _json(src, index, "bad_index")
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise BaseModelError(f"{src.join(index)}: no weight_map of tensor name -> file", "bad_index", src.join(index))
    files = sorted(set(wm.values()))
    if not allow_outside:
        _refuse_outside(src, index, files, "shard")
    absent = [f for f in files if not src.exists(f)]
    if absent:
        raise BaseModelError(
            f"{src.join(index)} names shard files that do not exist: {', '.join(absent[:5])}"
            + (f" (and {len(absent) - 5} more)" if len(absent) > 5 else ""),
            "missing_shard",
            src.join(absent[0]),
        )
    return files


def _weights_of(src: LocalFiles | _Remote, files: list[str]) -> tuple[dict[str, Weight], str | None]:
    weights: dict[str, Weight] = {}
    for f in files:
        full = src.join(f)
        try:
            raw = src.header(f)
        except HeaderError as e:
            msg = str(e) if full in str(e) else f"{full}: {e}"
            raise HeaderError(msg, e.code, full) from None
        except FileNotFoundError:
            raise BaseModelError(f"missing weight file {full}", "missing_file", full) from None
        make = tuple.__new__
        weights.update(
            (name, make(Weight, (dtype, shape, full, None, None))) for name, dtype, shape, _ in raw["tensors"]
        )
    return _mark_quantized(weights)


def _mark_quantized(weights: dict[str, Weight]) -> tuple[dict[str, Weight], str | None]:
    """Packed and scaled weights as what they stand for: fp8 weights with their scales, packed int4
    (`weight_packed`, GPTQ/AWQ `qweight`) and MXFP4 blocks (`*_blocks` + `*_scales`, gpt-oss)."""
    scheme: str | None = None
    extra: dict[str, Weight] = {}
    # one cheap pass picks the few names worth a closer look
    cands = [n for n, w in weights.items() if w.dtype in _QUANT_DTYPES or n.endswith(_QUANT_SUFFIXES)]
    absmax = {n[: -len(".absmax")] for n in cands if n.endswith(".weight.absmax")}
    for name in cands:
        w = weights[name]
        if w.dtype.startswith("F8_"):
            weights[name] = Weight(w.dtype, w.shape, w.file, "fp8", w.shape)
            scheme = scheme or "fp8"
        elif name.endswith(".weight_packed") and w.shape is not None and len(w.shape) == 2:
            # compressed-tensors pack-quantized: int32 (out, in / 8) for 4 bits
            logical = (w.shape[0], w.shape[1] * 8)
            extra[name[: -len("_packed")]] = Weight(w.dtype, logical, w.file, "int4", w.shape)
            scheme = scheme or "int4"
        elif name.endswith("_blocks") and w.dtype == "U8" and w.shape is not None and len(w.shape) == 4:
            # MXFP4: (E, rows, cols / 32, 16) bytes of two 4-bit values each
            e, rows, nb, bs = w.shape
            extra[name[: -len("_blocks")]] = Weight("MXFP4", (e, rows, nb * bs * 2), w.file, "mxfp4", w.shape)
            scheme = scheme or "mxfp4"
    for name in absmax:
        packed = weights.get(name)
        if packed is not None:
            weights[name] = Weight(packed.dtype, None, packed.file, "bnb_4bit", packed.shape)
            scheme = scheme or "bnb_4bit"
    weights.update(extra)
    return weights, scheme


def _apply_quant_config(weights: dict[str, Weight], qcfg: Mapping[str, Any]) -> dict[str, Weight]:
    """GPTQ / AWQ: `qweight` int32 holds 32/bits values per element; the logical weight is (out, in)."""
    method = str(qcfg.get("quant_method") or "").lower()
    bits = int(qcfg.get("bits") or qcfg.get("w_bit") or 4)
    per = 32 // bits if bits in (2, 4, 8) else 8
    for name, w in list(weights.items()):
        if not name.endswith(".qweight") or w.shape is None or len(w.shape) != 2:
            continue
        rows, cols = w.shape
        logical = (cols * per, rows) if method == "awq" else (cols, rows * per)  # awq packs out, gptq packs in
        weights[name[: -len("qweight")] + "weight"] = Weight(w.dtype, logical, w.file, f"int{bits}", w.shape)
    return weights


# transformers 5 conversion on load (transformers/conversion_mapping.py), the torch-free part that renames and fuses
_WRAPPER_RENAMES = (
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^language_model\.model\.", "model.language_model."),
    (r"^language_model\.", "model.language_model."),
    (r"^vision_tower\.", "model.vision_tower."),
    (r"^multi_modal_projector\.", "model.multi_modal_projector."),
)


def _loaded_view(weights: Mapping[str, Weight], config: Mapping[str, Any] | None) -> dict[str, Weight]:
    cfg = config or {}
    view: dict[str, Weight] = {}
    renames: list[tuple[re.Pattern[str], str]] = []
    if isinstance(cfg.get("text_config"), dict) and isinstance(cfg.get("vision_config"), dict):
        if any(n.startswith("language_model.") for n in weights):
            renames = [(re.compile(a), b) for a, b in _WRAPPER_RENAMES]
    if cfg.get("model_type") in ("mixtral", "minimax"):
        renames.append((re.compile(r"\.block_sparse_moe\."), ".mlp."))
    experts: dict[tuple[str, str], dict[int, Weight]] = {}
    for name, w in weights.items():
        new = name
        for pat, rep in renames:
            new, n = pat.subn(rep, new, count=1)
            if n and pat.pattern.startswith("^"):
                break
        m = NUMBERED_EXPERT_WEIGHT.match(new)
        if m is not None and w.shape is not None and len(w.shape) == 2:
            proj = SGLANG_W_RENAMES.get(m.group(3), m.group(3)).removesuffix("_proj")  # gate, up or down
            experts.setdefault((m.group(1), proj), {})[int(m.group(2))] = w
        if new != name:
            view[new] = w
    for (owner, proj), per in experts.items():
        if proj == "up":
            continue
        e = len(per)
        first = per[min(per)]
        assert first.shape is not None
        rows, cols = first.shape
        if proj == "gate":
            up = experts.get((owner, "up"), {})
            rows += up[min(up)].shape[0] if up and up[min(up)].shape else 0  # type: ignore[index]
            view[f"{owner}.gate_up_proj"] = Weight(first.dtype, (e, rows, cols), first.file, first.quantized)
        else:
            view[f"{owner}.down_proj"] = Weight(first.dtype, (e, rows, cols), first.file, first.quantized)
    return view


def renamed_on_load(weights: Mapping[str, Weight], config: Mapping[str, Any] | None) -> dict[str, str]:
    """Loaded name -> stored name for the stored `weights` that transformers 5 renames on load (a Llava-style
    wrapper's `language_model.model.` to `model.language_model.`, ...), given the model's `config`: the renames
    in `BaseModel.loaded_weights`. Fused expert stacks are new weights, not renames, and are left out."""
    return _renames(weights, _loaded_view(weights, config))


def _renames(weights: Mapping[str, Weight], view: Mapping[str, Weight]) -> dict[str, str]:
    stored = {id(w): n for n, w in weights.items()}
    return {new: stored[id(w)] for new, w in view.items() if id(w) in stored}


def _split_single_file(weights: dict[str, Weight], path: str) -> dict[str, BaseModel]:
    """Components of a single-file diffusion checkpoint, by key prefix; {} for anything else."""
    if not any(n.startswith(_ANY_SINGLE_FILE) for n in weights):
        return {}
    parts: dict[str, dict[str, Weight]] = {}
    for name, w in weights.items():
        for prefix, comp in SINGLE_FILE_PREFIXES:
            if name.startswith(prefix):
                parts.setdefault(comp, {})[name[len(prefix) :]] = w
                break
    if "denoiser" not in parts:
        bare = {n: w for n, w in weights.items() if n.startswith(_BARE_DENOISER_KEYS)}
        if not bare or not any(n.startswith(("double_blocks.", "joint_blocks.", "input_blocks.")) for n in bare):
            return {}
        parts["denoiser"] = bare
    den = parts.pop("denoiser")
    den_name = "unet" if any(n.startswith("input_blocks.") for n in den) else "transformer"
    comps = {den_name: BaseModel(f"{path}#{den_name}", "component", den, None, None, {}, (path,))}
    for comp, ws in parts.items():
        comps[comp] = BaseModel(f"{path}#{comp}", "component", ws, None, None, {}, (path,))
    return comps


def _single_file_arch(comps: Mapping[str, BaseModel]) -> str | None:
    from .families import identify_weights

    return identify_weights(comps)


def _architecture(config: Mapping[str, Any] | None) -> str | None:
    if not config:
        return None
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    cls = config.get("_class_name")
    return cls if isinstance(cls, str) else None


def _json(src: LocalFiles | _Remote, rel: str, code: str) -> dict[str, Any]:
    try:
        data = json.loads(src.text(rel))
    except FileNotFoundError:
        raise BaseModelError(
            f"missing {src.join(rel)}", "missing_config" if code == "bad_config" else "bad_index", src.join(rel)
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BaseModelError(f"{src.join(rel)} is not valid JSON: {e}", code, src.join(rel)) from None
    except RecursionError:  # json's C decoder recurses once per level: `[` x 100,000 overflows it
        raise BaseModelError(
            f"{src.join(rel)} is not valid JSON: it nests deeper than Python's recursion limit", code, src.join(rel)
        ) from None
    if not isinstance(data, dict):
        raise BaseModelError(f"{src.join(rel)} is not a JSON object", code, src.join(rel))
    return data


def _required_json(src: LocalFiles | _Remote, rel: str) -> dict[str, Any]:
    if not src.exists(rel):
        raise BaseModelError(
            f"{src.join()} has weights but no {rel}; pass the model folder with its config",
            "missing_config",
            src.join(rel),
        )
    return _json(src, rel, "bad_config")


def optional_json(src: LocalFiles | _Remote, rel: str) -> dict[str, Any] | None:
    return _json(src, rel, "bad_config") if src.exists(rel) else None


__all__ = ["BaseModel", "BaseModelError", "Weight", "read_base", "renamed_on_load"]
