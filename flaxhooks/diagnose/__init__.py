"""What ``Diagnose`` reasons with: pure functions and small host-side
watchers that turn statistics into findings (:class:`flaxhooks.Finding`),
and the pictures that show them. The callback itself is
:class:`flaxhooks.Diagnose`."""

from flaxhooks.diagnose._loss import LossThresholds, LossWatch

__all__: list[str] = ["LossThresholds", "LossWatch"]
