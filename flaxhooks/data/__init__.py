"""The data side: host batches and their layout, arrays in memory, the input
pipeline that puts batches on the devices, and the devices themselves."""

from flaxhooks.data._batches import (
    ArrayLoader,
    BatchError,
    BatchSpec,
    EmptyDataError,
    HostBatch,
    check_layout,
)
from flaxhooks.data._devices import (
    cpu_pool_size,
    cpu_threads_needed,
    device0_copy,
    first_replica,
    host_scalars,
    unreplicate,
    use_cpu_devices,
)
from flaxhooks.data._pipeline import Data, DataSource, DevicePrefetch

__all__ = [
    "ArrayLoader",
    "BatchError",
    "BatchSpec",
    "Data",
    "DataSource",
    "DevicePrefetch",
    "EmptyDataError",
    "HostBatch",
    "check_layout",
    "cpu_pool_size",
    "cpu_threads_needed",
    "device0_copy",
    "first_replica",
    "host_scalars",
    "unreplicate",
    "use_cpu_devices",
]
