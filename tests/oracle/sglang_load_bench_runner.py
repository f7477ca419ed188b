"""Benchmark runner: SGLang's own start-up load path (unpacked release wheel) on a set of adapters, timed.

Run by `benches/bench_preflight.py` through `engines.run("sglang_load_bench_runner", "sglang", version, ...)`.
It reuses `sglang_runner`'s setup (its stubs and `_startup`): `LoRAManager.init_state` loads every adapter with
`LoRAAdapter.initialize_weights` (every tensor read to CPU, then normalized), infers the target modules and max
rank, runs the shared-outer detection and builds the memory pool on CPU. Only `init_state` is timed, not the
interpreter start or the engine import.

Payload: {"base": {hf config dict}, "paths": [...], "repeat": 1}
Result: {"seconds": [...], "startup": <sglang_runner._startup's answer, without the ids>}
"""

from __future__ import annotations

import json
import sys
import time

import sglang_runner  # installs the stubs, imports the engine (tests/oracle/sglang_runner.py)
from transformers import AutoConfig


def main() -> None:
    payload = json.load(sys.stdin)
    sglang_runner.torch.set_num_threads(1)
    case = {
        "base": payload["base"],
        "adapters": [{"name": f"a{i}", "path": p} for i, p in enumerate(payload["paths"])],
        "max_loras_per_batch": payload.get("max_loras_per_batch", 8),
    }
    seconds = []
    startup: dict = {}
    for _ in range(payload.get("repeat", 1)):
        model = sglang_runner.stubs.sglang_tiny_model(AutoConfig.for_model(**case["base"]))
        t0 = time.perf_counter()
        _mgr, startup = sglang_runner._startup(case, model)
        seconds.append(time.perf_counter() - t0)
        del _mgr
    startup.pop("ids", None)
    json.dump({"seconds": seconds, "startup": startup}, sys.stdout)


if __name__ == "__main__":
    main()
