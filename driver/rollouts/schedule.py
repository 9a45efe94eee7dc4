"""Which adapter version generates which batch, and when vLLM gets a new one.

Generation job j (0-based) feeds optimizer step j + 1: when the trainer consumes it, it has taken
j steps. With prefetch depth d, the job is generated while the trainer is still d steps behind,
and with a sync every k steps the engine serves the newest multiple of k:

    version(j) = k * floor(max(0, j - d) / k)

so a sample is j - version(j) in [d, d + k - 1] versions old when trained on (d = 0, k = 1: the
synchronous loop, always on-policy up to the engine mismatch). Versions, prompts and seeds are
pure functions of j, so an asynchronous run is as reproducible as a synchronous one.
"""

from __future__ import annotations

from driver.config import schedule_staleness


def job_version(job: int, depth: int, interval: int) -> int:
    if job < 0 or depth < 0 or interval < 1:
        raise ValueError(f"job_version: need job >= 0, depth >= 0, interval >= 1; got {job}, {depth}, {interval}")
    return interval * (max(0, job - depth) // interval)


def sync_due(step: int, interval: int) -> bool:
    """Whether the adapter after `step` optimizer steps is pushed to the engine (step 0: the initial one)."""
    return step % interval == 0


def staleness(step: int, version: int) -> int:
    """Versions between the trainer (after `step` optimizer steps) and the policy that sampled."""
    return step - version


def versions_kept(depth: int, interval: int) -> int:
    """Adapter versions to keep servable: after the push of version v, unconsumed jobs (j >= v) still
    use versions down to v - d - k + 1, i.e. the (d + k - 1) // k newest multiples of k below v, plus
    v itself and one spare (the synchronous loop's 2: the version served and the one before)."""
    return schedule_staleness(depth, interval) // interval + 2
