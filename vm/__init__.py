"""Tool computers: per-user VMs on libvirt (hypervisor adapter, guest channel, browser, handoff). Not built yet."""

__all__: list[str] = []
