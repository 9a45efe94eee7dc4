"""Builds pykernels._C with CMake + Ninja (the vLLM pattern).

CMake finds torch through the interpreter running this script, so build with
`pip install --no-build-isolation -e .` once torch is installed (see the Makefile).
Environment knobs:
  PYKERNELS_CUDA_ARCHS   CUDA archs to compile when torch has CUDA (default "80;90a")
  PYKERNELS_BUILD_TYPE   CMake build type (default Release)
  MAX_JOBS               parallel compile jobs (default: CPU count)
  CUTLASS_DIR            CUTLASS include dir (default: the nvidia-cutlass wheel's headers)
  PYKERNELS_PREBUILT_KERNELS  a directory of prebuilt kernel objects to link (.ci/gpu/kernels.py)
The wheel also carries pykernels-startup.pth (see pykernels/startup_hook.py).
"""

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()
TORCH_MARKER = "torch-location.txt"  # in each build directory: the torch its CMake cache points at


def build_tool(name: str) -> str:
    """cmake / ninja from the building interpreter's environment first (pip installs them there;
    the system's may be too old), then PATH."""
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: `pip install {name}` into the build environment")
    return found


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def torch_build_dir(build_temp: Path, ext_name: str) -> Path:
    """One CMake build directory per torch installation: the cache records the paths of torch's
    libraries, and an isolated `pip install .` builds against a temporary torch that pip deletes
    afterwards, so a second install reusing the directory would link against files that are gone.
    Directories whose torch has disappeared are removed."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise RuntimeError("torch is not installed in the build environment: install torch first, then "
                           "`pip install --no-build-isolation -e .` (see the README)")
    torch_dir = str(Path(spec.origin).parent.resolve())
    version = importlib.metadata.version("torch")
    key = hashlib.sha1(f"{torch_dir}|{version}|{sys.executable}".encode()).hexdigest()[:10]
    build_dir = build_temp / f"{ext_name}-torch{version}-{key}"
    for sibling in build_temp.glob(f"{ext_name}*"):
        marker = sibling / TORCH_MARKER
        if sibling != build_dir and (not marker.exists() or not Path(marker.read_text()).exists()):
            shutil.rmtree(sibling, ignore_errors=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / TORCH_MARKER).write_text(torch_dir)
    return build_dir


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        output_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = torch_build_dir(Path(self.build_temp).resolve(), ext.name)
        cmake = build_tool("cmake")
        configure = [
            cmake,
            str(ROOT),
            "-G",
            "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={build_tool('ninja')}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('PYKERNELS_BUILD_TYPE', 'Release')}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DPYKERNELS_OUTPUT_DIR={output_dir}",
        ]
        if "PYKERNELS_CUDA_ARCHS" in os.environ:
            configure.append(f"-DPYKERNELS_CUDA_ARCHS={os.environ['PYKERNELS_CUDA_ARCHS']}")
        # Always passed: an empty value clears a cached one (a GPU node's fallback build, .ci/gpu/build.py).
        configure.append(f"-DPYKERNELS_PREBUILT_KERNELS={os.environ.get('PYKERNELS_PREBUILT_KERNELS', '')}")
        if "CUTLASS_DIR" in os.environ:
            configure.append(f"-DCUTLASS_DIR={os.environ['CUTLASS_DIR']}")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(configure, cwd=build_dir, check=True)
        subprocess.run(
            [cmake, "--build", ".", "--target", "_C", "-j", jobs], cwd=build_dir, check=True
        )


class BuildPyWithStartupHook(build_py):
    """Adds pykernels-startup.pth at the wheel's top level (site-packages; pykernels/startup_hook.py).
    Editable installs drop such files: `python -m pykernels.startup_hook --install` writes it there."""

    def run(self) -> None:
        super().run()
        sys.path.insert(0, str(ROOT))  # the source tree's pykernels: its __init__ needs no extension
        try:
            from pykernels.startup_hook import install_pth
        finally:
            sys.path.pop(0)
        os.makedirs(self.build_lib, exist_ok=True)
        install_pth(self.build_lib)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, "pykernels-startup.pth")]


setup(
    ext_modules=[CMakeExtension("pykernels._C")],
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPyWithStartupHook},
)
