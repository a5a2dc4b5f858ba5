"""The planner: memory and time of a sharded training step, before anything is allocated."""

from __future__ import annotations

from .estimate import TimeEstimate
from .plan import plan
from .profiles import DEVICES, INTERCONNECTS, DeviceProfile, InterconnectProfile
from .result import PerRank, Plan
from .shape import TransformerShape

__all__ = [
    "DEVICES",
    "INTERCONNECTS",
    "DeviceProfile",
    "InterconnectProfile",
    "PerRank",
    "Plan",
    "TimeEstimate",
    "TransformerShape",
    "plan",
]
