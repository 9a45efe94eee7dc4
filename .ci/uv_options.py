"""Print the `uv pip install` options that give uv the package sources pip is configured with.

The Makefile installs with uv (the same resolution as pip's, in a third of the time: it downloads,
unpacks and byte-compiles on every core), but uv reads none of pip's configuration. On a machine
whose pip is pointed at a local wheel directory (find-links) or capped by a constraints file, uv
without them would resolve from PyPI alone: another torch build, other versions than pip picks.
`pip config list` reports pip's merged settings, PIP_* variables included (as `:env:.name`).
"""

import shlex
import subprocess
import sys

# pip's setting -> uv's option. Lists (find-links, extra-index-url, constraint) take every value
# from every scope; index-url is one URL, the environment's over install's over global's, as pip.
LISTS = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "constraint": "--constraint"}
SCOPE_ORDER = (":env:", "install", "global")
TRUE = {"1", "true", "yes", "on"}


def uv_options(pip_config_lines: list[str]) -> list[str]:
    """`pip config list` lines (scope.name='value') -> uv pip install options."""
    settings: dict[str, dict[str, str]] = {}
    for line in pip_config_lines:
        key, sep, quoted = line.strip().partition("=")
        scope, dot, name = key.rpartition(".")
        if not sep or not dot:
            continue
        values = shlex.split(quoted)
        settings.setdefault(name, {})[scope] = values[0] if values else ""

    options: list[str] = []
    for name, flag in LISTS.items():
        seen: list[str] = []
        for scope in SCOPE_ORDER:
            for value in settings.get(name, {}).get(scope, "").split():
                if value not in seen:
                    seen.append(value)
        for value in seen:
            options += [flag, value]
    for name, flag in (("index-url", "--index-url"), ("no-index", "--no-index")):
        by_scope = settings.get(name, {})
        value = next((by_scope[s] for s in SCOPE_ORDER if s in by_scope), None)
        if name == "index-url" and value:
            options += [flag, value]
        elif name == "no-index" and value is not None and value.lower() in TRUE:
            options.append(flag)
    return options


def main() -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    # No pip, or pip's config unreadable: uv's own defaults (PyPI), as a machine without pip.conf.
    lines = result.stdout.splitlines() if result.returncode == 0 else []
    print(shlex.join(uv_options(lines)))


if __name__ == "__main__":
    main()
