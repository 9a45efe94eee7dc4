"""What a run does before its first step, shown on the terminal as it happens.

Loading the model, the prompts or a checkpoint and starting vLLM take seconds on the tiny models and
minutes on real ones (weights read and quantized, the engine's torch.compile and CUDA graphs), and
with the libraries' output in run.log the terminal would stay blank all that time. Each phase shows a
spinner with its elapsed time (on a terminal, with logging.progress and logging.quiet: otherwise the
libraries' own output would run through it) and leaves one line saying what it did and how long it
took; a phase that fails leaves no line (the error is reported as before). Other ranks show nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.spinner import Spinner
from rich.text import Text


class StartupPhases:
    def __init__(self, console: Console | None, spinner: bool) -> None:
        self._console = console
        self._spinner = spinner and console is not None and console.is_terminal

    @contextlib.contextmanager
    def phase(self, doing: str, done: str | Callable[[], str]) -> Iterator[None]:
        """The body as one phase: `doing` while it runs ("loading x"), then "`done` in 1.2 s" (done: the
        text, or a function giving it once the body has run, e.g. with what it loaded)."""
        started = time.perf_counter()
        spinner = Spinner("dots", style="green")

        def running() -> Spinner:  # rendered again at every refresh: what runs, and for how long so far
            spinner.text = Text.assemble(f"{doing} ", (format_seconds(time.perf_counter() - started), "dim"))
            return spinner

        # Live without redirecting sys.stdout / sys.stderr: rich's default would send what Python code
        # writes there (run.log during the run) to the terminal, and a library that set up its logging
        # meanwhile (vLLM's, imported in this phase) would keep writing there for the whole run.
        status = (Live(get_renderable=running, console=self._console, refresh_per_second=12.5, transient=True,
                       redirect_stdout=False, redirect_stderr=False)
                  if self._spinner else contextlib.nullcontext())
        with status:
            yield
        if self._console is not None:
            text = done() if callable(done) else done
            self._console.print(f"{escape(text)} [dim]in {format_seconds(time.perf_counter() - started)}[/dim]")

    def print(self, text: str) -> None:
        if self._console is not None:
            self._console.print(text)


def describe(policy) -> str:
    """The loaded policy in a few words: how much of it trains (PEFT's print_trainable_parameters, briefly)."""
    return f"{human_count(sum(p.numel() for p in policy.trainable_parameters()))} trainable parameters"


def human_count(n: int) -> str:
    for limit, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= limit:
            return f"{n / limit:.1f}{suffix}"
    return str(n)


def format_seconds(seconds: float) -> str:
    if round(seconds, 1) < 60:  # 59.97 s is "1m00s", not "60.0 s"
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s"
