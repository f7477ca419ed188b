"""The on-disk vocabulary, one home each: safetensors (dtypes, the header writer), PEFT's config rules, MoE names.

Layer 1 of the package: it imports nothing of lorafast but `errors` and the compiled core.
"""
