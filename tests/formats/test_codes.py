"""One test per code list: the list the core exports, the `Literal` alias in `lorafast.codes` and the list the
documentation gives are the same set.

In Rust each list is an enum (rust/codes.rs: `code()`, `ALL` in documentation order, `from_code`), and every call
site names a variant, so the compiler keeps each code the core writes listed; the exported tuples are built from
`ALL`.

The documented list is found by its anchor, the backquoted constant name (`lorafast.PROBLEM_CODES`,
`lorafast.codes.FLAGS`, ...), in the docs/ page that holds the list (`DOCS`): it is every backquoted name after
the anchor up to the end of that sentence, bullet or paragraph. The README lists no codes; it links those pages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import lorafast
import pytest
from lorafast import _core, codes

ROOT = Path(__file__).resolve().parents[2]

#: constant name -> (the list the core exports, or None for a Python-owned list; the Literal alias)
LISTS: dict[str, tuple[Any, Any]] = {
    "HEADER_ERROR_CODES": (_core.HEADER_ERROR_CODES, codes.HeaderErrorCode),
    "ADAPTER_ERROR_CODES": (_core.ADAPTER_ERROR_CODES, codes.AdapterErrorCode),
    "TORCH_ERROR_CODES": (_core.TORCH_ERROR_CODES, codes.TorchErrorCode),
    "PROBLEM_CODES": (_core.PROBLEM_CODES, codes.ProblemCode),
    "FLAGS": (_core.FLAGS, codes.Flag),
    "MODULE_KINDS": (_core.MODULE_KINDS, codes.ModuleKind),
    "MERGE_FORMS": (None, codes.MergeForm),
}

#: constant name -> the docs/ page that lists its codes
DOCS: dict[str, str] = {
    "HEADER_ERROR_CODES": "errors.md",
    "ADAPTER_ERROR_CODES": "errors.md",
    "TORCH_ERROR_CODES": "errors.md",
    "PROBLEM_CODES": "errors.md",
    "FLAGS": "scan.md",
    "MODULE_KINDS": "scan.md",
    "MERGE_FORMS": "merge.md",
}


def _anchor(name: str) -> str:
    return rf"`lorafast\.(?:codes\.)?{name}`"


def documented(name: str) -> set[str]:
    """The backquoted names after the anchor `lorafast.NAME` or `lorafast.codes.NAME` in its docs/ page, to the
    end of its sentence, bullet or paragraph (exception classes left out)."""
    text = (ROOT / "docs" / DOCS[name]).read_text(encoding="utf-8")
    found = re.search(_anchor(name), text)
    assert found, f"docs/{DOCS[name]} does not name `lorafast.{name}` or `lorafast.codes.{name}`"
    rest = text[found.end() :]
    end = re.search(r"\.\s|\n- |\n\n", rest)
    names = re.findall(r"`([A-Za-z][A-Za-z0-9_]*)`", rest[: end.start() if end else len(rest)])
    return {n for n in names if not n.endswith("Error")}  # "raised as `AdapterError`"


@pytest.mark.parametrize("name", sorted(LISTS))
def test_code_list_is_one_set(name: str) -> None:
    core, alias = LISTS[name]
    exported = getattr(codes, name)
    assert isinstance(exported, tuple)
    assert len(set(exported)) == len(exported), f"{name} repeats a code"
    assert set(exported) == set(get_args(alias)), f"{name} and its Literal differ"
    if core is not None:
        assert tuple(core) == exported, f"{name} is not the core's list, in order"
    assert documented(name) == set(exported), f"the documented {name} differs"


def test_readme_links_the_pages_that_list_the_codes() -> None:
    """The README lists no codes itself: it links every page that does."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in sorted(set(DOCS.values())):
        assert f"(docs/{page}" in readme, f"README.md does not link docs/{page}"


@pytest.mark.parametrize("name", sorted(LISTS))
def test_code_list_has_one_home(name: str) -> None:
    """Only the list's own page anchors it: no second copy in the README or another page can drift."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    homes = [f.relative_to(ROOT).as_posix() for f in files if re.search(_anchor(name), f.read_text(encoding="utf-8"))]
    assert homes == [f"docs/{DOCS[name]}"], homes


def test_top_level_tuples_are_the_codes_tuples() -> None:
    for name in ("HEADER_ERROR_CODES", "ADAPTER_ERROR_CODES", "TORCH_ERROR_CODES", "PROBLEM_CODES"):
        assert getattr(lorafast, name) is getattr(codes, name)


def test_codes_seen_in_results_are_listed(tmp_path: Path) -> None:
    """Every module kind and problem code the sample fleet produces is in its list."""
    from lorafast.sample import write_samples

    write_samples(str(tmp_path), 60)
    report = lorafast.scan([str(tmp_path)])
    kinds, problems, flags = set(), set(), set()
    for adapter in report:
        kinds |= {m.kind for m in adapter.modules}
        problems |= {p.code for p in adapter.problems}
        flags |= set(adapter.flags)
    assert kinds and kinds <= set(codes.MODULE_KINDS), kinds - set(codes.MODULE_KINDS)
    assert problems <= set(codes.PROBLEM_CODES), problems - set(codes.PROBLEM_CODES)
    assert flags and flags <= set(codes.FLAGS), flags - set(codes.FLAGS)


def test_a_torch_warning_problem_survives_the_index(tmp_path: Path) -> None:
    """`non_tensor_value` (a torch file's header warning) is a problem code an index row stores and reads back."""
    import json

    torch = pytest.importorskip("torch")
    folder = tmp_path / "fleet" / "bin"
    folder.mkdir(parents=True)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    state = {f"{key}.lora_A.weight": torch.zeros(4, 16), f"{key}.lora_B.weight": torch.zeros(16, 4), "step": 3}
    torch.save(state, folder / "adapter_model.bin")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}))
    assert [p.code for p in lorafast.inspect(folder).problems] == ["non_tensor_value"]
    index = lorafast.Index(tmp_path / "fleet.db")
    index.scan([tmp_path / "fleet"])
    again = lorafast.Index(tmp_path / "fleet.db").scan([tmp_path / "fleet"])
    assert again.reads == 0
    assert [[p.code for p in a.problems] for a in again] == [["non_tensor_value"]]


def test_codes_from_python_are_read_back_by_the_core() -> None:
    """A failed `discover_targets` item keeps its code through `scan_targets`, whichever list the code is from; any
    other text becomes an `internal` row that names it."""
    items = [
        ("/a", None, None, "no_adapter", "nothing here"),
        ("/b", None, None, "invalid_zip", "not a zip"),
        ("/c", None, None, "duplicate_key", "key twice"),
        ("/d", None, None, "no_such_code", "made up"),
    ]
    errors = _core.scan_targets(items).errors()
    assert [(path, code) for _, path, code, _ in errors] == [
        ("/a", "no_adapter"),
        ("/b", "invalid_zip"),
        ("/c", "duplicate_key"),
        ("/d", "internal"),
    ]
    assert "no_such_code" in errors[3][3] and "made up" in errors[3][3]
