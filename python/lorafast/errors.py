"""The exception tree. `HeaderError`, `AdapterError` and `InternalError` carry a stable `.code` and the `.path`.

OS failures surface as the builtin `FileNotFoundError`, `PermissionError` or `OSError`, with
`.filename` set to the path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from lorafast.codes import AdapterErrorCode, HeaderErrorCode, TorchErrorCode


class LorafastError(Exception):
    """Base class of every error lorafast raises itself."""


class _Coded(LorafastError):
    def __init__(self, message: str, code: str, path: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.path = path

    def __reduce__(self):  # keep code and path through pickling (multiprocessing, Ray)
        return (type(self), (self.args[0], self.code, self.path))


class CodedError(_Coded, ValueError):
    """A refused input with a stable `.code` and the `.path` (the base of `HeaderError`, `AdapterError` and
    `BaseModelError`)."""


class HeaderError(CodedError):
    """A safetensors header breaks a rule. `code` names the rule (see `HEADER_ERROR_CODES`)."""

    code: HeaderErrorCode


class AdapterError(CodedError):
    """A file or folder is not a usable adapter (no weights, a broken config, ...): a code from
    `ADAPTER_ERROR_CODES`, or from `TORCH_ERROR_CODES` for refused torch weights."""

    code: AdapterErrorCode | TorchErrorCode


class InternalError(_Coded, RuntimeError):
    """A bug in lorafast (code `internal`): a panic in the core, caught and raised as an ordinary
    exception. In a scan it is the failed adapter's row instead, and the other rows stand."""

    code: Literal["internal"]


__all__ = ["AdapterError", "HeaderError", "InternalError", "LorafastError"]
