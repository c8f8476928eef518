"""torpor.sandbox: execution state. Each agent's machine is a QEMU microVM that hibernates to
disk with its RAM, processes and files, and wakes where it was.

The layers, top to bottom (each may import only the ones below it; ``scripts/check`` runs
import-linter to keep it so)::

    checkpoints/   snapshot, restore, fork, attaching volumes and drives: a component over
                   the manager's held-sandbox interface (:class:`~torpor.sandbox.core.Held`)
    manager.py     SandboxManager: create, pause, wake, kill, calls inside a sandbox
    core.py        the manager's state and the steps its operations are made of
    registry.py    the SQLite registry of sandboxes and their transitions
    lifecycle.py   the state machine: states, legal transitions, recovery after a restart
    storage/       what outlives a machine: chunks, snapshots, volumes, drives, retention
    template/      guest templates: the Debian rootfs, the first boot
    vm/            one QEMU machine: its directory, command line, hibernate/wake, the guest
                   channel, the KVM-or-TCG probe, disk utilities
    requests.py, models.py   what callers send and get back (pydantic; no I/O)
    guest/         the agent that runs INSIDE the VM (stdlib only, imports nothing of torpor)
"""
