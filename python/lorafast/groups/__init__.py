"""Serving groups: split a fleet of adapters into the fewest SGLang servers that can each load their share,
converting layouts where that saves a server (`plan_groups(convert=True)`). See `groups._plan`."""

from lorafast.groups._plan import (
    NO_SHARED_OUTER_FLAG,
    SHARED_OUTER_FLAG,
    TARGET_MODULE_CHOICES,
    ConversionStep,
    GroupPlan,
    OuterLayout,
    ServingGroup,
    Unservable,
    adapter_targets,
    outer_layout,
    plan_groups,
)

__all__ = [
    "NO_SHARED_OUTER_FLAG",
    "SHARED_OUTER_FLAG",
    "TARGET_MODULE_CHOICES",
    "ConversionStep",
    "GroupPlan",
    "OuterLayout",
    "ServingGroup",
    "Unservable",
    "adapter_targets",
    "outer_layout",
    "plan_groups",
]
