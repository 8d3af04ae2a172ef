"""The data side: host batches and their layout, arrays in memory, the input
pipeline that puts batches on the devices, and the devices themselves.

``__all__`` is what users write and extend (loaders, placement rules, positions,
errors); the other names here are the layers' own interface and may change in
any release.
"""

from flaxhooks.data._batches import (
    ArrayLoader,
    BatchError,
    BatchSpec,
    EmptyDataError,
    HostBatch,
    check_layout,
)
from flaxhooks.data._devices import InFlight as InFlight  # for step and eval, not in __all__
from flaxhooks.data._devices import (
    cpu_pool_size,
    cpu_threads_needed,
    device0_copy,
    first_replica,
    host_scalars,
    unreplicate,
    use_cpu_devices,
)
from flaxhooks.data._mesh import (
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
from flaxhooks.data._pipeline import DevicePrefetch
from flaxhooks.data._sources import (
    Data,
    DataPosition,
    DataResumeError,
    DataSource,
    fingerprint,
)

__all__ = [
    "ArrayLoader",
    "AxisRules",
    "BatchError",
    "BatchSpec",
    "Data",
    "DataPosition",
    "DataResumeError",
    "DevicePrefetch",
    "EmptyDataError",
    "FSDP",
    "HostBatch",
    "Replicated",
    "ShardRule",
    "ShardingError",
    "device0_copy",
    "use_cpu_devices",
]
