"""Where arrays live: the devices, the mesh, and the rules that place the state on it.

``__all__`` is what users write; the other names may change in any release.
"""

from flaxhooks.placement._devices import InFlight as InFlight  # for step and eval, not in __all__
from flaxhooks.placement._devices import Stacked as Stacked  # for step and the loop, not in __all__
from flaxhooks.placement._devices import (
    StepValue,
    cpu_pool_size,
    cpu_threads_needed,
    device0_copy,
    first_replica,
    host_scalars,
    use_cpu_devices,
)
from flaxhooks.placement._host_memory import DEFAULT_MALLOC_VARIABLE, keep_freed_host_memory
from flaxhooks.placement._mesh import (
    DATA_AXIS,
    FSDP,
    Annotation,
    AxisRules,
    Placement,
    Replicated,
    ShardingError,
    ShardRule,
    default_mesh,
    spec_text,
)

__all__ = [
    "DEFAULT_MALLOC_VARIABLE", "AxisRules", "FSDP", "Replicated", "ShardRule", "ShardingError", "StepValue",
    "device0_copy", "keep_freed_host_memory", "use_cpu_devices"
]
