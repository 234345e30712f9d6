"""This process's resident memory from Linux's ``/proc/self/status``, with a resettable peak.

``ru_maxrss`` would not do for a peak during one step: it is a high-water mark over the whole life
of the process (a spawned process even starts with its parent's), so an import's or a fork's peak
hides a smaller step's.
"""

import re


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE).group(1))


def rss_bytes() -> int:
    """The resident size now (``VmRSS``)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The peak resident size since the last ``reset_peak_rss`` (``VmHWM``)."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Set the peak to the current resident size."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
