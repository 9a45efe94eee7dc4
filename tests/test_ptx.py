"""What the sm_90a kernels compile to, checked in PTX without a GPU (`nvcc -ptx`): the instructions a
kernel's design relies on must be there, or the design silently fell back (e.g. a 16-byte load the
compiler could not prove aligned becomes sixteen 1-byte loads and the kernel loses half its
bandwidth). Skipped where nvcc is missing; CI has it."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")


def kernels_ptx(source: str, tmp_path: Path, arch: str = "90a") -> dict[str, str]:
    """Each kernel's PTX in `source` (relative to csrc/), by mangled name."""
    out = tmp_path / "out.ptx"
    subprocess.run([NVCC, "-ptx", "-std=c++17", f"-I{ROOT / 'csrc'}",
                    f"-gencode=arch=compute_{arch},code=compute_{arch}", str(ROOT / "csrc" / source), "-o", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    ptx = out.read_text()
    entries = list(re.finditer(r"^\.(?:visible )?\.?entry (\w+)\(", ptx, re.M))
    assert entries, f"no kernel in {source}'s PTX"
    return {entry.group(1): ptx[entry.start():(entries[i + 1].start() if i + 1 < len(entries) else len(ptx))]
            for i, entry in enumerate(entries)}


def test_nf4_dequantize_moves_16_bytes_per_load_and_store(tmp_path):
    kernels = {name: ptx for name, ptx in kernels_ptx("nf4/nf4.cu", tmp_path).items() if "dequantize_kernel" in name
               and "dynamic8" not in name}
    assert len(kernels) == 3, list(kernels)  # fp32, fp16, bf16 outputs
    for name, ptx in kernels.items():
        loads = re.findall(r"ld\.global\.nc\.v4\.[bu]32", ptx)
        stores = re.findall(r"st\.global\.v4\.(?:[bu]32|f32)", ptx)
        assert len(loads) >= 2, f"{name}: {len(loads)} 16-byte loads of packed codes (2 chunks in flight)"
        assert len(stores) >= 8, f"{name}: {len(stores)} 16-byte stores (>= 4 per 32-value chunk)"
        assert not re.search(r"ld\.global\.nc\.v2\.u32", ptx), f"{name}: 8-byte loads of packed codes"
