"""`ConvertError`: why a layout conversion was refused. Nothing is written when it is raised."""

from __future__ import annotations

from lorafast.errors import LorafastError

#: every `ConvertError.code`
CONVERT_ERROR_CODES = (
    "layout_mismatch",  # the adapter is not in the layout `--from` names
    "mixed_layout",  # several MoE layouts inside one adapter
    "lossy",  # the conversion would change the adapter's delta (max difference in the message)
    "unsupported",  # no conversion from this layout to that one
    "exists",  # the output exists and overwrite was not asked for
    "truncated",  # the source file is shorter than its header says
    "bad_source",  # the source cannot be read or is inconsistent (missing experts, shape mismatch)
    "write_error",  # the output cannot be written (read-only folder, full disk, file-size limit)
)


class ConvertError(LorafastError, ValueError):
    """A conversion refused: `.code` (one of `CONVERT_ERROR_CODES`) and `.path` (the source adapter; the output
    for `exists` and `write_error`). `.cli`: the message as `lorafast convert` prints it, naming its flags
    (`--overwrite`) where the message names `convert`'s arguments (`overwrite=True`)."""

    def __init__(self, message: str, code: str, path: str | None = None, *, cli: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.path = path
        self.cli = cli if cli is not None else message

    def __reduce__(self):  # keep code, path and the CLI message through pickling
        return (_rebuild, (type(self), self.args[0], self.code, self.path, self.cli))


def _rebuild(cls: type[ConvertError], message: str, code: str, path: str | None, cli: str) -> ConvertError:
    return cls(message, code, path, cli=cli)


__all__ = ["CONVERT_ERROR_CODES", "ConvertError"]
