"""torpor.sandbox.template: guest templates.

A template is a Debian rootfs made by debootstrap from the host's apt mirror, with the guest's
own kernel and initrd and the guest agent (:mod:`.rootfs`), booted once and hibernated: every
sandbox is a clone of that booted snapshot (:mod:`.templates`).

Imports: torpor.config, torpor.errors, torpor.sandbox.vm.
"""

from torpor.sandbox.template.templates import (
    AGENT_TIMEOUT,
    GUEST_DIR,
    TemplateInfo,
    build,
    get,
    list_templates,
    recipe,
    remove,
    stale_reason,
)

__all__ = [
    "AGENT_TIMEOUT",
    "GUEST_DIR",
    "TemplateInfo",
    "build",
    "get",
    "list_templates",
    "recipe",
    "remove",
    "stale_reason",
]
