"""What ``Diagnose`` reasons with: pure functions and small host-side
watchers that turn statistics into findings (:class:`flaxhooks.Finding`),
and the pictures that show them. The callback itself is
:class:`flaxhooks.Diagnose`."""

__all__: list[str] = []
