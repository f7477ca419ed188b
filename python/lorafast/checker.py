"""`check`: does each adapter fit each base model? Header-only, for a whole fleet at once.

For every (adapter, base) pair each adapter module is mapped onto a base weight by the engines' rule (exact
module paths, after PEFT's `base_model.model.` prefix and a pipeline component prefix are removed; kohya's
underscore names by their flattened form) and its factor shapes are fitted with the same functions `merge` uses
(`lorafast.naming`), so check and merge never disagree on a fit. A module found only under another prefix
(`model.layers.…` against a multimodal `model.language_model.layers.…`) counts as missing: the engines match it
nowhere and serve the base model. Such modules carry a hint naming the prefix that would fix them.

Verdicts: `ok` (every module maps and fits), `partial` (some modules match no weight; engines ignore them),
`no_match` (no module matches: an engine that checks leaf names loads it and serves the base model),
`shape_mismatch` (a module maps to a weight it does not fit: the load fails) and `error` (unreadable adapter).

Speed: adapters whose headers are byte-identical in their tensor entries (one recipe, one rank) share one
structure; each structure is classified once and checked once per base, and the per-pair counts are spread
over the fleet with numpy. Bases are read once.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from . import _core
from ._records import record
from .adapter import Adapter, LoraModule
from .base import BaseModel, read_base
from .naming import (
    NameMatch,
    NameTable,
    WeightSpec,
    is_kohya,
    plan_linear,
    plan_stacked,
    plan_target_parameters,
    prod,
    stack_shape,
)

if TYPE_CHECKING:
    import numpy as np

VERDICTS: tuple[str, ...] = ("ok", "partial", "no_match", "shape_mismatch", "error")
OK, PARTIAL, NO_MATCH, SHAPE_MISMATCH, ERROR = range(5)
#: module statuses
MODULE_STATUSES = ("ok", "missing", "prefix_only", "shape_mismatch", "no_component", "unverified")

_PEFT_PREFIXES = ("peft_model.base_model.model.", "base_model.model.")
#: diffusers PEFT key prefixes and kohya prefixes -> pipeline component
_COMPONENT_KEYS: tuple[tuple[str, str], ...] = (
    ("unet.", "unet"),
    ("transformer.", "transformer"),
    ("text_encoder_2.", "text_encoder_2"),
    ("text_encoder.", "text_encoder"),
    ("prior.", "prior"),
    ("decoder.", "decoder"),
)
_KOHYA_KEYS: tuple[tuple[str, str], ...] = (
    ("lora_unet_", "unet"),
    ("lora_te1_", "text_encoder"),
    ("lora_te2_", "text_encoder_2"),
    ("lora_te_", "text_encoder"),
    ("lora_transformer_", "transformer"),
    ("lora_prior_unet_", "prior"),
)
_DENOISERS = ("unet", "transformer", "prior", "decoder")
# a flat {str: str} __metadata__ object (run-specific kohya keys): left out of the structure key
_METADATA = re.compile(rb'"__metadata__"\s*:\s*\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\}\s*,?')
#: adapter_config.json fields that change which modules exist or how their shapes are read
_CONFIG_FIELD = re.compile(
    rb'"(peft_type|fan_in_fan_out|target_parameters|use_dora|lora_bias)"\s*:\s*("[^"]*"|true|false|null|\[[^\]]*\])'
)


@dataclass(frozen=True)
class ModuleCheck:
    """One adapter module against one base: the weight it maps to, the shape it needs and the one there is."""

    module: str
    """The module key as in the adapter file."""
    status: str
    """One of `MODULE_STATUSES`."""
    weight: str | None = None
    expected: tuple[int, ...] | None = None
    """The (out, in[, kernel]) the factors need."""
    actual: tuple[int, ...] | None = None
    """The base weight's (logical) shape."""
    hint: str | None = None


@dataclass(frozen=True)
class EngineOutcome:
    """What the engine does with this adapter on this base: `accepted`, `rejected` (with its exact errors, or a
    note where the failure comes when the weights are copied), `not_applied` (it loads and changes nothing), or
    `unknown` when it passes the rules of a version lorafast has not verified (`version_status` says which)."""

    engine: str
    version: str | None
    outcome: str
    errors: tuple[str, ...] = ()
    note: str | None = None
    version_status: str = "verified"


@dataclass(frozen=True)
class PairResult:
    adapter: str
    base: str
    verdict: str
    matched: int
    missing: int
    mismatched: int
    modules: tuple[ModuleCheck, ...]
    hint: str | None = None
    engine: EngineOutcome | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def to_dict(self, modules: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "adapter": self.adapter,
            "base": self.base,
            "verdict": self.verdict,
            "matched": self.matched,
            "missing": self.missing,
            "mismatched": self.mismatched,
            "hint": self.hint,
            "error": self.error,
        }
        if self.engine is not None:
            d["engine"] = vars(self.engine) | {"errors": list(self.engine.errors)}
        if modules:
            d["modules"] = [vars(m) for m in self.modules if m.status != "ok"]
        return d


# ---------------------------------------------------------------------------------------------------------------
# One base: its weights, and the lookups a module path needs


class _BaseIndex:
    def __init__(self, base: BaseModel) -> None:
        self.base = base
        # a module path may name a weight as stored or as transformers names it once loaded
        models: dict[str | None, BaseModel] = {None: base}
        if base.components:
            models = {c: m for c, m in base.components.items()}
        self.comps: dict[str | None, Mapping[str, Any]] = {
            c: {**m.weights, **m.loaded_weights} for c, m in models.items()
        }
        # stored names that transformers renames on load: hints name the loaded form
        self._renamed = {c: set(m.renamed_on_load.values()) for c, m in models.items()}
        self.denoiser = next((c for c in _DENOISERS if c in self.comps), None)
        self._tables: dict[str | None, NameTable] = {}
        self.cache: dict[Any, ModuleCheck] = {}

    def route(self, key: str) -> tuple[str | None, str, bool, str | None]:
        """(component, path inside it, kohya form, missing component) for an adapter module key."""
        for p in _PEFT_PREFIXES:
            if key.startswith(p):
                key = key[len(p) :]
                break
        whole = key
        comp: str | None = None
        kohya = False
        for p, c in _KOHYA_KEYS:
            if key.startswith(p):
                key, comp, kohya = key[len(p) :], c, True
                break
        else:
            for p, c in _COMPONENT_KEYS:
                if key.startswith(p):
                    key, comp = key[len(p) :], c
                    break
        if None in self.comps:
            # a single model: it is the pipeline's denoiser (or the text encoder checkpoint it was given as); the
            # name rule tries the key with and without its component prefix
            return None, whole, kohya, None
        if comp is None:
            comp = self.denoiser
            if comp is None:
                return None, key, kohya, "denoiser"
        if comp not in self.comps:
            return None, key, kohya, comp
        return comp, key, kohya, None

    def table(self, comp: str | None) -> NameTable:
        """The name rule `merge` uses (`naming.NameTable`) on one component's weights. Stored names that
        transformers renames on load match exactly but are never offered as a prefix-only match."""
        table = self._tables.get(comp)
        if table is None:
            table = self._tables[comp] = NameTable(self.comps[comp], self._renamed.get(comp, set()))
        return table


def _expected(m: LoraModule) -> tuple[int, ...] | None:
    a, b = m.a_shape, m.b_shape
    if a is None or b is None:
        if m.in_features and m.out_features:
            return (m.out_features, m.in_features)
        return None
    if m.kind == "embedding" and len(a) == 2 and len(b) == 2:
        return (a[1], b[0])
    if m.kind == "stacked_3d" and len(a) == 3 and len(b) == 3:
        return (max(a[0], b[0]), b[1], a[2])
    if m.kind == "conv" and len(a) > 2:
        return (b[0], a[1], *a[2:])
    if m.kind == "target_parameters" and len(a) == 2 and len(b) == 2:
        return (b[0], a[1])
    return (b[0], prod(a[1:]))


def _spec(shape: tuple[int, ...]) -> WeightSpec:
    return WeightSpec(tuple(shape), cast(Any, None))  # fitting reads the shape only


def _fit(m: LoraModule, shape: tuple[int, ...], fifo: bool) -> str | None:
    """Why the module's factors do not fit a weight of `shape`, or None when they do (merge's own rules)."""
    spec = _spec(shape)
    if m.kind == "stacked_3d":
        form, why = plan_stacked(m, spec)
    elif m.kind == "target_parameters":
        form, why, _ = plan_target_parameters(m, spec)
    elif m.kind in ("linear", "conv", "embedding", "expert_2d"):
        form, why = plan_linear(m.kind, m, spec, fifo and m.kind in ("linear", "expert_2d"))
    else:  # LyCORIS variants: compare the in/out features the factors imply
        e, rows, cols = stack_shape(shape)
        if m.in_features is None or m.out_features is None:
            return None
        if (rows, cols) == (m.out_features, m.in_features) or (rows, cols) == (m.out_features, m.in_features * 1):
            return None
        return f"{m.kind} module of {m.out_features}x{m.in_features} does not fit weight {list(shape)}"
    return None if form is not None else why


def _lookup(index: _BaseIndex, comp: str | None, path: str, m: LoraModule, kohya: bool) -> NameMatch:
    """The module's weight by `merge`'s name rule: an exact match, else the prefix-only match merge refuses."""
    weights = index.comps[comp]
    if m.kind == "target_parameters":
        owner = re.sub(r"\.base_layer\b", "", path)
        for cand in (owner, f"{owner}.{m.leaf}"):
            w = weights.get(cand)
            if w is not None and w.shape is not None and len(w.shape) == 3:
                return NameMatch(cand)
        return NameMatch()
    table = index.table(comp)
    hit = table.match(path, ".weight", kohya)
    if hit.weight is None and m.kind == "stacked_3d":
        fused = table.match(path, "", kohya)  # a fused expert parameter (`experts.gate_up_proj`)
        if fused.weight is not None:
            return fused
    return hit


def _check_module(index: _BaseIndex, m: LoraModule, fifo: bool) -> ModuleCheck:
    key = (m.key, m.kind, m.a_shape, m.b_shape, m.in_features, m.out_features, fifo)
    cached = index.cache.get(key)
    if cached is not None:
        return cached
    comp, path, kohya, absent = index.route(m.key)
    expected = _expected(m)
    if absent is not None:
        have = sorted(c for c in index.comps if c is not None)
        res = ModuleCheck(
            m.key,
            "no_component",
            None,
            expected,
            None,
            f"the base has no {absent} component (it has {', '.join(have) or 'none'})",
        )
    else:
        hit = _lookup(index, comp, path, m, kohya or is_kohya(m.key))
        weight = hit.weight

        def qual(w: str) -> str:
            return w if comp is None else f"{comp}.{w}"

        if weight is None:
            if hit.prefixed is not None:
                w = index.comps[comp][hit.prefixed]
                hint = (
                    f"the base names this weight {hit.prefixed!r}: {hit.prefix_hint}; rename the adapter's "
                    "keys to match (merge takes it only with allow_prefix=True)"
                )
                res = ModuleCheck(m.key, "prefix_only", qual(hit.prefixed), expected, w.shape, hint)
            else:
                res = ModuleCheck(m.key, "missing", None, expected, None, None)
        else:
            w = index.comps[comp][weight]
            if w.shape is None:
                res = ModuleCheck(
                    m.key,
                    "unverified",
                    qual(weight),
                    expected,
                    None,
                    f"{w.quantized} weight: its shape is not in the header",
                )
            else:
                why = _fit(m, w.shape, fifo)
                status = "ok" if why is None else "shape_mismatch"
                res = ModuleCheck(m.key, status, qual(weight), expected, w.shape, why)
    index.cache[key] = res
    return res


@dataclass
class _Outcome:
    verdict: int
    matched: int
    missing: int
    mismatched: int
    prefix_only: int
    modules: tuple[ModuleCheck, ...]
    hint: str | None


def _check_adapter(index: _BaseIndex, adapter: Adapter) -> _Outcome:
    fifo = bool((adapter.config or {}).get("fan_in_fan_out", False))
    checks = tuple(_check_module(index, m, fifo) for m in adapter.modules)
    matched = sum(c.status in ("ok", "unverified") for c in checks)
    mismatched = sum(c.status == "shape_mismatch" for c in checks)
    prefix = [c for c in checks if c.status == "prefix_only"]
    missing = len(checks) - matched - mismatched
    hint = None
    if mismatched:
        verdict = SHAPE_MISMATCH
        first = next(c for c in checks if c.status == "shape_mismatch")
        hint = f"{mismatched} modules do not fit, first {first.module!r}: {first.hint}"
    elif not matched:
        verdict = NO_MATCH
        if prefix:
            hint = f"no module path exists in this base; {prefix[0].hint}"
        elif checks and checks[0].status == "no_component":
            hint = checks[0].hint
        elif not checks:
            hint = "the adapter has no modules"
    elif missing:
        verdict = PARTIAL
        miss = next(c for c in checks if c.status != "ok" and c.status != "unverified" and c.status != "shape_mismatch")
        hint = f"{missing} of {len(checks)} modules match no weight, first {miss.module!r}"
        if miss.hint:
            hint += f": {miss.hint}"
    else:
        verdict = OK
    return _Outcome(verdict, matched, missing, mismatched, len(prefix), checks, hint)


# ---------------------------------------------------------------------------------------------------------------
# The fleet: adapters grouped by structure


def _structure_key(weights: str, config: str | None) -> tuple[tuple[Any, ...], bytes] | None:
    """Everything a check reads from one adapter: a short key to bucket by (hashing 50 KB headers would cost more
    than reading them) and the exact bytes compared within a bucket: the tensor entries (run-specific
    `__metadata__` left out), the data size and the structural config fields. None when unreadable this way.
    Plain `os` calls: a buffered `open` costs more syscalls than the read itself."""
    try:
        fd = os.open(weights, os.O_RDONLY)
        try:
            head = os.pread(fd, 64 << 10, 0)
            if len(head) < 8:
                return None
            n = int.from_bytes(head[:8], "little")
            if n > (100 << 20):
                return None
            if len(head) < 8 + n:
                head += os.pread(fd, 8 + n - len(head), len(head))
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
    except OSError:
        return None
    entries = head[8 : 8 + n]
    at = entries.find(b'"__metadata__"', 0, 4096)  # writers put it first; one found later only shares less
    if at >= 0:
        m = _METADATA.match(entries, at)
        if m is not None:
            entries = entries[:at] + entries[m.end() :]
    cfg: tuple[Any, ...] = ()
    if config is not None:
        try:
            fd = os.open(config, os.O_RDONLY)
            try:
                text = os.read(fd, 1 << 16)
                while len(text) % (1 << 16) == 0 and 0 < len(text) < 1 << 24:  # a config over 64 KiB
                    more = os.read(fd, 1 << 16)
                    if not more:
                        break
                    text += more
            finally:
                os.close(fd)
        except OSError:
            return None
        cfg = tuple(_CONFIG_FIELD.findall(text))
    return (size - 8 - n, len(entries), cfg, entries[:256], entries[-256:]), entries


def _structure_keys(todo: list[tuple[str, str, str | None]], threads: int | None) -> list[Any]:
    """`_structure_key` of each (path, weights, config), read by a few threads: the reads release the GIL, so
    one adapter's page-cache miss does not stall the others."""
    workers = max(1, min(threads or os.cpu_count() or 1, 8))
    if workers == 1 or len(todo) < 512:
        return [_structure_key(w, c) for _, w, c in todo]
    from concurrent.futures import ThreadPoolExecutor

    step = 256
    chunks = [todo[i : i + step] for i in range(0, len(todo), step)]
    with ThreadPoolExecutor(workers) as pool:
        parts = pool.map(lambda chunk: [_structure_key(w, c) for _, w, c in chunk], chunks)
        return [k for part in parts for k in part]


class _Fleet:
    """Adapters in input order, each pointing at the structure (representative `Adapter`) it shares."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.struct_of: list[int] = []  # -1: failed
        self.structs: list[Adapter] = []
        self.errors: dict[int, tuple[str, str]] = {}  # row -> (code, message)


def _gather(
    adapters: Any, threads: int | None, storage_options: Mapping[str, Any] | None, timeout: float | None
) -> _Fleet:
    from .scanning import ScanReport, adapter_from_raw
    from .scanning._common import storage_items

    fleet = _Fleet()
    items: list[Any]
    if isinstance(adapters, ScanReport):
        items = list(adapters.paths)
        failed = {p: (c, m) for p, c, m in adapters.errors}
    elif isinstance(adapters, (str, os.PathLike, Adapter)):
        items, failed = [adapters], {}
    else:
        items, failed = list(adapters), {}
    storage = storage_items(storage_options)

    def add_adapter(path: str, adapter: Adapter) -> None:
        fleet.paths.append(path)
        fleet.struct_of.append(len(fleet.structs))
        fleet.structs.append(adapter)

    def add_error(path: str, code: str, message: str) -> None:
        fleet.errors[len(fleet.paths)] = (code, message)
        fleet.paths.append(path)
        fleet.struct_of.append(-1)

    pending: list[str] = []  # local/remote paths, resolved together so discovery runs in parallel

    def flush() -> None:
        if not pending:
            return
        urls = [p for p in pending if "://" in p]
        targets = _core.discover_targets([p for p in pending if "://" not in p], True, threads, None, None, None)
        buckets: dict[tuple[Any, ...], list[tuple[bytes, int]]] = {}  # short key -> (exact bytes, representative)
        todo: list[tuple[str, str, str | None]] = []
        for path, weights, config, code, message in targets:
            if code is not None or weights is None:
                add_error(path, code or "no_weights", message or "no weights")
                continue
            if path in failed:
                add_error(path, *failed[path])
                continue
            todo.append((path, weights, config))
        rows = list(zip((p for p, _, _ in todo), _structure_keys(todo, threads), strict=True))
        reps: list[str] = []
        rep_of: list[int] = []
        for path, key in rows:
            if key is not None:
                bucket = buckets.setdefault(key[0], [])
                hit = next((r for exact, r in bucket if exact == key[1]), None)  # memcmp, not a hash
                if hit is not None:
                    rep_of.append(hit)
                    continue
                bucket.append((key[1], len(reps)))
            rep_of.append(len(reps))
            reps.append(path)
        raw = _core.inspect_many(reps, "pread", False, threads, None, None, None) if reps else []
        structs = [r if isinstance(r, Exception) else adapter_from_raw(r) for r in raw]
        base_struct = len(fleet.structs)
        ok_index: dict[int, int] = {}
        for i, s in enumerate(structs):
            if not isinstance(s, Exception):
                ok_index[i] = len(fleet.structs)
                fleet.structs.append(s)
        for (path, _key), r in zip(rows, rep_of, strict=True):
            s = structs[r]
            if isinstance(s, Exception):
                if reps[r] != path:  # its own error message, naming its own file
                    try:
                        add_adapter(path, adapter_from_raw(_core.inspect(path, "pread", False, None, None)))
                        continue
                    except Exception as e:  # reported per adapter, as scan does
                        s = e
                add_error(path, str(getattr(s, "code", type(s).__name__)), str(s))
            else:
                fleet.paths.append(path)
                fleet.struct_of.append(ok_index[r])
        del base_struct
        if urls:
            remote = _core.inspect_many(urls, "pread", False, threads, storage, timeout, None)
            for url, got in zip(urls, remote, strict=True):
                if isinstance(got, Exception):
                    add_error(url, str(getattr(got, "code", type(got).__name__)), str(got))
                else:
                    add_adapter(url, adapter_from_raw(got))
        pending.clear()

    for item in items:
        if isinstance(item, Adapter):
            flush()
            add_adapter(item.path, item)
        else:
            pending.append(os.fspath(item))
    flush()
    return fleet


# ---------------------------------------------------------------------------------------------------------------
# The report


class CheckReport:
    """Every (adapter, base) pair. `columns()` gives one numpy row per pair; iterating gives `PairResult`s."""

    def __init__(
        self,
        fleet: _Fleet,
        bases: list[BaseModel],
        table: list[list[_Outcome]],
        engines: dict[tuple[int, int], EngineOutcome],
    ) -> None:
        import numpy as np

        self.adapters = fleet.paths
        self.bases = bases
        self._fleet = fleet
        self._table = table  # [base][structure]
        self._engines = engines
        s = len(fleet.structs)
        nb = len(bases)
        per = np.zeros((nb, s + 1, 5), dtype=np.int64)  # the last row stands for failed adapters
        per[:, s, 0] = ERROR
        for b, outs in enumerate(table):
            for i, o in enumerate(outs):
                per[b, i] = (o.verdict, o.matched, o.missing, o.mismatched, o.prefix_only)
        struct = np.asarray(fleet.struct_of, dtype=np.int64)
        struct = np.where(struct < 0, s, struct)
        grid = per[:, struct, :]  # (bases, adapters, 5)
        self._grid = grid
        n = len(fleet.paths)
        self._cols: dict[str, np.ndarray] = {
            "adapter_index": np.tile(np.arange(n, dtype=np.int64), nb),
            "base_index": np.repeat(np.arange(nb, dtype=np.int64), n),
            "verdict": grid[:, :, 0].reshape(-1).astype(np.int8),
            "matched": grid[:, :, 1].reshape(-1),
            "missing": grid[:, :, 2].reshape(-1),
            "mismatched": grid[:, :, 3].reshape(-1),
            "prefix_only": grid[:, :, 4].reshape(-1),
        }

    def columns(self) -> dict[str, np.ndarray]:
        """One row per (adapter, base) pair, base-major: adapter_index, base_index, verdict (index into
        `VERDICTS`), matched, missing, mismatched, prefix_only (modules found only under another prefix)."""
        return dict(self._cols)

    def verdicts(self) -> np.ndarray:
        """(adapters, bases) verdict codes."""
        return cast("np.ndarray", self._grid[:, :, 0].T.astype("int8"))

    @property
    def best_base(self) -> list[str | None]:
        """Per adapter, the base it fits best (`ok` before `partial`, then the most matched modules); None when
        no base fits at all."""
        import numpy as np

        v = self._grid[:, :, 0]
        usable = (v == OK) | (v == PARTIAL)
        score = np.where(usable, (v == OK) * (1 << 40) + self._grid[:, :, 1], -1)
        best = score.argmax(axis=0) if len(self.bases) else np.zeros(len(self.adapters), dtype=np.int64)
        good = score.max(axis=0) >= 0 if len(self.bases) else np.zeros(len(self.adapters), dtype=bool)
        return [self.bases[b].path if g else None for b, g in zip(best.tolist(), good.tolist(), strict=True)]

    def result(self, adapter: int, base: int = 0) -> PairResult:
        s = self._fleet.struct_of[adapter]
        path, bpath = self.adapters[adapter], self.bases[base].path
        if s < 0:
            code, message = self._fleet.errors[adapter]
            return PairResult(path, bpath, "error", 0, 0, 0, (), None, None, f"[{code}] {message}")
        o = self._table[base][s]
        engine = self._engines.get((base, s))
        rep = self._fleet.structs[s]
        if engine is not None and rep.path != path:  # computed once per structure: name this adapter instead
            ours = os.path.basename(path.rstrip("/")).removesuffix(".safetensors")
            word = re.compile(rf"(?<![\w./-]){re.escape(rep.name)}(?![\w./-])")
            errors = tuple(word.sub(ours, e.replace(rep.path, path)) for e in engine.errors)
            engine = replace(engine, errors=errors)
        return PairResult(
            path, bpath, VERDICTS[o.verdict], o.matched, o.missing, o.mismatched, o.modules, o.hint, engine
        )

    def __len__(self) -> int:
        return len(self.adapters) * len(self.bases)

    def __iter__(self) -> Iterator[PairResult]:
        for b in range(len(self.bases)):
            for a in range(len(self.adapters)):
                yield self.result(a, b)

    @property
    def failed(self) -> bool:
        """True when some adapter would fail or silently do nothing on some base (`no_match`,
        `shape_mismatch`, `error`), or an engine rejects it."""
        v = self._grid[:, :, 0]
        return bool((v >= NO_MATCH).any()) or any(e.outcome != "accepted" for e in self._engines.values())

    def summary(self) -> dict[str, Any]:
        import numpy as np

        counts = np.bincount(np.asarray(self._cols["verdict"], dtype=np.int64), minlength=len(VERDICTS))
        return {
            "pairs": len(self),
            "adapters": len(self.adapters),
            "bases": [b.path for b in self.bases],
            "verdicts": {VERDICTS[i]: int(c) for i, c in enumerate(counts.tolist())},
        }

    def to_json(self, indent: int | None = None, modules: bool = True) -> str:
        return json.dumps(
            {"summary": self.summary(), "pairs": [r.to_dict(modules) for r in self]}, indent=indent, default=list
        )


# ---------------------------------------------------------------------------------------------------------------
# Engines


def _engine_outcome(
    engine: str, version: str | None, adapter: Adapter, base: BaseModel, verdict: int, max_lora_rank: int | None
) -> EngineOutcome:
    import inspect as _inspect

    from .compat import sglang, vllm

    note = None
    if engine == "sglang":
        fn: Any = sglang.preflight
        kwargs: dict[str, Any] = {"base_config": _text_config(base), "collect": True, "max_lora_rank": max_lora_rank}
    elif engine == "vllm":
        fn = vllm.preflight
        leaves = sorted({n.rsplit(".", 2)[-2] for n in base.weights if n.endswith(".weight") and n.count(".") >= 1})
        kwargs = {
            # the server's --max-lora-rank: vLLM's default (16) unless given, never one fitted to the adapter
            "max_lora_rank": max_lora_rank if max_lora_rank is not None else 16,
            "collect": True,
            "expected_lora_modules": leaves,
        }
    else:
        raise ValueError(f"engine must be 'sglang' or 'vllm', not {engine!r}")
    if "engine_version" in _inspect.signature(fn).parameters:
        kwargs["engine_version"] = version
    plan = fn([adapter], **kwargs)
    errors = tuple(str(p.message) for p in plan.problems if getattr(p, "fatal", True))
    outcome = "rejected" if errors else "accepted"
    rules = plan.engine_version
    if outcome == "accepted" and not rules.verified:
        outcome = "unknown"
        note = f"passes the rules of {engine} {rules.rules}, but {rules.requested} is not verified ({rules.status})"
    elif outcome == "accepted" and verdict == NO_MATCH:
        outcome = "not_applied"
        note = "it loads, but no module reaches a base weight: the server serves the base model unchanged"
    elif outcome == "accepted" and verdict == SHAPE_MISMATCH:
        outcome = "rejected"
        note = "its header checks pass, then copying its factors into the base's layers fails on their shapes"
    return EngineOutcome(engine, rules.requested, outcome, errors, note, rules.status)


def _text_config(base: BaseModel) -> dict[str, Any] | None:
    cfg = base.config
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        return cast(dict[str, Any], cfg["text_config"])
    return cfg


# ---------------------------------------------------------------------------------------------------------------


def check(
    adapters: Any,
    base: BaseModel | str | os.PathLike[str] | Iterable[BaseModel | str | os.PathLike[str]] | None = None,
    *,
    bases: Iterable[BaseModel | str | os.PathLike[str]] | None = None,
    engine: str | None = None,
    engine_version: str | None = None,
    strict_version: bool = False,
    max_lora_rank: int | None = None,
    threads: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    allow_outside_shards: bool = True,
) -> CheckReport:
    """Check adapters (paths, folders of adapters, URLs, `Adapter`s or a `ScanReport`) against one base or a list
    of bases (`BaseModel`s, or paths/URLs read with `read_base`). Reads headers only; each base once.

    `engine="sglang"|"vllm"` adds the engine's own outcome and exact error text per pair (`engine_version` picks
    the engine release whose rules apply; default: the installed one, else the newest supported), for a server
    started with `max_lora_rank` (default: the engine's own, vLLM 16, SGLang the largest rank it loads). An engine
    version lorafast has not verified warns `UnverifiedEngineVersion` and makes an accepted outcome `unknown`;
    `strict_version=True` raises `UnverifiedEngineVersionError` instead. `allow_outside_shards=False` refuses a
    base whose index names shards outside its folder (`read_base`), for bases that are not trusted.
    """
    if engine is not None:
        from .compat import engine_rules

        if engine not in ("sglang", "vllm"):
            raise ValueError(f"engine must be 'sglang' or 'vllm', not {engine!r}")
        engine_rules(engine, engine_version, strict=strict_version)
    given: list[Any] = []
    if base is not None:
        given.extend(base if isinstance(base, (list, tuple)) else [base])
    if bases is not None:
        given.extend(bases)
    if not given:
        raise ValueError("check needs at least one base model (base= or bases=)")
    models = [
        b
        if isinstance(b, BaseModel)
        else read_base(b, storage_options=storage_options, timeout=timeout, allow_outside_shards=allow_outside_shards)
        for b in given
    ]
    fleet = _gather(adapters, threads, storage_options, timeout)
    table: list[list[_Outcome]] = []
    engines: dict[tuple[int, int], EngineOutcome] = {}
    for bi, model in enumerate(models):
        index = _BaseIndex(model)
        outs = [_check_adapter(index, s) for s in fleet.structs]
        table.append(outs)
        if engine is not None:
            for si, s in enumerate(fleet.structs):
                engines[(bi, si)] = _engine_outcome(engine, engine_version, s, model, outs[si].verdict, max_lora_rank)
    return CheckReport(fleet, models, table, engines)


__all__ = ["MODULE_STATUSES", "VERDICTS", "CheckReport", "EngineOutcome", "ModuleCheck", "PairResult", "check"]


# ---------------------------------------------------------------------------------------------------------------
# A base upgrade (`lorafast upgrade-check --from-base --to-base`): check on both, compared

#: what can change for an adapter between two bases
BASE_CHANGE_KINDS = ("verdict", "modules")


@dataclass(frozen=True)
class BaseOutcome:
    """One adapter on one base, as `lorafast.check` sees it: its verdict and the modules that reach a weight."""

    name: str
    path: str
    verdict: str
    matched: tuple[str, ...] = ()
    hint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return record(self)


@dataclass(frozen=True)
class BaseChange:
    name: str
    kinds: tuple[str, ...]
    old: BaseOutcome
    new: BaseOutcome

    def to_dict(self) -> dict[str, Any]:
        return record(self)


@dataclass(frozen=True)
class BaseDiff:
    """`diff_bases`' answer: each adapter on the base as one transformers version saved it, and as the other did."""

    old_base: str
    new_base: str
    changes: tuple[BaseChange, ...]
    adapters: int
    labels: tuple[str | None, str | None] = (None, None)

    def summary(self) -> dict[str, Any]:
        kinds = Counter(k for c in self.changes for k in c.kinds)
        return {
            "engine": "transformers",
            "from": {"base": self.old_base, "version": self.labels[0]},
            "to": {"base": self.new_base, "version": self.labels[1]},
            "adapters": self.adapters,
            "changed": len(self.changes),
            "unchanged": self.adapters - len(self.changes),
            "kinds": {k: kinds[k] for k in BASE_CHANGE_KINDS if kinds[k]},
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "changes": [c.to_dict() for c in self.changes]}


def diff_bases(
    adapters: Any,
    from_base: Any,
    to_base: Any,
    *,
    labels: tuple[str | None, str | None] = (None, None),
    **options: Any,
) -> BaseDiff:
    """A transformers upgrade: every adapter whose fit changes between a base as one transformers version saved it
    (`from_base`) and as another did (`to_base`), by `lorafast.check` on each, which knows transformers' load-time
    renames (a Llava or Mixtral checkpoint of transformers 4 loads under 5's names). A change is another verdict
    or another set of modules that reach a base weight. `options` go to `check` (`storage_options`, ...)."""
    report = check(adapters, [from_base, to_base], **options)
    pairs = list(report)
    n = len(pairs) // 2
    sides = []
    for pair in pairs:
        name = pair.adapter.rstrip("/").rsplit("/", 1)[-1]
        matched = tuple(sorted(m.module for m in pair.modules if m.status == "ok"))
        sides.append(BaseOutcome(name, pair.adapter, pair.verdict, matched, pair.hint))
    old, new = sides[:n], sides[n:]
    changes = []
    for a, b in zip(old, new, strict=True):
        kinds = tuple(k for k, differs in (("verdict", a.verdict != b.verdict), ("modules", a.matched != b.matched))
                      if differs)  # fmt: skip
        if kinds:
            changes.append(BaseChange(a.name, kinds, a, b))
    names = [str(getattr(m, "path", m)) for m in (from_base, to_base)]
    return BaseDiff(names[0], names[1], tuple(changes), n, labels)
