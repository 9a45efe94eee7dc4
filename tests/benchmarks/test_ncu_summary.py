"""benchmarks/ncu_summary.py on a CSV laid out as `ncu --csv --page details` writes it (ncu runs only on
the GPU machine; the columns and metric names below are ncu's)."""

import csv
import io

import pytest

from benchmarks import ncu_summary

COLUMNS = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
           "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]
STATS = ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>, "
         "Mainloop<KernelTmaWarpSpecializedCooperative>, Epilogue<Sm90SoftmaxPartials<Shape<256>>>>>(Params)")
CUBLAS = "nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT"


def details(rows) -> list[str]:
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(COLUMNS)
    for kernel_id, name, section, metric, unit, value in rows:
        writer.writerow([kernel_id, "1", "python3", "host", name, "1", "7", "(384, 1, 1)", "(132, 1, 1)", "0",
                         "9.0", section, metric, unit, value])
    return ["==PROF== Connected to process 1", "the program's own line"] + out.getvalue().splitlines()


def test_one_line_per_kernel_with_its_metrics_in_the_columns_units():
    lines = ncu_summary.summarize(details([
        (0, STATS, "GPU Speed Of Light Throughput", "Duration", "usecond", "1,234.5"),
        (0, STATS, "GPU Speed Of Light Throughput", "Compute (SM) Throughput", "%", "71.26"),
        (0, STATS, "Launch Statistics", "Registers Per Thread", "register/thread", "168"),
        (0, STATS, "Warp State Statistics", "Warp Cycles Per Issued Instruction", "cycle", "9.87"),
        (1, CUBLAS, "GPU Speed Of Light Throughput", "Duration", "msecond", "1.36"),
        (1, CUBLAS, "Occupancy", "Achieved Occupancy", "%", "12.4"),
    ]))
    assert lines[0].startswith("| kernel | ms | SM % |") and len(lines) == 4
    stats, cublas = lines[2], lines[3]
    assert stats.startswith("| cutlass::device_kernel [GemmUniversal] [Sm90SoftmaxPartials] [Cooperative] |")
    assert "| 1.234 | 71.3 | - | - | 168 | - | 9.9 |" in stats
    assert cublas == f"| {CUBLAS} | 1.360 | - | - | - | - | 12.4 | - |"


def test_input_without_ncus_csv_is_refused_by_name():
    with pytest.raises(SystemExit, match="no ncu CSV in the input"):
        ncu_summary.summarize(["==PROF== Connected", "==ERROR== the profiler could not start"])


def test_the_targets_name_their_ops_and_need_a_gpu(monkeypatch):
    from benchmarks import ncu_targets

    with pytest.raises(SystemExit, match="unknown op mlp: logprobs, lora_forward"):
        ncu_targets.main(["--ops", "logprobs,mlp"])
    monkeypatch.setattr(ncu_targets.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        ncu_targets.main(["--ops", "logprobs"])
