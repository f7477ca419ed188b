"""Serving groups: split a fleet of adapters into the fewest SGLang servers that can each load their share.

One SGLang LoRA server fixes, at start-up, things every adapter it loads must agree on:

* the MoE "outer" layout. `_detect_shared_outer_loras` looks at every `gate_up_proj` lora_A and raises
  "Mixed shared-outer LoRA formats detected across loaded adapters ..." when shared-outer adapters
  (A shaped [1, r, in]) meet per-expert ones (A shaped [E, r, in], E > 1, or numbered `experts.N.` 2-D A);
* the base model (when an adapter names it);
* `--max-lora-rank` and `--lora-target-modules`, when the operator fixes them.

`plan_groups` turns that start-up failure into a deployable answer: adapters that cannot be served at all are
reported with the reason, the rest are partitioned into groups, and each group comes with its server arguments
(`--max-lora-rank`, `--lora-target-modules`, the shared-outer flag, `--lora-paths`). Adapters whose layout or
base is unknown join any group; the number of groups is the proven minimum without `max_per_group`, and is
checked against a lower bound with it.

`convert=True`: converting the shared-outer adapters to stacked 3-D (exact, `lorafast.convert`) lets them join
the per-expert servers of the same base model. The conversions are planned from the groups, written, and the
fleet is grouped again with the converted paths; when that does not give fewer servers, the converted files are
removed and the plain plan is returned.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

from lorafast.compat import AdapterView, CompatProblem, LoraRef
from lorafast.compat.sglang import (
    MSG_MIXED_SHARED_OUTER,
    SUPPORTED_LORA_TARGET_MODULES,
    get_normalized_target_modules,
    predict_loaded_weights,
    shared_outer_verdicts,
)
from lorafast.compat.sglang import preflight as sglang_preflight
from lorafast.errors import LorafastError
from lorafast.formats.moe import NUMBERED_EXPERT, SGLANG_W_RENAMES
from lorafast.scanning import inspect

if TYPE_CHECKING:
    from lorafast.adapter import Adapter


SHARED_OUTER_FLAG = "--experts-shared-outer-loras"
NO_SHARED_OUTER_FLAG = "--no-experts-shared-outer-loras"

#: SGLang's `--lora-target-modules` argparse choices: its supported target modules, plus "all".
TARGET_MODULE_CHOICES = frozenset({*SUPPORTED_LORA_TARGET_MODULES, "all"})

# Leaves SGLang's loader turns into gate_up_proj (Mixtral w1/w3 are renamed to gate/up first).
_GATE_UP_LEAVES = frozenset({"gate_proj", "up_proj", "gate_up_proj", "w1", "w3"})


class OuterLayout(str, Enum):
    """An adapter's MoE outer layout as SGLang's shared-outer detection sees it."""

    SHARED = "shared_outer"
    """The gate_up lora_A is shaped [1, r, in]."""
    PER_EXPERT = "per_expert"
    """The gate_up lora_A is [E>1, r, in], or numbered 2-D `experts.N.` tensors."""
    NONE = "none"
    """No gate_up expert lora_A: the adapter fits either kind of server."""
    MIXED = "mixed"
    """Disagrees with itself: SGLang rejects it even alone."""


def _normalize_targets(names: Iterable[str]) -> set[str]:
    return set(get_normalized_target_modules(list(names)))


def _layout_of(seen: set[bool]) -> OuterLayout:
    if len(seen) == 2:
        return OuterLayout.MIXED
    if not seen:
        return OuterLayout.NONE
    return OuterLayout.SHARED if True in seen else OuterLayout.PER_EXPERT


def _seen_from_loaded(adapter: Adapter | AdapterView) -> set[bool] | None:
    """SGLang's rule on the weights as SGLang holds them after loading; None when SGLang's load itself fails
    (whatever it raises: the preflight reports that), and the tensors' own shapes decide instead."""
    try:
        loaded = predict_loaded_weights(adapter)
    except Exception:
        return None
    return set(shared_outer_verdicts(loaded))  # SGLang's rule, as compat.sglang's shared-outer detection runs it


def outer_layout(adapter: Adapter, *, view: AdapterView | None = None) -> OuterLayout:
    """SGLang's `_detect_shared_outer_loras` rule on one adapter, keeping "no opinion" apart from per-expert.

    Only gate_up lora_A counts: 3-D with expert dim 1 is shared-outer, 3-D with E > 1 or a numbered 2-D
    `experts.N.` tensor is per-expert, anything else (dense layers, down_proj, PEFT target_parameters) is silent.
    """
    seen = _seen_from_loaded(adapter if view is None else view)
    if seen is None:
        seen = set()
        for m in adapter.modules:
            if m.leaf not in _GATE_UP_LEAVES or m.a_shape is None:
                continue
            if len(m.a_shape) == 3:
                seen.add(m.a_shape[0] == 1)
            elif len(m.a_shape) == 2 and NUMBERED_EXPERT.search(m.key + "."):
                seen.add(False)
    return _layout_of(seen)


def adapter_targets(adapter: Adapter) -> set[str]:
    """SGLang-normalized target modules: the config's list (what `can_support` checks) ∪ what the tensors hold."""
    targets = _normalize_targets(SGLANG_W_RENAMES.get(t, t) for t in adapter.target_modules)  # `.w1/.w3/.w2` renamed
    config_tm = (adapter.config or {}).get("target_modules")
    if isinstance(config_tm, list):
        targets |= _normalize_targets(str(t) for t in config_tm)
    return targets


def adapter_rank(adapter: Adapter) -> int:
    """The `--max-lora-rank` an adapter needs: its config `r` (SGLang's max) and every tensor rank must fit."""
    return max(int(adapter.r or 0), int(adapter.rank or 0))


@dataclass(frozen=True)
class Unservable:
    """An adapter no group can serve, and why (SGLang's message where it has one)."""

    path: str
    name: str
    code: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "name": self.name, "code": self.code, "reason": self.reason}


@dataclass(frozen=True)
class ServingGroup:
    """Adapters one SGLang server can load together, and the arguments to start it with."""

    index: int
    adapters: tuple[Adapter, ...]
    names: tuple[str, ...]
    """Unique `--lora-paths` names, in adapter order."""
    layout: OuterLayout
    """SHARED, PER_EXPERT, or NONE when no adapter has an opinion."""
    base_model: str | None
    max_lora_rank: int
    target_modules: tuple[str, ...]
    """Normalized union, sorted; ("all",) when a name is not a CLI choice."""
    preflight: str = "unavailable"
    """"passed", "passed (start-up only)" (no base config: the first-use checks were not run) or "failed";
    "unavailable" only on a group built by hand."""
    preflight_problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    served_target_modules: tuple[str, ...] = ()
    """The explicit union (also when the CLI gets "all")."""

    @property
    def experts_shared_outer(self) -> bool | None:
        """The value to force: True / False for MoE groups, None (let SGLang detect) for dense ones."""
        return {OuterLayout.SHARED: True, OuterLayout.PER_EXPERT: False}.get(self.layout)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(str(a.path) for a in self.adapters)

    def lora_paths(self) -> list[str]:
        return [f"{n}={p}" for n, p in zip(self.names, self.paths, strict=True)]

    def server_args(self) -> list[str]:
        """`sglang.launch_server` arguments (without `--model-path` when the base model is unknown)."""
        args = ["--model-path", self.base_model] if self.base_model else []
        args += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)]
        args += ["--lora-target-modules", *self.target_modules]
        if self.experts_shared_outer is True:
            args.append(SHARED_OUTER_FLAG)
        elif self.experts_shared_outer is False:
            args.append(NO_SHARED_OUTER_FLAG)
        args += ["--lora-paths", *self.lora_paths()]
        return args

    def command(self) -> str:
        return shlex.join(["python", "-m", "sglang.launch_server", *self.server_args()])

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "adapters": [{"name": n, "path": p} for n, p in zip(self.names, self.paths, strict=True)],
            "layout": self.layout.value,
            "base_model": self.base_model,
            "max_lora_rank": self.max_lora_rank,
            "target_modules": list(self.target_modules),
            "served_target_modules": list(self.served_target_modules),
            "experts_shared_outer": self.experts_shared_outer,
            "server_args": self.server_args(),
            "preflight": self.preflight,
            "preflight_problems": list(self.preflight_problems),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class GroupPlan:
    """Result of `plan_groups`: the groups, the adapters left out, and the minimality evidence."""

    groups: tuple[ServingGroup, ...]
    unservable: tuple[Unservable, ...]
    lower_bound: int
    """No valid split has fewer groups."""
    max_per_group: int | None = None
    max_lora_rank: int | None = None
    target_modules: tuple[str, ...] | None = None
    conversions: tuple[Any, ...] = ()
    """`ConversionStep`s the groups rely on (convert=True)."""

    def __iter__(self) -> Iterator[ServingGroup]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def minimal(self) -> bool:
        """True when the group count meets the lower bound (always, without `max_per_group`)."""
        return len(self.groups) == self.lower_bound

    @property
    def ok(self) -> bool:
        return not self.unservable and all(g.preflight != "failed" for g in self.groups)

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": [g.to_dict() for g in self.groups],
            "unservable": [u.to_dict() for u in self.unservable],
            "lower_bound": self.lower_bound,
            "minimal": self.minimal,
            "max_per_group": self.max_per_group,
            "max_lora_rank": self.max_lora_rank,
            "target_modules": None if self.target_modules is None else list(self.target_modules),
            "conversions": [c.to_dict() for c in self.conversions],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def explain(self) -> str:
        n_adapters = sum(len(g.adapters) for g in self.groups)
        proof = "minimal" if self.minimal else f"lower bound {self.lower_bound}"
        lines = [
            f"lorafast groups: {n_adapters} adapter{'s' if n_adapters != 1 else ''} in {len(self.groups)} "
            f"group{'s' if len(self.groups) != 1 else ''} ({proof})"
            + (f", {len(self.unservable)} unservable" if self.unservable else "")
        ]
        for c in self.conversions:
            lines.append(f"converted: {c.name} ({c.from_layout} -> {c.to_layout}, {c.cost_bytes:,} bytes) -> {c.out}")
        for g in self.groups:
            layout = {
                OuterLayout.SHARED: "shared-outer MoE",
                OuterLayout.PER_EXPERT: "per-expert MoE",
                OuterLayout.NONE: "no MoE outer factor",
            }[g.layout]
            lines.append(
                f"group {g.index}: {len(g.adapters)} adapter{'s' if len(g.adapters) != 1 else ''}, {layout}, "
                f"base {g.base_model or 'unknown'}, rank <= {g.max_lora_rank}, preflight {g.preflight}"
            )
            lines.append(f"  {g.command()}")
            lines.extend(f"  note: {n}" for n in g.notes)
            lines.extend(f"  preflight: {p}" for p in g.preflight_problems)
        for u in self.unservable:
            lines.append(f"unservable: {u.name} ({u.path}) [{u.code}]: {u.reason}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Preflight (lorafast.compat.sglang)


def _short(message: str, limit: int = 240) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _run_preflight(refs: list[LoraRef], **kwargs: Any) -> tuple[str, list[str], list[str]]:
    """("passed" | "failed", fatal problem messages, warnings SGLang would only log)."""
    engine_log = logging.getLogger("lorafast.compat")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)  # SGLang's warnings come back in the result; don't print them too
    try:
        problems: tuple[CompatProblem, ...] = sglang_preflight(refs, collect=True, **kwargs).problems
    except Exception as e:
        return "failed", [f"{type(e).__name__}: {e}"], []
    finally:
        engine_log.setLevel(level)
    fatal = [p.message for p in problems if p.fatal]
    warnings = [p.message for p in problems if not p.fatal]
    if fatal:
        return "failed", fatal, warnings
    return ("passed" if kwargs.get("base_config") else "passed (start-up only)"), fatal, warnings


# ---------------------------------------------------------------------------------------------------------------
# Partitioning


@dataclass
class _Item:
    index: int
    layout: OuterLayout | None
    """None: fits any layout."""
    base: str | None
    """None: fits any base."""


@dataclass
class _Bin:
    layout: OuterLayout | None = None
    base: str | None = None
    members: list[int] = field(default_factory=list)


def _fits(item: _Item, b: _Bin, cap: int | None) -> bool:
    if cap is not None and len(b.members) >= cap:
        return False
    if item.layout is not None and b.layout not in (None, item.layout):
        return False
    return not (item.base is not None and b.base not in (None, item.base))


def _greedy(items: list[_Item], cap: int | None, half_first: str) -> list[_Bin]:
    """Place fully keyed items, then half-keyed ones (`half_first`: "base" or "layout" first), then free ones.

    An item joins the compatible bin that already carries most of its keys (so it does not narrow a bin other
    items could use), otherwise a new bin.
    """

    def order(it: _Item) -> tuple[int, str, str]:
        if it.layout is not None and it.base is not None:
            rank = 0
        elif it.layout is None and it.base is None:
            rank = 3
        else:
            rank = 1 if (it.base is not None) == (half_first == "base") else 2
        return rank, str(it.layout.value if it.layout else ""), it.base or ""

    bins: list[_Bin] = []
    for it in sorted(items, key=order):
        best: _Bin | None = None
        best_score = -1
        for b in bins:
            if not _fits(it, b, cap):
                continue
            score = int(it.layout is not None and b.layout == it.layout) + int(
                it.base is not None and b.base == it.base
            )
            if score > best_score:
                best, best_score = b, score
        if best is None:
            best = _Bin()
            bins.append(best)
        best.layout = best.layout or it.layout
        best.base = best.base or it.base
        best.members.append(it.index)
    return bins


def _partition(items: list[_Item], cap: int | None) -> list[_Bin]:
    """The smaller of the two greedy orders.

    Minimal (it meets `_lower_bound`) without a capacity, and with one whenever the adapters do not mix
    "layout known, base unknown" with "base known, layout unknown": base-first placement is optimal when the
    first kind is absent, layout-first when the second is. Otherwise `GroupPlan.minimal` says whether the bound
    is met.
    """
    by_base = _greedy(items, cap, "base")
    by_layout = _greedy(items, cap, "layout")
    return by_layout if len(by_layout) < len(by_base) else by_base


def _lower_bound(items: list[_Item], cap: int | None) -> int:
    """No valid split has fewer groups than this.

    Without a capacity it is exact: every distinct (layout, base) pair of fully keyed adapters needs its own
    group; a layout (or base) seen only on half-keyed adapters needs a group of its own kind, and one new group
    can take one such layout and one such base; free adapters need a group only when there is none.
    With a capacity of c, the counts per layout, per base and overall give further bounds.
    """
    if not items:
        return 0
    full = {(it.layout, it.base) for it in items if it.layout is not None and it.base is not None}
    full_layouts = {lay for lay, _ in full}
    full_bases = {b for _, b in full}
    rem_layouts = {it.layout for it in items if it.layout is not None and it.base is None} - full_layouts
    rem_bases = {it.base for it in items if it.base is not None and it.layout is None} - full_bases
    exact = len(full) + max(len(rem_layouts), len(rem_bases))
    bound = max(exact, 1)
    if cap is None:
        return bound
    n_full: dict[tuple[Any, Any], int] = {}
    for it in items:
        if it.layout is not None and it.base is not None:
            n_full[(it.layout, it.base)] = n_full.get((it.layout, it.base), 0) + 1
    per_layout = 0
    for lay in {it.layout for it in items if it.layout is not None}:
        forced = sum(math.ceil(n / cap) for (la, _), n in n_full.items() if la == lay)
        total = sum(1 for it in items if it.layout == lay)
        per_layout += max(forced, math.ceil(total / cap))
    per_base = 0
    for base in {it.base for it in items if it.base is not None}:
        forced = sum(math.ceil(n / cap) for (_, b), n in n_full.items() if b == base)
        total = sum(1 for it in items if it.base == base)
        per_base += max(forced, math.ceil(total / cap))
    return max(bound, per_layout, per_base, math.ceil(len(items) / cap))


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def _collect_adapters(adapters_or_report: Any) -> tuple[list[tuple[str | None, Adapter]], list[Unservable]]:
    """(name or None, Adapter) pairs plus entries that could not be read (a ScanReport's errors, bad paths)."""
    failed: list[Unservable] = []
    for path, code, message in getattr(adapters_or_report, "errors", None) or []:
        failed.append(Unservable(str(path), os.path.basename(str(path).rstrip("/")), str(code), str(message)))
    if isinstance(adapters_or_report, Mapping):
        entries: Iterable[tuple[str | None, Any]] = ((str(k), v) for k, v in adapters_or_report.items())
    elif isinstance(adapters_or_report, (str, os.PathLike)):
        entries = [(None, adapters_or_report)]
    else:
        entries = ((None, a) for a in adapters_or_report)
    out: list[tuple[str | None, Adapter]] = []
    for name, obj in entries:
        if isinstance(obj, (str, os.PathLike)):
            path = os.fspath(obj)
            try:
                obj = inspect(path)
            except Exception as e:
                failed.append(Unservable(path, name or os.path.basename(path.rstrip("/")), "unreadable", str(e)))
                continue
        out.append((name, obj))
    return out, failed


def _unique_names(names: Sequence[str]) -> tuple[str, ...]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if n in seen:
            seen[n] += 1
            candidate = f"{n}-{seen[n]}"
            while candidate in seen:
                seen[n] += 1
                candidate = f"{n}-{seen[n]}"
            seen[candidate] = 1
            out.append(candidate)
        else:
            seen[n] = 1
            out.append(n)
    return tuple(out)


def _lora_ref(name: str, adapter: Adapter, view: AdapterView | None = None) -> LoraRef:
    return LoraRef(name=name, path=str(adapter.path), adapter=view if view is not None else adapter)


def plan_groups(
    adapters_or_report: Any,
    *,
    max_lora_rank: int | None = None,
    target_modules: Sequence[str] | str | None = None,
    max_per_group: int | None = None,
    convert: bool = False,
    convert_out: str | os.PathLike[str] | None = None,
    base_config: Mapping[str, Any] | None = None,
) -> GroupPlan:
    """Split adapters into the fewest groups that one SGLang server each can load.

    `base_config` (the base model's `config.json` as a dict) lets each group's preflight run SGLang's first-use
    checks too (buffer shapes, ranks against the pool); without it a group that passes the start-up checks is
    `preflight="passed (start-up only)"`, never a plain "passed".

    `convert=True`: where converting shared-outer adapters to stacked 3-D (exact) lets them share a per-expert
    server, write them into `convert_out` (required: the folder the converted adapters are served from, never a
    temporary one that would vanish under the server) and group the converted fleet; the plan's `conversions`
    lists the steps. Nothing is converted when it would not save a server.

    `adapters_or_report`: Adapters, paths, a `ScanReport`, or a mapping name -> Adapter/path. `max_lora_rank`
    and `target_modules` are the server limits if fixed (adapters beyond them are reported as unservable);
    otherwise each group gets the smallest values that fit it. `max_per_group` caps adapters per server.
    Every group is checked with `lorafast.compat.sglang.preflight`.
    """
    if max_per_group is not None and max_per_group < 1:
        raise ValueError("max_per_group must be at least 1")
    if convert:
        if convert_out is None:
            raise ValueError("convert=True needs convert_out: the folder the converted adapters are served from")
        limits = {"max_lora_rank": max_lora_rank, "target_modules": target_modules, "max_per_group": max_per_group,
                  "base_config": base_config}  # fmt: skip
        return _with_conversions(adapters_or_report, convert_out, **limits)
    fixed_targets: set[str] | None = None
    given: list[str] | None = None
    if target_modules is not None:
        given = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        fixed_targets = {"all"} if "all" in given else _normalize_targets(given)

    entries, unservable = _collect_adapters(adapters_or_report)
    servable: list[tuple[str, Adapter]] = []
    views: list[AdapterView] = []
    items: list[_Item] = []
    for given_name, adapter in entries:
        name = given_name or adapter.name
        try:  # built once (its tensor table is the costly part) and reused by every check
            view = AdapterView.from_adapter(adapter, name=name)
        except (OSError, LorafastError) as e:  # a header read again to shape extra tensors failed
            unservable.append(Unservable(str(adapter.path), name, "unreadable", f"{type(e).__name__}: {e}"))
            continue
        layout = outer_layout(adapter, view=view)
        problem = _single_adapter_problem(name, adapter, layout, max_lora_rank, fixed_targets, view, base_config)
        if problem is not None:
            unservable.append(problem)
            continue
        base = (adapter.base_model_name_or_path or "").strip() or None
        items.append(_Item(len(servable), None if layout is OuterLayout.NONE else layout, base))
        servable.append((name, adapter))
        views.append(view)
    bins = _partition(items, max_per_group)
    bins.sort(key=lambda b: min(b.members))

    groups = []
    for index, b in enumerate(bins):
        members = sorted(b.members)
        adapters = tuple(servable[i][1] for i in members)
        names = _unique_names([servable[i][0] for i in members])
        group_views = tuple(views[i] for i in members)
        groups.append(
            _make_group(index, adapters, names, b, max_lora_rank, fixed_targets, given, group_views, base_config)
        )
    return GroupPlan(
        groups=tuple(groups),
        unservable=tuple(unservable),
        lower_bound=_lower_bound(items, max_per_group),
        max_per_group=max_per_group,
        max_lora_rank=max_lora_rank,
        target_modules=None if fixed_targets is None else tuple(sorted(fixed_targets)),
    )


def _single_adapter_problem(
    name: str,
    adapter: Adapter,
    layout: OuterLayout,
    max_lora_rank: int | None,
    fixed_targets: set[str] | None,
    view: AdapterView | None = None,
    base_config: Mapping[str, Any] | None = None,
) -> Unservable | None:
    """Why no server could load `adapter`, whatever it is grouped with (None when it can be served)."""
    path = str(adapter.path)
    if layout is OuterLayout.MIXED:
        ref = _lora_ref(name, adapter, view)
        return Unservable(
            path, name, "mixed_shared_outer", MSG_MIXED_SHARED_OUTER.format(adapter_id=getattr(ref, "lora_id", name))
        )
    targets = adapter_targets(adapter)
    if fixed_targets is not None and "all" not in fixed_targets and not targets <= fixed_targets:
        return Unservable(
            path,
            name,
            "target_modules",
            f"LoRA adapter '{name}' contains target modules {sorted(targets - fixed_targets)} that are not included "
            f"in the specified --lora-target-modules {sorted(fixed_targets)}. Please update --lora-target-modules to "
            f"include all required modules: {sorted(fixed_targets | targets)}, or use 'all' to enable all supported "
            "modules.",
        )
    rank = adapter_rank(adapter)
    if max_lora_rank is not None and rank > max_lora_rank:  # the pool's buffers are sized by --max-lora-rank
        return Unservable(path, name, "rank", f"rank {rank} exceeds --max-lora-rank {max_lora_rank}")
    kwargs: dict[str, Any] = {"max_lora_rank": max_lora_rank if max_lora_rank is not None else max(rank, 1)}
    explicit = fixed_targets is not None and "all" not in fixed_targets
    kwargs["target_modules"] = sorted(fixed_targets) if explicit else sorted(targets)  # type: ignore[arg-type]
    status, problems, _ = _run_preflight([_lora_ref(name, adapter, view)], base_config=base_config, **kwargs)
    if status == "failed":
        return Unservable(path, name, "preflight", "; ".join(problems))
    return None


def _make_group(
    index: int,
    adapters: tuple[Adapter, ...],
    names: tuple[str, ...],
    b: _Bin,
    max_lora_rank: int | None,
    fixed_targets: set[str] | None,
    given_targets: list[str] | None = None,
    views: tuple[AdapterView | None, ...] | None = None,
    base_config: Mapping[str, Any] | None = None,
) -> ServingGroup:
    notes: list[str] = []
    rank = max_lora_rank if max_lora_rank is not None else max([adapter_rank(a) for a in adapters] + [1])
    served = sorted(set().union(*(adapter_targets(a) for a in adapters)))
    if fixed_targets is not None:
        cli_targets = list(given_targets) if given_targets else sorted(fixed_targets)
        if "all" not in fixed_targets:  # with "all", SGLang serves what the model has: check the adapters' union
            served = sorted(fixed_targets)
    else:
        cli_targets = served
        odd = [t for t in served if t not in TARGET_MODULE_CHOICES]
        if odd:
            cli_targets = ["all"]
            notes.append(
                f"{odd} {'is' if len(odd) == 1 else 'are'} not a --lora-target-modules choice: 'all' lets SGLang "
                "detect the model's modules (check that they cover these)"
            )
    layout = b.layout or OuterLayout.NONE
    if layout is OuterLayout.SHARED:
        notes.append("shared-outer forced on, so later dynamic loads are checked against it")
    elif layout is OuterLayout.PER_EXPERT:
        notes.append("shared-outer forced off: a [1, r, in] adapter loaded later would silently fill expert 0 only")
    if b.base is None:
        notes.append("no adapter names its base model: add --model-path yourself")
    kwargs: dict[str, Any] = {"max_lora_rank": rank, "target_modules": served}
    if layout is not OuterLayout.NONE:
        kwargs["experts_shared_outer"] = layout is OuterLayout.SHARED
    views = views or (None,) * len(adapters)
    refs = [_lora_ref(n, a, v) for n, a, v in zip(names, adapters, views, strict=True)]
    status, problems, engine_warnings = _run_preflight(refs, base_config=base_config, **kwargs)
    notes.extend(f"SGLang would warn: {_short(w)}" for w in engine_warnings)
    return ServingGroup(
        index=index,
        adapters=adapters,
        names=names,
        layout=layout,
        base_model=b.base,
        max_lora_rank=rank,
        target_modules=tuple(cli_targets),
        preflight=status,
        preflight_problems=tuple(problems),
        notes=tuple(notes),
        served_target_modules=tuple(served),
    )


@dataclass(frozen=True)
class ConversionStep:
    """One conversion a group plan relies on: the adapter, its layout before and after, bytes to write."""

    adapter: str  # source path
    name: str
    from_layout: str
    to_layout: str
    cost_bytes: int  # tensor data written
    out: str  # the converted adapter, which the group commands use

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _with_conversions(adapters_or_report: Any, out: str | os.PathLike[str], **kwargs: Any) -> GroupPlan:
    """`plan_groups(convert=True)`: convert shared-outer adapters to stacked 3-D where that lets them share a
    per-expert server, and only there."""
    from lorafast.converting import convert

    plain = plan_groups(adapters_or_report, **kwargs)
    per_expert_bases = {g.base_model for g in plain.groups if g.layout is OuterLayout.PER_EXPERT}
    movable = [
        (g, a, n)
        for g in plain.groups
        if g.layout is OuterLayout.SHARED and g.base_model in per_expert_bases
        for a, n in zip(g.adapters, g.names, strict=True)
    ]
    if not movable:
        return plain
    folder = os.fspath(out)
    created = not os.path.exists(folder)
    os.makedirs(folder, exist_ok=True)
    steps: list[ConversionStep] = []
    converted: dict[str, str] = {}
    for _g, adapter, name in movable:
        dest = os.path.join(folder, f"{name}-stacked_3d")
        res = convert(adapter, "stacked_3d", dest, overwrite=True)
        steps.append(ConversionStep(str(adapter.path), name, res.from_layout, res.to_layout, res.bytes, res.out))
        converted[str(adapter.path)] = res.out
    entries, _ = _collect_adapters(adapters_or_report)
    fleet = {}
    for given, adapter in entries:
        name = given or adapter.name
        fleet[name if name not in fleet else str(adapter.path)] = converted.get(str(adapter.path), adapter)
    better = plan_groups(fleet, **kwargs)
    if len(better.groups) >= len(plain.groups):  # no server saved: leave nothing converted behind
        for step in steps:
            shutil.rmtree(step.out, ignore_errors=True)
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        return plain
    return replace(
        better, conversions=tuple(steps), unservable=plain.unservable if not better.unservable else better.unservable
    )
