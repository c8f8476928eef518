"""torpor.sandbox.checkpoints: snapshot, restore, fork, volumes and drives.

:class:`Checkpoints` is a component over a :class:`~torpor.sandbox.manager.SandboxManager`: it
works on sandboxes only through the manager's held-sandbox interface
(:class:`~torpor.sandbox.core.Held`), never through its private state.

* :mod:`.operations` — the class: freezing, snapshot, restore, fork, create with mounts
* :mod:`.clones` — cloning children from a frozen directory
* :mod:`.attach` — attaching volumes and drives, and the drive hooks around a hibernate
"""

from torpor.sandbox.checkpoints.operations import VOLUME_SNAPSHOT_REFUSAL, Checkpoints

__all__ = ["VOLUME_SNAPSHOT_REFUSAL", "Checkpoints"]
