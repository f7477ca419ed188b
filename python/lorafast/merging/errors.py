"""`MergeError`: every failure of a merge or unmerge, naming the module and the adapter involved."""

from __future__ import annotations

from lorafast.errors import LorafastError

#: stable values of `MergeError.code`
MERGE_ERROR_CODES = (
    "missing_module",  # no tensor in the model matches the adapter module
    "ambiguous_module",  # more than one tensor matches
    "prefix_only",  # a tensor has the module's path only below another prefix (allow_prefix=True merges there)
    "shape_mismatch",  # factor shapes do not fit the target weight
    "unsupported",  # a variant, layout or option the engine does not merge (LoHa, kohya DoRA, modules_to_save, ...)
    "dtype",  # a weight or factor dtype that cannot be merged (int, fp8, complex)
    "meta_device",  # a weight on the meta device (no data)
    "non_finite",  # NaN or Inf in the merged weight (safe=True)
    "read_error",  # adapter tensor bytes could not be read (truncated file, ...)
    "bad_request",  # the plan or request list could not be understood
    "not_merged",  # unmerge of a handle that is not merged
    "stale",  # the weight changed after the merge; an unmerge would silently drop that change
    "failed",  # anything else raised half-way (the original exception is chained)
)


class MergeError(LorafastError, ValueError):
    """A merge failed. `module` and `adapter` name what was being merged; `code` is one of `MERGE_ERROR_CODES`.

    When raised by `merge()`, the weights are as they were before the call: bit for bit with a snapshot, by
    subtraction in `snapshot="subtract"` mode. `restored` is False when that could not be done (an unmerge
    refused as stale, or NaN/Inf written with `safe=False` that subtraction cannot take back).
    """

    def __init__(
        self,
        message: str,
        code: str = "failed",
        *,
        module: str | None = None,
        adapter: str | None = None,
        problems: tuple[str, ...] = (),
        restored: bool = True,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.module = module
        self.adapter = adapter
        self.problems = problems
        self.restored = restored

    def __reduce__(self):  # keep the fields through pickling
        kwargs = {
            "module": self.module,
            "adapter": self.adapter,
            "problems": self.problems,
            "restored": self.restored,
        }
        return (_rebuild, (type(self), self.args[0], self.code, kwargs))


def _rebuild(cls: type[MergeError], message: str, code: str, kwargs: dict) -> MergeError:
    return cls(message, code, **kwargs)
