"""``auto``: our kernel or the torch call it replaces, whichever is correct and faster, per bucket.

Our CUDA kernels first meet most GPUs on a user's machine. So on the first call for a (device,
dtype, shape bucket) ``auto`` runs both sides on that very input, compares ours with torch within
the dtype's tolerance and times both; the faster correct side is kept in an on-disk cache
(pykernels/dispatch_cache.py) and logged in one line. A kernel that disagrees, or fails, is
disabled for its op on that device with one warning naming the shapes and the error; torch runs
that op from then on. On CPU ``auto`` means ours (the CPU kernels are gated by benchmarks) unless
PYKERNELS_AUTOTUNE_CPU=1, which runs the same decision with the CPU kernels standing in: that is
how the machinery is tested without a GPU.

Shape buckets: the token count is rounded up to a power of two (at least 16), the weight dims are
kept exact. Weight dims are few per model and decide the kernel's tiling, so they are exact; the
token count changes every step (packed sequences), and kernel-vs-torch speed changes slowly with
it, so a power of two bounds the decisions to ~log2(max tokens) per weight shape.

The decision is made on the forward under no_grad. The public function then runs whole on the
chosen side (torch's under pykernels.backend.forced; ours is the op's unforced path), so its autograd
(our registered backward or torch's) is the one the graph records: one op never mixes our forward
with torch's backward.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from pykernels import backend, dispatch_cache

logger = logging.getLogger("pykernels")
CPU_ENV_VAR = "PYKERNELS_AUTOTUNE_CPU"
MIN_TOKEN_BUCKET = 16

# Largest |ours - torch| relative to max |torch|, per input dtype: a few units of the dtype's
# rounding at GEMM depth (fp32 allows TF32 on the torch side). A wrong kernel misses by O(1).
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@dataclass
class Decision:
    choice: str  # "ours" | "torch"
    ours_ms: float | None = None
    torch_ms: float | None = None
    error: float | None = None  # max |ours - torch| / max |torch|
    reason: str = ""
    mismatch: bool = False  # ours disagreed or failed: disable the op's kernel


def token_bucket(tokens: int) -> int:
    """Smallest power of two >= tokens, at least MIN_TOKEN_BUCKET."""
    return max(MIN_TOKEN_BUCKET, 1 << max(0, int(tokens) - 1).bit_length())


def _tensors(output) -> list[torch.Tensor]:
    return [output] if isinstance(output, torch.Tensor) else [t for t in output if isinstance(t, torch.Tensor)]


def relative_error(ours, expected) -> float:
    """max |ours - expected| over all output tensors, relative to max |expected| (inf on a shape
    mismatch or a non-finite value where torch's is finite)."""
    worst = 0.0
    ours_list, expected_list = _tensors(ours), _tensors(expected)
    if len(ours_list) != len(expected_list):
        return float("inf")
    for got, want in zip(ours_list, expected_list, strict=True):
        if got.shape != want.shape:
            return float("inf")
        got, want = got.detach().double(), want.detach().double()
        finite = torch.isfinite(want)
        if bool((finite & ~torch.isfinite(got)).any()):
            return float("inf")
        if not bool(finite.any()):
            continue
        scale = max(float(want[finite].abs().max()), 1e-6)
        worst = max(worst, float((got - want)[finite].abs().max()) / scale)
    return worst


def cpu_timer(fn: Callable[[], object], warmup: int = 1, iters: int = 3) -> float:
    """Median seconds of fn() on the host clock."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cuda_timer(fn: Callable[[], object], warmup: int = 2, iters: int = 5, calls: int = 1) -> float:
    """Median seconds of fn() between CUDA events on the current stream (no host-side noise), over
    iters rounds of `calls` back-to-back calls each (per call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def decide(op: str, key: str, ours_fn: Callable, torch_fn: Callable, inputs: tuple, tolerance: float,
           timer: Callable[[Callable[[], object]], float]) -> Decision:
    """Run torch_fn(*inputs) and ours_fn(*inputs), compare, and time both if ours is right.

    Device-agnostic: the caller brings the timer. An exception from torch propagates (the input
    itself is bad); one from ours is a failed kernel and decides for torch with mismatch=True.
    Ours wins only when strictly faster: never slower."""
    with torch.no_grad():
        expected = torch_fn(*inputs)
        try:
            got = ours_fn(*inputs)
        except Exception as error:  # noqa: BLE001 - any failure of ours means: use torch
            return Decision("torch", reason=f"our kernel failed: {type(error).__name__}: {error}", mismatch=True)
        error = relative_error(got, expected)
        if not error <= tolerance:
            return Decision("torch", error=error, mismatch=True,
                            reason=f"ours disagrees with torch: max error {error:.3g} relative to the output's "
                                   f"scale, tolerance {tolerance:g}")
        ours_s = timer(lambda: ours_fn(*inputs))
        torch_s = timer(lambda: torch_fn(*inputs))
    choice = "ours" if ours_s < torch_s else "torch"
    return Decision(choice, ours_ms=ours_s * 1e3, torch_ms=torch_s * 1e3, error=error,
                    reason="faster" if choice == "ours" else "torch is as fast or faster")


def _decides_on(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get(CPU_ENV_VAR, "") not in ("", "0")


def _busy() -> bool:
    """Tracing or capturing a CUDA graph: no timing, no host syncs."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def choose(op: str, device: torch.device, dtype: torch.dtype, bucket: str, prepare: Callable[[], tuple],
           timer: Callable | None = None) -> str:
    """The side ``op`` takes under auto for this bucket: cached, or decided now and cached.
    prepare() -> (ours_fn, torch_fn, inputs), only called to decide (a cached call pays nothing)."""
    if not _decides_on(device):
        return "ours"
    if dispatch_cache.disabled(device, op) is not None:
        return "torch"
    key = f"{op} {dtype} {bucket}".replace("torch.", "")
    cached = dispatch_cache.lookup(device, key)
    if cached is not None or _busy():
        return cached["choice"] if cached is not None else "ours"
    timer = timer or (cuda_timer if device.type == "cuda" else cpu_timer)
    decision = decide(op, key, *prepare(), TOLERANCE.get(dtype, TOLERANCE[torch.float32]), timer)
    name = dispatch_cache.identity(device)["device"]
    if decision.mismatch:
        warnings.warn(f"pykernels: disabling our {op} kernel on {name}: for {key}, {decision.reason}; "
                      f"torch runs {op} from now on (set PYKERNELS_KERNELS={op}=ours to force ours)",
                      RuntimeWarning, stacklevel=3)
    else:
        logger.info("pykernels: %s on %s: ours %.3f ms, torch %.3f ms (error %.2g) -> %s", key, name,
                    decision.ours_ms, decision.torch_ms, decision.error, decision.choice)
    dispatch_cache.record(device, key, asdict(decision), disable_op=op if decision.mismatch else None)
    return decision.choice


def dispatched(op: str, fn: Callable, bucket: Callable, torch_fn: Callable | None = None,
               probe: dict | None = None) -> Callable:
    """Wrap the public function ``fn`` of ``op``: run it on the side its mode picks.

    bucket(*args, **kwargs) -> (device, dtype, description): the shape bucket of a call. torch_fn:
    the torch call ours replaces, when it is not ``fn`` on the torch side (the pure-torch
    reference). probe: argument values for the decision runs (lora: no dropout, so both sides see
    the same mask)."""
    signature = inspect.signature(fn)

    def run_torch(*args, **kwargs):
        if torch_fn is not None:
            return torch_fn(*args, **kwargs)
        with backend.forced(op, "torch"):
            return fn(*args, **kwargs)

    # Our side is fn itself, unforced: it takes our kernels unless the op is forced or configured to torch,
    # neither of which holds when ours was picked (a context manager per call costs a small layer's kernel
    # launch in host time, and every LoRA projection comes here).
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():  # traced: no timing, no thread state; the configured side
            return fn(*args, **kwargs)
        side = backend.forced_side(op) or backend.mode(op)
        if side == "auto":
            side = _auto_side(args, kwargs)
        return run_torch(*args, **kwargs) if side == "torch" else fn(*args, **kwargs)

    def _auto_side(args, kwargs) -> str:
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and not _decides_on(first.device):
            return "ours"  # decided without the bucket: nothing to look up on a CPU
        try:
            device, dtype, description = bucket(*args, **kwargs)
        except Exception:  # noqa: BLE001 - malformed arguments: let the op raise its own clear error
            return "ours"

        def prepare():
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            bound.arguments.update(probe or {})
            return (lambda *a: fn(*a, **bound.kwargs), lambda *a: run_torch(*a, **bound.kwargs), bound.args)

        return choose(op, device if isinstance(device, torch.device) else torch.device(device), dtype, description,
                      prepare)

    return wrapper
