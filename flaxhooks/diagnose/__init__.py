"""What ``Diagnose`` reasons with: pure functions and small host-side
watchers that turn statistics into findings (:class:`flaxhooks.Finding`),
and the pictures that show them. The callback itself is
:class:`flaxhooks.Diagnose`."""

from flaxhooks.diagnose._heatmap import MISSING, NON_FINITE, Heatmaps, colormap, heatmap
from flaxhooks.writers import encode_png

__all__: list[str] = ["MISSING", "NON_FINITE", "Heatmaps", "colormap", "encode_png", "heatmap"]
