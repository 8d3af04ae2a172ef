"""The data side: host batches, arrays in memory, data sources and positions, the input pipeline.

``__all__`` is what users write and extend; the other names may change in any release.
"""

from flaxhooks._moved import moved_names
from flaxhooks.data._batches import (
    ArrayLoader,
    BatchError,
    BatchSpec,
    EmptyDataError,
    HostBatch,
    check_batch,
)
from flaxhooks.data._pipeline import DevicePrefetch
from flaxhooks.data._sources import Data, DataPosition, DataResumeError, DataSource, fingerprint

__all__ = [
    "ArrayLoader", "BatchError", "BatchSpec", "Data", "DataPosition", "DataResumeError", "DevicePrefetch",
    "EmptyDataError", "HostBatch"
]

# Moved to flaxhooks.placement, or renamed, in 0.8: the old names work until 0.9, with a warning.
__getattr__ = moved_names(__name__, {
    "flaxhooks.placement": "DATA_AXIS FSDP AxisRules Placement Replicated ShardRule ShardingError "
                           "cpu_pool_size cpu_threads_needed default_mesh device0_copy first_replica "
                           "host_scalars spec_text use_cpu_devices",
}, renamed={"check_layout": "flaxhooks.data.check_batch"})
