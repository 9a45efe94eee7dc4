"""make gpu-link-check: the CUDA extension as a lent node builds it, built and loaded here, without a GPU,
before a lease spends minutes finding out. Against the image's torch (a CUDA build from PyPI, in its
own venv under build/, set up once), CMake builds pykernels._C for the bundle's archs, linking the
prebuilt kernels of `make gpu-kernels` (wheelhouse/kernels/), then a python with that torch imports it
and checks what gpu-build checks: CUDA on, the Hopper GEMM core in, a CUDA kernel for every family,
torch's libstdc++ shared. Catches what the compile check cannot: symbols the bindings call that no
kernel object defines, CMake's CUDA path, a module that does not load.

    python .ci/gpu/link_check.py [--dry-run] [--archs 90a]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import build as build_stage
import kernels
import stage

# The lent images' torch (/work/.library/device/KINDS.md: 2.11.0+cu130); PyPI's wheel is that build.
IMAGE_TORCH = "torch==2.11.0"


def build_requirements() -> list[str]:
    """pyproject's build requirements (CMake, Ninja, pybind11, CUTLASS's headers, ...) but its torch."""
    requires = tomllib.loads((stage.ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    return [req for req in requires if not req.startswith("torch")]


VENV = stage.BUILD_DIR / "cuda-torch-venv"
BUILD = stage.BUILD_DIR / "cuda-link-check"
SETUP_TIMEOUT_S = 1800


def venv_python(dry_run: bool) -> Path:
    """build/cuda-torch-venv's python, with the image's torch and the build tools (made once)."""
    python = VENV / "bin" / "python"
    stamp = VENV / f".installed-{IMAGE_TORCH}"
    if stamp.exists():
        print(f"{VENV}: {IMAGE_TORCH} and the build tools, set up")
        return python
    for command in ([sys.executable, "-m", "venv", "--clear", str(VENV)],
                    [str(python), "-m", "pip", "install", "--quiet", IMAGE_TORCH, *build_requirements()]):
        result = stage.run(command, dry_run=dry_run, timeout_s=SETUP_TIMEOUT_S)
        if result is not None and result.returncode != 0:
            raise stage.StageError(f"could not set up {VENV} (output above)")
    if not dry_run:
        stamp.touch()
    return python


def cuda_environment(python: Path) -> tuple[dict[str, str], list[str]]:
    """(environment, extra CMake arguments) for torch's CMake config to find the toolkit: its bin first on
    PATH (FindCUDA takes the toolkit's root from where nvcc is) and CUDA_HOME, and torch's own NVRTC
    (its nvidia-* wheels) where the toolkit has none (this machine's: no NVRTC, no cuBLAS)."""
    toolkit = kernels.cuda_toolkit()
    if toolkit is None:
        raise stage.StageError("no CUDA toolkit here (nvcc, include/cuda_runtime.h): the extension cannot be built")
    env = {"PATH": f"{toolkit / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", "CUDA_HOME": str(toolkit)}
    if any(toolkit.glob("lib64/libnvrtc.so*")) or any(toolkit.glob("targets/*/lib/libnvrtc.so*")):
        return env, []
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    nvrtc = sorted(Path(site).glob("nvidia/*/lib/libnvrtc.so*"))
    return env, [f"-DCUDA_nvrtc_LIBRARY={nvrtc[0]}"] if nvrtc else []


def body(args, started: float) -> int:
    python = venv_python(args.dry_run)
    objects, how = kernels.prepare(args.wheelhouse, args.archs, BUILD / "prebuilt-kernels", args.dry_run)
    print(how)
    if objects is None:
        message = "run `make gpu-kernels` first: this check links its objects"
        if not args.dry_run:
            raise stage.StageError(message)
        print(f"note: {message} (the real run stops here)")
        objects = BUILD / "prebuilt-kernels"
    if args.dry_run:
        env, extra = {}, []
    else:
        env, extra = cuda_environment(python)
    build_dir, out_dir = BUILD / "cmake", BUILD / "package"
    cmake, ninja = kernels.tools_beside(python)
    configure = [cmake, "-S", str(stage.ROOT), "-B", str(build_dir), "-G", "Ninja",
                 f"-DCMAKE_MAKE_PROGRAM={ninja}", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython_EXECUTABLE={python}", f"-DPYKERNELS_OUTPUT_DIR={out_dir / 'pykernels'}",
                 f"-DPYKERNELS_CUDA_ARCHS={args.archs}", f"-DPYKERNELS_PREBUILT_KERNELS={objects}", *extra]
    compile_ = [cmake, "--build", str(build_dir), "--target", "_C", "--parallel", str(os.cpu_count() or 1)]
    for command in (configure, compile_):
        result = stage.run(command, dry_run=args.dry_run, timeout_s=SETUP_TIMEOUT_S, env=env)
        if result is not None and result.returncode != 0:
            raise stage.StageError("the CUDA extension did not build (output above)")
    if args.dry_run:
        print(f"would import pykernels from {out_dir} with {python} and check it as gpu-build does")
        return 0
    # The package's python files beside the new _C (the source tree's own _C is this machine's CPU build).
    package = out_dir / "pykernels"
    for stale in package.rglob("*.py"):  # a module deleted since the last check must not import
        stale.unlink()
    for source in (stage.ROOT / "pykernels").rglob("*.py"):
        target = package / source.relative_to(stage.ROOT / "pykernels")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    with tempfile.TemporaryDirectory() as scratch:  # not the source tree: its pykernels would shadow this one
        result = subprocess.run([str(python), "-c", build_stage.INFO_SCRIPT], cwd=scratch, capture_output=True,
                                text=True, env={**os.environ, "PYTHONPATH": str(out_dir)}, timeout=600)
    if result.returncode != 0:
        raise stage.StageError(f"the CUDA extension does not load:\n{result.stderr[-3000:]}")
    info = json.loads(result.stdout.strip().splitlines()[-1])
    print("build_info:", info["build_info"])
    problems = build_stage.extension_problems(info, package)
    if problems:
        raise stage.StageError("; ".join(problems))
    print(f"{sum(info['cuda_ops'].values())} of {len(info['cuda_ops'])} ops have a CUDA kernel")
    return 0


def options(parser) -> None:
    parser.add_argument("--archs", default=kernels.DEFAULT_ARCHS, help="the bundle's PYKERNELS_CUDA_ARCHS")
    parser.add_argument("--wheelhouse", type=Path, default=stage.ROOT / "wheelhouse")


if __name__ == "__main__":
    args = stage.parse_args(__doc__, extra=options)
    sys.exit(stage.main("gpu-link-check", body, args, budget_s=None))
