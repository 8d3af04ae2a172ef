"""What ``Diagnose`` reasons with: pure functions and small host-side
watchers that turn statistics into findings (:class:`flaxhooks.Finding`),
and the pictures that show them. The callback itself is
:class:`flaxhooks.Diagnose`."""

from flaxhooks.diagnose._setup import (
    DEFAULT_RNG_NAMES,
    CallSources,
    DropoutCall,
    Sources,
    call_sources,
    dropout_in_eval,
    output_sources,
    rng_streams,
    setup_findings,
)

__all__: list[str] = [
    "DEFAULT_RNG_NAMES",
    "CallSources",
    "DropoutCall",
    "Sources",
    "call_sources",
    "dropout_in_eval",
    "output_sources",
    "rng_streams",
    "setup_findings",
]
