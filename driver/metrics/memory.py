"""Peak memory of a phase of the step (the update: old/ref/policy scoring, backward, optimizer).

On CUDA the caching allocator's peak of allocated tensor memory; on CPU the process's peak resident
set (reset through /proc/self/clear_refs), which also counts anything else the process holds
(an in-process vLLM engine included): compare runs of one configuration, not across machines.
"""

from __future__ import annotations

import torch


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # peak resident set := current resident set
    except OSError:
        pass


def peak_gib(device: torch.device) -> float | None:
    """Peak since reset_peak, in GiB (None where the platform does not tell)."""
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _status_bytes("VmHWM")
    return None if peak is None else peak / 2**30
