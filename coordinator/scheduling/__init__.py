"""The multi-job scheduler's decisions, pure: capacity, quotas, queue order, gang
admission, phase-aware preemption and the snapshot interval.

Every function takes the time as an argument and returns its decision with the reason;
nothing here does I/O. One module per job:

* :mod:`.model`: regions, needs, jobs and their training phase;
* :mod:`.config`: priority classes, ageing, preemption and team quotas (YAML);
* :mod:`.capacity`: what is free and why a need does not fit;
* :mod:`.quota`: GPU usage per team from run intervals, and quota checks;
* :mod:`.queue`: the order of waiting jobs (priority with ageing, fair share, age);
* :mod:`.admission`: the gang decision for one job;
* :mod:`.preemption`: which jobs a blocked job may stop, at their round boundary;
* :mod:`.plan`: one pass over the queue;
* :mod:`.checkpoint_interval`: the Young/Daly snapshot interval;
* :mod:`.elastic`: regions joining and leaving a running job, and their data shard slots.
"""

from coordinator.scheduling.admission import Blocker, CapacityDecision, admit
from coordinator.scheduling.capacity import Free, Lack, Shortfall, free_capacity, shortfall
from coordinator.scheduling.checkpoint_interval import (
    SnapshotInterval,
    combined_mtbf,
    observed_mtbf,
    snapshot_interval,
)
from coordinator.scheduling.config import (
    AgeingConfig,
    PreemptionConfig,
    SchedulingConfig,
    TeamQuota,
    parse_scheduling_config,
)
from coordinator.scheduling.model import (
    Job,
    Region,
    RegionCapacity,
    RegionNeed,
    SchedulingState,
    TrainingPhase,
)
from coordinator.scheduling.plan import Plan, Wait, plan
from coordinator.scheduling.preemption import Preemption, Victim, choose_victims, lost_rounds
from coordinator.scheduling.queue import Ranked, effective_priority, queue_order
from coordinator.scheduling.quota import (
    RunInterval,
    concurrent_gpus,
    gpu_hours,
    quota_refusal,
    uncounted_gpus_refusal,
)

__all__ = [
    "AgeingConfig",
    "Blocker",
    "CapacityDecision",
    "Free",
    "Job",
    "Lack",
    "Plan",
    "Preemption",
    "PreemptionConfig",
    "Ranked",
    "Region",
    "RegionCapacity",
    "RegionNeed",
    "RunInterval",
    "SchedulingConfig",
    "SchedulingState",
    "Shortfall",
    "SnapshotInterval",
    "TeamQuota",
    "TrainingPhase",
    "Victim",
    "Wait",
    "admit",
    "choose_victims",
    "combined_mtbf",
    "concurrent_gpus",
    "effective_priority",
    "free_capacity",
    "gpu_hours",
    "lost_rounds",
    "observed_mtbf",
    "parse_scheduling_config",
    "plan",
    "queue_order",
    "quota_refusal",
    "shortfall",
    "snapshot_interval",
    "uncounted_gpus_refusal",
]
