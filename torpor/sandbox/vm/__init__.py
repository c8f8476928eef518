"""torpor.sandbox.vm: one QEMU machine and the host's side of talking to it.

* :mod:`.machine` — :class:`~.machine.QemuMachine`: cold boot, hibernate, wake, kill,
  hot-plug, and a live capture (a copy of the running machine without hibernating it)
* :mod:`.hotplug` — the hot-plug of disks, network cards and shares (mixed into the machine)
* :mod:`.exits` — QEMUs told to quit after a hibernate, reaped in the background; a new start
  on the directory waits for them
* :mod:`.pool` — ready clones of a template's booted machine, so a create skips the clone
* :mod:`.machine_dir` — a machine's directory: machine.json, the QEMU command line,
  inspection after a crash, clones
* :mod:`.engine` — the :class:`~.engine.Engine` seam the manager drives (QEMU, or a fake in
  unit tests)
* :mod:`.channel` — the guest channel (virtio-serial): commands, files, the interpreter
* :mod:`.accel` — KVM or TCG, decided by a probe boot
* :mod:`.disk` — disk and file utilities: qemu-img, sparse copies, atomic writes, fsync
* :mod:`.jail` — who QEMU runs as: a tenant's own unprivileged uid under a root server

Imports: torpor.config, torpor.errors, torpor.sandbox.models, torpor.sandbox.guest.protocol.
Nothing here knows about the registry, templates or stored snapshots.
"""
