"""One bad entry of each kind in a fleet is one row with its error code, and the scan goes on."""

from __future__ import annotations

import lorafast
from helpers.fleets import FAILED_CODES, write_failed
from lorafast.testing import write_peft_adapter


def test_each_failed_entry_is_a_row_with_its_code(tmp_path):
    written = write_failed(tmp_path / "fleet", *FAILED_CODES)
    write_peft_adapter(tmp_path / "fleet" / "good", {"m.q_proj.lora_A.weight": ("F32", (4, 8)),
                                                                      "m.q_proj.lora_B.weight": ("F32", (8, 4))})  # fmt: skip
    report = lorafast.scan([tmp_path / "fleet"])
    codes = {path: code for path, code, _ in report.errors}
    for kind, path in written.items():
        row = path / "adapter_config.json" if kind in ("bad_config", "list_config") else path
        assert codes.get(str(row)) == FAILED_CODES[kind], (kind, codes)
    assert len(report) == len(written) + 1 and len(report.ok_paths) == 1
