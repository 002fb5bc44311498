"""Pure decisions (sans-IO): handoff mode, pipeline choice, RLD admission, bandwidth/RTT estimates.

Nothing here touches sockets or clocks; callers pass observations and times in. The daemons and
the simulator drive the very same objects.
"""

from pddnet.policy.estimators import BandwidthEstimator, RttEstimator
from pddnet.policy.handoff import HandoffDecision, HandoffMode, HandoffPolicy

__all__ = [
    "BandwidthEstimator",
    "HandoffDecision",
    "HandoffMode",
    "HandoffPolicy",
    "RttEstimator",
]
