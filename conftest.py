"""`pytest --benchmark`: the benchmark suite and its speedup gate in one session
(benchmarks/gate_plugin.py). Without the option nothing here imports or collects anything."""


def pytest_addoption(parser):
    parser.getgroup("benchmark").addoption(
        "--benchmark", action="store_true", default=False,
        help="run the benchmarks (benchmarks/, or the paths given; -k selects as usual) and then the speedup "
             "gate against benchmarks/thresholds.toml: exit 1 when a rule misses its floor")


def pytest_configure(config):
    if config.getoption("benchmark"):
        from benchmarks.gate_plugin import GatePlugin

        config.pluginmanager.register(GatePlugin(config), "benchmark-gate")
