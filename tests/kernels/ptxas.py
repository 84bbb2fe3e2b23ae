"""What ptxas reports of an instance that bench/sass_mix.py's `build_instance` compiled."""

import re


def resource_usage(resources: str) -> tuple[int, int]:
    """(registers, spill store + load bytes) of the instance from build_instance's resource
    lines: ptxas reports it first (the module's other entry, moe_align, follows)."""
    registers = re.search(r"Used (\d+) registers", resources)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", resources)
    if registers is None or spills is None:
        raise ValueError(f"no ptxas resource usage in: {resources!r}")
    return int(registers.group(1)), int(spills.group(1)) + int(spills.group(2))
