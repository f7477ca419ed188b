"""`lorafast.convert(adapter, to, out)`: rewrite an adapter into another layout, exactly, streamed;
`lorafast.convert([adapters or folders], to, out_dir)`: many, each into `out_dir/<name>`."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, overload

from lorafast.adapter import Adapter
from lorafast.converting import kohya, moe
from lorafast.converting.errors import ConvertError
from lorafast.converting.peftconfig import Want, build, mismatches
from lorafast.converting.writer import SHA_PLACEHOLDER, OutputFolder, OutTensor, SourceBytes, write_file, writing
from lorafast.errors import HeaderError, LorafastError
from lorafast.tensors import TensorFile, TruncatedFileError

#: layouts `to` accepts: the MoE layouts, `transformers5` (numbered expert names to transformers 5's fused
#: experts, as PEFT loads them) and `peft` (a PEFT folder from kohya or old diffusers files)
LAYOUTS = (*moe.MOE_TARGETS, "peft")
#: which source layouts each target takes
_FROM: dict[str, tuple[str, ...]] = {
    "stacked_3d": ("shared_outer", "per_expert_2d", "peft_target_parameters"),
    "shared_outer": ("stacked_3d", "per_expert_2d", "peft_target_parameters"),
    "per_expert_2d": ("stacked_3d", "shared_outer", "peft_target_parameters"),
    "peft_target_parameters": ("stacked_3d", "shared_outer", "per_expert_2d"),
    "transformers5": ("per_expert_2d",),
    "peft": ("kohya", "diffusers_legacy"),
}
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"


@dataclass(frozen=True)
class ConvertResult:
    """What `convert` wrote."""

    source: str
    out: str
    from_layout: str
    to_layout: str
    files: tuple[str, ...]
    tensors: int
    bytes: int  # tensor data written
    source_bytes: int  # tensor data of the source
    source_sha256: str  # sha256 of the source's data section (kohya's content hash)
    seconds: float
    #: what the caller should know about the output (kohya names kept flattened, ...); also in the metadata
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect_layout(adapter: Adapter) -> str:
    """The layout `convert` sees in an adapter: a MoE layout, `kohya`, `diffusers_legacy`, or `dense`."""
    if adapter.format in kohya.SOURCE_FORMATS:
        return str(adapter.format.value)
    return moe.source_layout(adapter)


AdapterLike = Adapter | str | os.PathLike[str]


def _unreadable(path: str, code: str | None, message: object) -> ConvertError:
    """A source that cannot be read (its header's error code, when it has one)."""
    why = "truncated" if code == "incomplete_buffer" else "bad_source"
    return ConvertError(f"cannot read adapter {path}: {message}", why, path)


def _inspect(adapter: AdapterLike) -> Adapter:
    if isinstance(adapter, Adapter):
        return adapter
    from lorafast.scanning import inspect

    path = os.fspath(adapter)
    try:
        return inspect(path)
    except HeaderError as exc:
        raise _unreadable(path, exc.code, exc) from exc
    except (LorafastError, OSError) as exc:
        raise _unreadable(path, None, exc) from exc


def expand(items: Sequence[AdapterLike]) -> list[Adapter | ConvertError]:
    """The adapters `items` name, in order: a folder of adapters stands for every adapter `lorafast.scan` finds
    under it; what cannot be read (or a path with no adapter) is a `ConvertError` in its place."""
    from lorafast.scanning import scan

    out: list[Adapter | ConvertError] = []
    for item in items:
        if isinstance(item, Adapter):
            out.append(item)
            continue
        path = os.fspath(item)
        report = scan([path], progress=False)
        found = [*report, *(_unreadable(str(p), str(code), msg) for p, code, msg in report.errors)]
        out.extend(found or [ConvertError(f"no adapter found at {path}", "bad_source", path)])
    return out


def _content_hash(fd: int, start: int, box: list[str | BaseException]) -> None:
    """sha256 of the data section (bytes after the header), as `inspect(content_hash=True)` and kohya compute it.
    `fd` (closed here) is a duplicate of the descriptor the data is copied from, so the hash is of the file that
    was read even if the path names another one by now. Read with `pread` (a file truncated meanwhile gives an
    error, not SIGBUS); hashlib releases the GIL."""
    try:
        h = hashlib.sha256()
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        pos = start
        while n := os.preadv(fd, [buf], pos):
            h.update(view[:n])
            pos += n
        box.append(h.hexdigest())
    except BaseException as exc:  # reported by the writer, which is waiting for it
        box.append(exc)
    finally:
        os.close(fd)


@overload
def convert(
    adapter: AdapterLike,
    to: str,
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    source_layout: str | None = None,
    gate_up: str | None = None,
) -> ConvertResult: ...


@overload
def convert(
    adapter: list[AdapterLike] | tuple[AdapterLike, ...],
    to: str,
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    source_layout: str | None = None,
    gate_up: str | None = None,
) -> list[ConvertResult | ConvertError]: ...


def convert(
    adapter: AdapterLike | list[AdapterLike] | tuple[AdapterLike, ...],
    to: str,
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    source_layout: str | None = None,
    gate_up: str | None = None,
) -> ConvertResult | list[ConvertResult | ConvertError]:
    """Write `adapter` converted to layout `to` (one of `LAYOUTS`) as a PEFT folder `out`.

    `source_layout` (`--from`) asserts the source layout; without it the scan's classification is used. The
    result is exact (the merged delta is bit-identical) or the call raises `ConvertError` and writes nothing.
    `gate_up` (`--gate-up`): `interleaved` when the adapter was made on (or is meant for) transformers' GPT-OSS,
    whose fused gate_up alternates gate and up rows; `concatenated` otherwise; default: `interleaved` when the
    adapter config's `base_model_name_or_path` names a GPT-OSS. It orders the `target_parameters` side only: the
    SGLang layouts always hold gate rows then up rows (SGLang interleaves them itself on load).

    A list (or tuple) of adapters, paths or folders of adapters (expanded as `lorafast.scan` finds them) writes
    each adapter to `out/<name>` and returns one entry per adapter, in order: its `ConvertResult`, or the
    `ConvertError` that refused it (nothing of it written; the others go on).

    No conversion needs torch: each one moves bits (numpy, `sendfile`, `writev`, `preadv`), whatever the dtype.
    torch is imported only to read fp8 values: an fp8 kohya `.alpha`, and the max difference that an fp8
    adapter's `lossy` refusal reports (`bits.as_float64`).
    """
    options = _Options(overwrite, source_layout, gate_up)
    if isinstance(adapter, (list, tuple)):
        return _convert_many(adapter, to, out, options)
    return _convert_one(adapter, to, out, options)


@dataclass(frozen=True)
class _Options:
    """`convert`'s keyword options, the same for each adapter of a list."""

    overwrite: bool
    source_layout: str | None
    gate_up: str | None


def _convert_many(
    items: Sequence[AdapterLike], to: str, out_dir: str | os.PathLike[str], options: _Options
) -> list[ConvertResult | ConvertError]:
    results: list[ConvertResult | ConvertError] = []
    taken: dict[str, str] = {}  # output -> the source written there by this call
    for found in expand(items):
        if isinstance(found, ConvertError):
            results.append(found)
            continue
        dest = os.path.join(os.fspath(out_dir), found.name)
        if dest in taken:  # two sources with one name: neither may replace the other's output
            why = f"{dest} is the output of {taken[dest]} already; convert {found.path} on its own"
            results.append(ConvertError(why, "exists", dest))
            continue
        taken[dest] = found.path
        try:
            results.append(_convert_one(found, to, dest, options))
        except ConvertError as exc:
            results.append(exc)
    return results


def _convert_one(adapter: AdapterLike, to: str, out: str | os.PathLike[str], options: _Options) -> ConvertResult:
    started = time.perf_counter()
    if to not in LAYOUTS:
        raise ConvertError(f"unknown layout {to!r}; expected one of {', '.join(LAYOUTS)}", "unsupported")
    ad = _inspect(adapter)
    path = ad.path
    found = detect_layout(ad)
    if options.source_layout is not None and options.source_layout != found:
        raise ConvertError(f"{path} is {found}, not {options.source_layout}", "layout_mismatch", path)
    if found not in _FROM[to]:
        why = "already is" if found == to else "is"
        takes = f"takes {', '.join(_FROM[to])}"
        raise ConvertError(
            f"{path} {why} {found}; to={to!r} {takes}",
            "layout_mismatch" if found in ("dense",) or found == to else "unsupported",
            path,
            cli=f"{path} {why} {found}; --to {to} {takes}",
        )
    weights = [w for w in ad.weight_files if w.endswith(".safetensors")]
    if len(ad.weight_files) != 1 or not weights:
        raise ConvertError(f"{path}: only single-file safetensors adapters are converted", "unsupported", path)
    src = weights[0]
    folder = OutputFolder(os.fspath(out), options.overwrite)
    try:
        with TensorFile(src) as tf:
            sizes = sum(e.end - e.begin for e in tf.tensors.values())
            tensors, config, notes, wants = _plan(ad, tf, found, to, moe.gate_up_order(ad, options.gate_up))
            _check_names(tensors, path)
            box: list[str | BaseException] = []
            hash_fd = os.dup(tf.fileno())
            hasher = threading.Thread(target=_content_hash, args=(hash_fd, tf.data_start, box), daemon=True)
            hasher.start()

            def sha() -> str:
                hasher.join()
                got = box[0]
                if isinstance(got, BaseException):
                    raise ConvertError(f"cannot hash {src}: {got}", "bad_source", path) from got
                return got

            meta = dict(tf.metadata)
            meta.setdefault("format", "pt")
            meta["lorafast.converted"] = json.dumps(
                {
                    "from": found,
                    "to": to,
                    "source": os.path.basename(src),
                    "source_sha256": SHA_PLACEHOLDER,
                    "lorafast_version": _version(),
                    **({"notes": list(notes)} if notes else {}),
                },
                separators=(",", ":"),
            )
            written = write_file(folder.join(WEIGHTS_NAME), tensors, meta, sha, folder.shown(WEIGHTS_NAME))
            digest = sha()
        files = [WEIGHTS_NAME]
        if config is not None:
            with writing(folder.shown(CONFIG_NAME)), open(folder.join(CONFIG_NAME), "w") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
            files.append(CONFIG_NAME)
            _check_scales(folder.join(CONFIG_NAME), wants, path)
        folder.commit()
    except TruncatedFileError as exc:
        raise ConvertError(f"{src} is truncated: {exc}", "truncated", path) from exc
    except HeaderError as exc:  # the source changed since it was inspected
        if exc.code in ("incomplete_buffer", "invalid_header_length"):  # cut short
            raise ConvertError(f"{src} is truncated: {exc}", "truncated", path) from exc
        raise ConvertError(f"cannot read {src}: {exc}", "bad_source", path) from exc
    except OSError as exc:  # output errors are ConvertErrors by now (`writing`): this is the source
        raise ConvertError(f"cannot read {src}: {exc}", "bad_source", path) from exc
    finally:
        folder.discard()
        moe.release_scratch()
    return ConvertResult(
        path,
        folder.out,
        found,
        to,
        tuple(os.path.join(folder.out, f) for f in files),
        len(tensors),
        written,
        sizes,
        digest,
        time.perf_counter() - started,
        notes,
    )


def _check_names(tensors: list[OutTensor], path: str) -> None:
    """Refuse an output in which two tensors would have one name (kohya's `lora_te_` and `lora_te1_` both name the
    first text encoder): the file would hold both and its header one."""
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise ConvertError(f"{path}: two modules would both be written as {t.name!r}", "unsupported", path)
        seen.add(t.name)


def _check_scales(config_path: str, wants: list[Want], path: str) -> None:
    """Refuse the output unless the config as written gives every module the source's rank and alpha under
    PEFT's pattern rule: the merged delta is the same only if every scale is."""
    with open(config_path) as f:
        bad = mismatches(json.load(f), wants)
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ConvertError(
            f"{path}: the converted config would change scales: {'; '.join(bad[:3])}{more}", "lossy", path
        )


def _version() -> str:
    from lorafast import __version__

    return __version__


def _copy(tf: TensorFile, name: str, new: str | None = None) -> OutTensor:
    e = tf.entry(name)
    return OutTensor(new or name, e.dtype, e.shape, lambda: iter([SourceBytes(tf, name)]))


def _plan(
    ad: Adapter, tf: TensorFile, found: str, to: str, gate_up: str = "concatenated"
) -> tuple[list[OutTensor], dict[str, Any] | None, tuple[str, ...], list[Want]]:
    """The output's tensors, its config (None: none written), notes, and what each module's scale must be."""
    if to == "peft":
        tensors, wants, dotted = kohya.plan_peft(ad, tf)
        return tensors, build(None, wants, []), () if dotted else (kohya.FLATTENED_NOTE,), wants
    groups, covered = moe.read_groups(ad, tf)
    if not groups:
        raise ConvertError(f"{ad.path}: no expert modules found", "layout_mismatch", ad.path)
    interleaved = gate_up == "interleaved"
    notes: tuple[str, ...] = ()
    if interleaved and found == "peft_target_parameters":
        groups = moe.deinterleave(groups, ad.path)
        notes = ("gate_up lora_B rows read in GPT-OSS's interleaved order, written gate rows then up rows",)
    elif interleaved and to in ("peft_target_parameters", "transformers5"):
        notes = ("gate_up lora_B rows written in GPT-OSS's interleaved order",)
    rename = moe.mixtral_to_v5 if to == "transformers5" else None
    if to == "stacked_3d":
        new, mods = moe.write_stacked(groups, False, ad.path)
    elif to == "shared_outer":
        new, mods = moe.write_stacked(groups, True, ad.path)
    elif to == "per_expert_2d":
        new, mods = moe.write_numbered(groups)
    else:
        new, mods = moe.write_target_parameters(groups, ad.path, rename, interleaved)
    kept = [m for m in ad.modules if m.a_key not in covered]
    others = [n for n in sorted(tf.tensors, key=lambda n: tf.tensors[n].begin) if n not in covered]
    tensors = [_copy(tf, n, rename(n) if rename else None) for n in others] + new
    if ad.config is None:
        return tensors, None, notes, []
    wants = [Want(rename(m.name) if rename else m.name, m.leaf, m.rank or 0, m.alpha) for m in kept]
    wants += [Want(m.name, m.leaf, m.rank, m.alpha, m.parameter) for m in mods]
    params = [".".join(m.name.split(".")[-3:]) for m in mods if m.parameter]
    return tensors, build(ad.config, wants, params, widest=True), notes, wants


__all__ = ["LAYOUTS", "ConvertResult", "convert", "detect_layout", "expand"]
