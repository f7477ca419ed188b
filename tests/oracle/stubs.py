"""Every stub the oracle runners install, in one place, each with why.

The engines' LoRA logic runs unmodified. What is replaced here is only what needs a GPU, a process group,
compiled kernels, or parts of the engine that the LoRA code imports but the tested paths never call.
Each engine has one section; a runner calls exactly one `install_*` function before importing the engine.
"""

from __future__ import annotations

# --- vLLM ------------------------------------------------------------------------------------------------

# --- SGLang (LLM: config, adapter, manager, memory pool, loader) -----------------------------------------

# --- SGLang diffusion (the lora/ package of the multimodal generator) ------------------------------------
