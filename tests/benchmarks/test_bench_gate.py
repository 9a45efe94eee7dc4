"""The benchmark gate passes on healthy ratios and fails on a 2x slowdown or missing results."""

import json

import pytest

from benchmarks import gate

CASES = ("4096x4096", "4096x14336")


def write_results(path, ours_ms: float, bnb_ms: float, device_class: str = "cpu", impls=("ours", "bitsandbytes")):
    benchmarks = []
    for case in CASES:
        for impl in impls:
            seconds = (ours_ms if impl == "ours" else bnb_ms) / 1e3
            benchmarks.append({
                "name": f"test_dequantize[{case}-{impl}]",
                "fullname": f"benchmarks/test_bench_nf4.py::test_dequantize[{case}-{impl}]",
                "extra_info": {"family": "nf4", "op": "dequantize", "case": case, "impl": impl,
                               "device_class": device_class, "repeats": 1},
                "stats": {"min": seconds, "median": seconds * 1.1},
            })
    path.write_text(json.dumps({"benchmarks": benchmarks}))
    return path


@pytest.fixture
def thresholds(tmp_path):
    path = tmp_path / "thresholds.toml"
    path.write_text('[cpu]\n"nf4.dequantize.bitsandbytes" = { geomean = 2.5, each = 1.0 }\n')
    return path


def test_passes_when_every_case_meets_its_floor(tmp_path, thresholds, capsys):
    results = write_results(tmp_path / "ok.json", ours_ms=3.0, bnb_ms=12.0)
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 0
    assert "1/1 rules passed" in capsys.readouterr().out


def test_fails_on_a_planted_2x_slowdown(tmp_path, thresholds, capsys):
    results = write_results(tmp_path / "slow.json", ours_ms=6.0, bnb_ms=12.0)
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 1
    out = capsys.readouterr().out
    assert "2.00x   2.50x  FAIL (geometric mean of 2 cases)" in out


def test_one_case_below_its_hard_target_fails_even_with_a_good_mean(tmp_path, capsys):
    thresholds = tmp_path / "t.toml"
    thresholds.write_text('[cpu]\n"nf4.dequantize.bitsandbytes" = { geomean = 1.5, each = 1.0 }\n')
    results = write_results(tmp_path / "r.json", 3.0, 12.0)
    data = json.loads(results.read_text())
    data["benchmarks"][1]["stats"]["min"] = 0.0029  # bitsandbytes faster than ours on one case
    results.write_text(json.dumps(data))
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 1
    assert "0.97x   1.00x  FAIL" in capsys.readouterr().out


def test_bare_number_sets_the_geomean_floor(tmp_path):
    thresholds = tmp_path / "t.toml"
    thresholds.write_text('[cpu]\n"nf4.dequantize.bitsandbytes" = 4.5\n')
    assert gate.load_floors(thresholds, "cpu") == {"nf4.dequantize.bitsandbytes": [gate.Floor(4.5, None)]}
    assert gate.main([str(write_results(tmp_path / "r.json", 3.0, 12.0)), "--thresholds", str(thresholds)]) == 1


def test_malformed_rule_is_a_clear_error(tmp_path):
    thresholds = tmp_path / "t.toml"
    thresholds.write_text('[cpu]\n"nf4.dequantize" = 2\n')
    with pytest.raises(SystemExit, match="expected"):
        gate.load_floors(thresholds, "cpu")


def test_fails_when_the_baseline_was_not_measured(tmp_path, thresholds, capsys):
    results = write_results(tmp_path / "nobase.json", 3.0, 12.0, impls=("ours",))
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 1
    assert "MISSING" in capsys.readouterr().out


def test_fails_when_a_rule_has_no_results(tmp_path, capsys):
    thresholds = tmp_path / "t.toml"
    thresholds.write_text('[cpu]\n"nf4.dequantize.bitsandbytes" = 2.5\n"nf4.quantize.bitsandbytes" = 40\n')
    results = write_results(tmp_path / "r.json", 3.0, 12.0)
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 1
    assert "(no results)" in capsys.readouterr().out


def test_unknown_device_class_is_a_clear_error(tmp_path, thresholds):
    results = write_results(tmp_path / "r.json", 3.0, 12.0, device_class="mi300")
    with pytest.raises(SystemExit, match=r"has no \[mi300\] section"):
        gate.main([str(results), "--thresholds", str(thresholds)])


def test_missing_results_file_is_reported(tmp_path, thresholds, capsys):
    assert gate.main([str(tmp_path / "none.json"), "--thresholds", str(thresholds)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_repository_thresholds_parse_for_every_device_class():
    for device_class in ("cpu", "cpu-zen4", "cpu-avx512", "cpu-amx", "cpu-avx2", "cpu-scalar", "h100", "h200"):
        floors = gate.load_floors(gate.DEFAULT_THRESHOLDS, device_class)
        assert floors
        for rule, floor in ((rule, floor) for rule, rule_floors in floors.items() for floor in rule_floors):
            # Ours must never be allowed to lose to a competitor. base_matmul is a lower bound
            # instead (the frozen layer alone: ours does that and LoRA on top) and copy a ceiling (a
            # device copy of the bytes ours moves), so their floors are < 1.
            if rule.endswith((".base_matmul", ".copy")):
                assert 0.5 <= floor.geomean < 1.0 and (floor.each is None or floor.each < 1.0), rule
            else:
                assert floor.geomean >= 1.0 and (floor.each is None or floor.each >= 1.0), rule


def test_peak_memory_rule_compares_recorded_memory_not_time(tmp_path, capsys):
    thresholds = tmp_path / "t.toml"
    thresholds.write_text('[cpu]\n"nf4.dequantize.bitsandbytes.peak_memory" = { geomean = 8, each = 8 }\n')
    results = write_results(tmp_path / "r.json", ours_ms=12.0, bnb_ms=3.0)  # ours slower: irrelevant here
    data = json.loads(results.read_text())
    for bench in data["benchmarks"]:
        bench["extra_info"]["peak_extra_bytes"] = 2**20 if bench["extra_info"]["impl"] == "ours" else 10 * 2**20
    results.write_text(json.dumps(data))
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 0
    assert "1 MiB" in capsys.readouterr().out
    data["benchmarks"][0]["extra_info"]["peak_extra_bytes"] = 0  # below resolution: counted as 1 MiB, no crash
    results.write_text(json.dumps(data))
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 0
    data["benchmarks"][1]["extra_info"]["peak_extra_bytes"] = 7 * 2**20  # one case only 7x leaner
    results.write_text(json.dumps(data))
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 1
    bad = tmp_path / "bad.toml"
    bad.write_text('[cpu]\n"nf4.dequantize.bitsandbytes.bytes" = { geomean = 8 }\n')
    with pytest.raises(SystemExit, match=r"\[\.peak_memory\]"):
        gate.load_floors(bad, "cpu")


def test_cases_filter_limits_a_rule_to_matching_cases(tmp_path):
    thresholds = tmp_path / "t.toml"
    thresholds.write_text('[cpu]\n"nf4.dequantize.bitsandbytes" = { geomean = 3.0, each = 3.0, cases = "14336" }\n')
    results = write_results(tmp_path / "r.json", 3.0, 12.0)
    data = json.loads(results.read_text())
    data["benchmarks"][1]["stats"]["min"] = 0.003  # 4096x4096: 1x, outside the rule's cases
    results.write_text(json.dumps(data))
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 0
    check, = gate.evaluate(gate.load_results(results), gate.load_floors(thresholds, "cpu"))
    assert [c.case for c in check.cases] == ["4096x14336"]


def test_a_list_sets_several_floors_on_one_rule(tmp_path, capsys):
    thresholds = tmp_path / "t.toml"
    thresholds.write_text('[cpu]\n"nf4.dequantize.bitsandbytes" = [{ geomean = 1.0, each = 1.0 },\n'
                          '  { geomean = 3.0, each = 3.0, cases = "14336" }]\n')
    results = write_results(tmp_path / "r.json", 3.0, 12.0)
    data = json.loads(results.read_text())
    data["benchmarks"][1]["stats"]["min"] = 0.006  # 4096x4096: 2x, meets the first floor only
    results.write_text(json.dumps(data))
    checks = gate.evaluate(gate.load_results(results), gate.load_floors(thresholds, "cpu"))
    assert [(c.floor.cases, len(c.cases), c.passed) for c in checks] == [(None, 2, True), ("14336", 1, True)]
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 0
    assert "nf4.dequantize.bitsandbytes [14336]" in capsys.readouterr().out
    data["benchmarks"][3]["stats"]["min"] = 0.006  # 4096x14336 now 2x too: below the second floor
    results.write_text(json.dumps(data))
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 1
    empty = tmp_path / "empty.toml"
    empty.write_text('[cpu]\n"nf4.dequantize.bitsandbytes" = []\n')
    with pytest.raises(SystemExit, match="list of such tables"):
        gate.load_floors(empty, "cpu")


def test_remeasure_times_only_the_failing_cases_again_and_judges_the_best_of_both(tmp_path, monkeypatch, capsys):
    thresholds = tmp_path / "t.toml"
    thresholds.write_text('[cpu]\n"nf4.dequantize.bitsandbytes" = { geomean = 1.5, each = 1.0 }\n')
    results = write_results(tmp_path / "r.json", 3.0, 12.0)
    data = json.loads(results.read_text())
    data["benchmarks"][0]["stats"]["min"] = 0.015  # ours on 4096x4096 hit by interference: 0.8x
    results.write_text(json.dumps(data))
    asked = []

    def rerun(tests, json_path, ours_ms):
        asked.append(tests)
        write_results(json_path, ours_ms=ours_ms, bnb_ms=12.5)  # every case, as if all had run
        return True

    monkeypatch.setattr(gate, "run_benchmarks", lambda tests, path: rerun(tests, path, ours_ms=3.1))
    assert gate.main([str(results), "--thresholds", str(thresholds)]) == 1  # without the flag: judged once
    assert not asked
    assert gate.main([str(results), "--thresholds", str(thresholds), "--remeasure"]) == 0
    assert asked == [["benchmarks/test_bench_nf4.py::test_dequantize[4096x4096-ours]",
                      "benchmarks/test_bench_nf4.py::test_dequantize[4096x4096-bitsandbytes]"]]
    out = capsys.readouterr().out
    assert "best of both runs" in out and "1/1 rules passed" in out

    # A real regression is slow in both runs; the gate still fails.
    monkeypatch.setattr(gate, "run_benchmarks", lambda tests, path: rerun(tests, path, ours_ms=14.0))
    assert gate.main([str(results), "--thresholds", str(thresholds), "--remeasure"]) == 1
    assert "0/1 rules passed" in capsys.readouterr().out


def test_remeasure_of_a_failed_mean_takes_every_case_of_the_rule(tmp_path, thresholds, monkeypatch, capsys):
    results = write_results(tmp_path / "slow.json", ours_ms=6.0, bnb_ms=12.0)  # 2x < 2.5x geomean floor
    asked = []
    monkeypatch.setattr(gate, "run_benchmarks", lambda tests, path: asked.append(tests) or False)
    assert gate.main([str(results), "--thresholds", str(thresholds), "--remeasure"]) == 1
    assert len(asked[0]) == 4
    assert "judging the first run" in capsys.readouterr().err


def test_scope_judges_complete_families_strictly_and_subsets_on_what_ran(tmp_path):
    thresholds = tmp_path / "t.toml"
    thresholds.write_text('[cpu]\n"nf4.dequantize.bitsandbytes" = 2.5\n"nf4.dequantize.torch_reference" = 50\n'
                          '"lora.forward_bf16.peft" = 1.3\n')
    results = gate.load_results(write_results(tmp_path / "r.json", 3.0, 12.0))[:3]  # 4096x14336 lacks bitsandbytes
    checks = gate.evaluate(results, gate.load_floors(thresholds, "cpu"))
    judged, not_evaluated = gate.scope(checks, None)  # the whole suite: every rule, missing results fail
    assert [(c.rule, c.passed) for c in judged] == [("lora.forward_bf16.peft", False),
                                                    ("nf4.dequantize.bitsandbytes", False),
                                                    ("nf4.dequantize.torch_reference", False)]
    assert not not_evaluated
    judged, not_evaluated = gate.scope(checks, {"nf4"})  # test_bench_nf4.py ran whole
    assert [(c.rule, c.passed) for c in judged] == [("nf4.dequantize.bitsandbytes", False),
                                                    ("nf4.dequantize.torch_reference", False)]
    assert [c.rule for c in not_evaluated] == ["lora.forward_bf16.peft"]
    judged, not_evaluated = gate.scope(checks, set())  # -k: judged on the cases where both sides ran
    assert [(c.rule, [r.case for r in c.cases], c.passed) for c in judged] == [
        ("nf4.dequantize.bitsandbytes", ["4096x4096"], True)]
    assert [c.rule for c in not_evaluated] == ["lora.forward_bf16.peft", "nf4.dequantize.torch_reference"]


@pytest.mark.parametrize(("isa", "cpu", "flags", "expected"), [
    ("avx512", ("AuthenticAMD", 0x1A), {"avx512_bf16"}, "cpu"),  # Zen 5
    ("amx", ("GenuineIntel", 6), {"avx512_bf16", "amx_bf16", "amx_tile"}, "cpu-amx"),  # Sapphire Rapids on
    ("avx512", ("GenuineIntel", 6), {"avx512_bf16", "amx_bf16", "amx_tile"}, "cpu"),  # tiles Linux refused
    ("avx512", ("GenuineIntel", 6), {"avx512_bf16"}, "cpu"),  # Cooper Lake: BF16 without AMX
    ("avx512", ("GenuineIntel", 6), set(), "cpu-avx512"),  # Skylake-SP to Ice Lake
    ("avx512", ("AuthenticAMD", 0x19), {"avx512_bf16"}, "cpu-zen4"),
    ("avx2", ("AuthenticAMD", 0x19), set(), "cpu-avx2"),  # Zen 3 is family 0x19 too, without AVX-512
    ("scalar", ("GenuineIntel", 6), set(), "cpu-scalar"),  # no AVX2 (or an older build's "scalar")
])
def test_cpu_device_class_follows_the_kernels_cpu_path_and_the_vector_units(monkeypatch, isa, cpu, flags, expected):
    import torch

    import pykernels
    from benchmarks import conftest

    info = pykernels.build_info()
    monkeypatch.setattr(pykernels, "build_info", lambda: {**info, "cpu_isa_detected": isa})
    monkeypatch.setattr(conftest, "cpu_family", lambda: cpu)
    monkeypatch.setattr(conftest, "cpu_flags", lambda: {"avx512f", "avx512bw"} | flags)
    assert conftest.device_class(torch.device("cpu")) == expected


def test_cpu_family_reads_this_machines_first_processor():
    from benchmarks import conftest

    vendor, family = conftest.cpu_family()
    with open("/proc/cpuinfo") as cpuinfo:
        text = cpuinfo.read()
    assert f"vendor_id\t: {vendor}" in text and f"cpu family\t: {family}" in text


def test_cpu_flags_read_this_machines_first_processor():
    from benchmarks import conftest

    with open("/proc/cpuinfo") as cpuinfo:
        first = next(line for line in cpuinfo if line.startswith("flags"))
    assert conftest.cpu_flags() == set(first.partition(":")[2].split())
