"""The names of MoE expert weights, as the engines and checkpoints spell them."""

from __future__ import annotations

import re

#: SGLang renames `.w1.`/`.w3.`/`.w2.` tensors to gate/up/down before anything else (sglang-lora.md §4.2).
SGLANG_W_RENAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

#: a numbered expert's weight in a base checkpoint: (experts module, expert id, projection)
NUMBERED_EXPERT_WEIGHT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")

#: a stacked experts module path and its projection (`...mlp.experts.gate_up_proj` has none: fused)
STACKED_EXPERT_MODULE = re.compile(r"^(.*\.experts)\.(w1|w3|w2|gate_proj|up_proj|down_proj)$")

#: a numbered (routed or shared) expert in an adapter tensor's name: SGLang's per-expert layout, as its
#: shared-outer detection and `lorafast groups` tell the layouts apart
NUMBERED_EXPERT = re.compile(r"(?:shared_)?experts\.\d+\.")
