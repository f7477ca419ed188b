"""`lorafast.preflight`: will the server this launch command starts serve these adapters as they were trained?

`_preflight` reads the command, the adapters and the base; `_engines` judges each adapter by the engine's own
rules; `_verdicts` holds what comes back.
"""

from lorafast.serving._preflight import preflight, resolve_base
from lorafast.serving._verdicts import VERDICTS, AdapterVerdict, ModuleScale, PreflightReport, trained_scale

__all__ = ["VERDICTS", "AdapterVerdict", "ModuleScale", "PreflightReport", "preflight", "resolve_base", "trained_scale"]
