"""Builds pykernels._C with CMake + Ninja (the vLLM pattern).

CMake finds torch through the interpreter running this script, so build with
`pip install --no-build-isolation -e .` once torch is installed (see the Makefile).
Environment knobs:
  PYKERNELS_CUDA_ARCHS   CUDA archs to compile when torch has CUDA (default "80;90a")
  PYKERNELS_BUILD_TYPE   CMake build type (default Release)
  MAX_JOBS               parallel compile jobs (default: CPU count)
  CUTLASS_DIR            CUTLASS include dir (default: the nvidia-cutlass wheel's headers)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


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


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        output_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
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
        if "CUTLASS_DIR" in os.environ:
            configure.append(f"-DCUTLASS_DIR={os.environ['CUTLASS_DIR']}")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(configure, cwd=build_dir, check=True)
        subprocess.run(
            [cmake, "--build", ".", "--target", "_C", "-j", jobs], cwd=build_dir, check=True
        )


setup(
    ext_modules=[CMakeExtension("pykernels._C")],
    cmdclass={"build_ext": CMakeBuild},
)
