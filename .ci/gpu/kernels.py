"""make gpu-kernels: the CUDA kernels' object files, compiled here for a GPU node's archs (default 90a:
H100 and H200) exactly as its build would compile them, packed with what they were built from into
wheelhouse/kernels/kernels-<archs>.tar.xz (carried with the wheels). gpu-build links them instead of
compiling the kernels (they include no torch header, so the node's torch does not matter) when the
bundle matches the node: the files its objects were compiled from (each .cu file and header that
`ninja -t deps` names, cmake/ and CMakeLists.txt; a binding or CPU file may change), the set of .cu
files, the archs, nvcc's release and CUTLASS's version; otherwise, or when that build fails, it compiles
them there as before.

Why: the kernels are most of a node's build, whose critical path is one file (the 128x256 Hopper GEMM
tile: 189 s on one core here; the 2026-11-27 lease's whole build took 184 s), out of a 15-minute lease.

    python .ci/gpu/kernels.py [--dry-run] [--archs 90a] [--dest wheelhouse]
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import stage

BUNDLE_DIR = "kernels"  # under the wheelhouse: pip's --find-links does not look into subdirectories
MANIFEST = "manifest.json"
OBJECT_LIST = "kernel_objects.txt"  # the list CMakeLists.txt's PYKERNELS_PREBUILT_KERNELS reads
BUILD_TIMEOUT_S = 3600  # ~10 minutes of compiling on 2 cores
DEFAULT_ARCHS = "90a"  # H100 and H200: the GPUs we are lent


def kernel_sources(root: Path = stage.ROOT) -> list[str]:
    """The kernels' .cu files (CMakeLists.txt globs csrc/*/*.cu), relative to root."""
    return sorted(path.relative_to(root).as_posix() for path in root.glob("csrc/*/*.cu"))


def build_files(root: Path = stage.ROOT) -> list[str]:
    """What decides the objects' flags: CMakeLists.txt and cmake/."""
    cmake = sorted(path.relative_to(root).as_posix() for path in (root / "cmake").rglob("*") if path.is_file())
    return ["CMakeLists.txt", *cmake]


def file_hashes(paths: list[str], root: Path = stage.ROOT) -> dict[str, str | None]:
    """sha256 of each file (None where it is missing), by path relative to root."""
    return {path: hashlib.sha256((root / path).read_bytes()).hexdigest() if (root / path).is_file() else None
            for path in paths}


def dependencies(ninja_deps: str, root: Path = stage.ROOT) -> list[str]:
    """The files under root's csrc/ that any object was compiled from, from `ninja -t deps` (each source
    and every header it includes, as the compiler's depfiles recorded them): a bundle is stale when one
    of those changed, not when a binding or a CPU kernel did."""
    csrc = (root / "csrc").resolve()
    found = set()
    for line in ninja_deps.splitlines():
        if line.startswith((" ", "\t")) and line.strip():
            path = Path(line.strip()).resolve()
            if path.is_relative_to(csrc):
                found.add(path.relative_to(root.resolve()).as_posix())
    return sorted(found)


def find_nvcc() -> str | None:
    """The nvcc CMake would find: $CUDACXX, then PATH, then /usr/local/cuda."""
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def cuda_toolkit() -> Path | None:
    """The CUDA toolkit's root (bin/nvcc, include/, lib64/): $CUDA_HOME, /usr/local/cuda, or where the nvcc
    found lives (/usr/local/bin/nvcc may be a wrapper script, whose directory is no toolkit)."""
    nvcc = find_nvcc()
    roots = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", Path(nvcc).resolve().parent.parent if nvcc else None]
    for root in (Path(root) for root in roots if root):
        if (root / "bin" / "nvcc").is_file() and (root / "include" / "cuda_runtime.h").is_file():
            return root
    return None


@functools.cache
def nvcc_version() -> str:
    """`nvcc --version`'s output ("" without nvcc), asked once a process."""
    nvcc = find_nvcc()
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout if nvcc else ""


def nvcc_release() -> str | None:
    """'13.0' from "Cuda compilation tools, release 13.0, V13.0.88", None without nvcc."""
    match = re.search(r"release (\d+\.\d+)", nvcc_version())
    return match.group(1) if match else None


def cutlass_version() -> str | None:
    """The CUTLASS headers' version, found as cmake/dependencies.cmake finds them (CUTLASS_DIR, else the
    nvidia-cutlass wheel), None without them."""
    include = os.environ.get("CUTLASS_DIR")
    if not include:
        try:
            import cutlass_library
        except ImportError:
            return None
        include = str(Path(cutlass_library.__file__).parent / "source" / "include")
    header = Path(include) / "cutlass" / "version.h"
    if not header.is_file():
        return None
    text = header.read_text()
    parts = [re.search(rf"#define CUTLASS_{part} (\d+)", text) for part in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(match.group(1) for match in parts) if all(parts) else None


def build_key(archs: str, files: list[str], root: Path = stage.ROOT) -> dict:
    """What the objects depend on: files (their sources and headers, and the build's files), the kernel
    sources there are, the archs, nvcc's release and CUTLASS's version."""
    return {"archs": archs, "nvcc_release": nvcc_release(), "cutlass": cutlass_version(),
            "kernel_sources": kernel_sources(root), "files": file_hashes(files, root)}


def bundle_path(wheelhouse: Path, archs: str) -> Path:
    return wheelhouse / BUNDLE_DIR / f"kernels-{archs.replace(';', '-')}.tar.xz"


def mismatch(manifest: dict, archs: str, root: Path = stage.ROOT) -> str | None:
    """Why a bundle built under manifest cannot stand for a build of root's sources for archs here, None
    when it can."""
    for field, what, ours in (("archs", "archs", archs), ("nvcc_release", "nvcc release", nvcc_release()),
                              ("cutlass", "CUTLASS version", cutlass_version())):
        if manifest.get(field) != ours:
            return f"built for {what} {manifest.get(field)}, this build has {ours}"
    theirs_sources, ours_sources = set(manifest.get("kernel_sources", [])), set(kernel_sources(root))
    if theirs_sources != ours_sources:
        return f"built from other kernel files: {', '.join(sorted(theirs_sources ^ ours_sources))}"
    theirs = manifest.get("files", {})
    ours = file_hashes(list(theirs), root)
    changed = sorted(path for path in theirs if theirs[path] != ours[path])
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        return f"built from other sources: {shown} differ"
    return None


def read_manifest(bundle: Path) -> dict:
    with tarfile.open(bundle, "r:xz") as tar:
        member = tar.extractfile(MANIFEST)
        if member is None:
            raise stage.StageError(f"{bundle}: no {MANIFEST}")
        return json.loads(member.read())


def prepare(wheelhouse: Path, archs: str, unpack_to: Path, dry_run: bool = False) -> tuple[Path | None, str]:
    """(the directory of a usable bundle's objects, unpacked there, or in a dry run where they would be;
    None to compile them) and a line saying which and why."""
    bundle = bundle_path(wheelhouse, archs)
    if not bundle.is_file():
        return None, f"kernels: compiling them (no {bundle}: `make gpu-kernels` writes it)"
    try:
        manifest = read_manifest(bundle)
    except (tarfile.TarError, OSError, ValueError, stage.StageError) as error:
        return None, f"kernels: compiling them ({bundle} unreadable: {error})"
    why = mismatch(manifest, archs)
    if why is not None:
        return None, f"kernels: compiling them ({bundle.name} {why})"
    if dry_run:  # where they would be, not unpacked
        return unpack_to, f"kernels: would link the {len(manifest['objects'])} prebuilt objects of {bundle.name}"
    shutil.rmtree(unpack_to, ignore_errors=True)
    unpack_to.mkdir(parents=True)
    with tarfile.open(bundle, "r:xz") as tar:
        tar.extractall(unpack_to, filter="data")
    return unpack_to, f"kernels: linking the {len(manifest['objects'])} prebuilt objects of {bundle.name}"


def tools_beside(python: Path) -> tuple[str, str]:
    """(cmake, ninja) installed beside python (pip puts them there), else PATH's."""
    return tuple(str(python.parent / tool) if (python.parent / tool).exists() else tool for tool in ("cmake", "ninja"))


def dev_python() -> Path:
    """The development venv's python (make's $(TOOLS): torch, CMake, Ninja, CUTLASS), else this one."""
    python = stage.ROOT / ".venv" / "bin" / "python"
    return python if python.exists() else Path(sys.executable)


def configure_command(archs: str, build_dir: Path, python: Path) -> list[str]:
    """CMake's configure of CMakeLists.txt's PYKERNELS_KERNEL_OBJECTS_ONLY build."""
    cmake, ninja = tools_beside(python)
    configure = [cmake, "-S", str(stage.ROOT), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DPYKERNELS_KERNEL_OBJECTS_ONLY=ON", f"-DPYKERNELS_CUDA_ARCHS={archs}",
                 f"-DPython_EXECUTABLE={python}"]
    return configure + ([f"-DCMAKE_MAKE_PROGRAM={ninja}"] if Path(ninja).is_absolute() else [])


def compile_objects(archs: str, build_dir: Path, dry_run: bool) -> list[Path]:
    """The objects of the PYKERNELS_KERNEL_OBJECTS_ONLY build (incremental in build_dir)."""
    python = dev_python()
    build = [tools_beside(python)[0], "--build", str(build_dir), "--parallel", str(os.cpu_count() or 1)]
    for command in (configure_command(archs, build_dir, python), build):
        result = stage.run(command, dry_run=dry_run, timeout_s=BUILD_TIMEOUT_S)
        if result is not None and result.returncode != 0:
            raise stage.StageError("compiling the kernels failed (output above)")
    if dry_run:
        return []
    return [Path(line) for line in (build_dir / OBJECT_LIST).read_text().split()]


def check_links(objects: list[Path], scratch: Path) -> str:
    """Links the objects alone into a throwaway shared library against cudart with no undefined symbol
    left (they must need nothing of the bindings or torch), and says the newest C/C++ runtime symbol
    versions they need (a node's libstdc++ older than those could not load them)."""
    toolkit = cuda_toolkit()
    libs = [toolkit / sub for sub in ("lib64", "targets/x86_64-linux/lib")] if toolkit else []
    lib_dir = next((lib for lib in libs if (lib / "libcudart.so").exists()), None)
    if lib_dir is None:
        return "not link-checked (no CUDA toolkit with libcudart.so found)"
    library = scratch / "kernels_link_check.so"
    link = ["c++", "-shared", "-o", str(library), *map(str, objects), f"-L{lib_dir}", "-lcudart", "-Wl,--no-undefined"]
    result = subprocess.run(link, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise stage.StageError(f"the kernel objects do not link on their own:\n{result.stderr[-3000:]}")
    symbols = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True).stdout
    library.unlink()
    newest = {}
    for name, version in re.findall(r"@(GLIBCXX|CXXABI|GLIBC)_([0-9.]+)", symbols):
        newest[name] = max(newest.get(name, "0"), version, key=lambda v: tuple(map(int, v.split("."))))
    return "link alone against cudart; need " + ", ".join(f"{k}_{v}" for k, v in sorted(newest.items()))


def pack(objects: list[Path], build_dir: Path, key: dict, out: Path) -> int:
    """out: the objects under their paths relative to build_dir, their list and the manifest. Its size."""
    names = [obj.resolve().relative_to(build_dir.resolve()).as_posix() for obj in objects]
    manifest = {**key, "objects": names, "nvcc_version": (nvcc_version().splitlines() or [None])[-1]}
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    with tarfile.open(partial, "w:xz", preset=9) as tar:
        for name, text in ((MANIFEST, json.dumps(manifest, indent=1) + "\n"), (OBJECT_LIST, "\n".join(names) + "\n")):
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
        for obj, name in zip(objects, names):
            tar.add(obj, arcname=name)
    partial.replace(out)
    return out.stat().st_size


def wheels_bytes(wheelhouse: Path) -> int:
    manifest = wheelhouse / "MANIFEST.json"
    return json.loads(manifest.read_text())["total_bytes"] if manifest.is_file() else 0


def body(args, started: float) -> int:
    import wheels  # the bundle shares the wheels' carry budget

    if find_nvcc() is None:
        message = "no nvcc here: the kernels cannot be compiled (gpu-build compiles them on the node)"
        if not args.dry_run:
            raise stage.StageError(message)
        print(f"note: {message}; the real run stops here")
    print(f"kernels for sm_{args.archs}: nvcc {nvcc_release()}, CUTLASS {cutlass_version()}")
    objects = compile_objects(args.archs, args.build_dir, args.dry_run)
    out = bundle_path(args.dest, args.archs)
    if args.dry_run:
        print(f"would pack the objects into {out} with the hashes of the files `ninja -t deps` names")
        return 0
    ninja_deps = subprocess.run([tools_beside(dev_python())[1], "-C", str(args.build_dir), "-t", "deps"],
                                capture_output=True, text=True, check=True, timeout=120).stdout
    files = sorted({*dependencies(ninja_deps), *kernel_sources(), *build_files()})
    key = build_key(args.archs, files)
    print(f"the objects' sources: {len(files)} files (their .cu files and headers, the build's files)")
    print("objects: " + check_links(objects, args.build_dir))
    size = pack(objects, args.build_dir, key, out)
    total = size + wheels_bytes(args.dest)
    if total > wheels.budget_bytes():
        out.unlink()
        raise stage.StageError(f"the wheels and the kernels ({size / 2**20:.1f} MiB) take {total / 2**20:.1f} MiB, "
                               f"over the {wheels.budget_bytes() / 2**20:.0f} MiB budget: no bundle written "
                               "(gpu-build compiles the kernels on the node)")
    print(f"{out}: {len(objects)} objects, {size / 2**20:.1f} MiB; with the wheels {total / 2**20:.1f} MiB "
          f"(budget {wheels.budget_bytes() / 2**20:.0f} MiB)")
    return 0


def options(parser) -> None:
    parser.add_argument("--archs", default=DEFAULT_ARCHS, help="PYKERNELS_CUDA_ARCHS of the GPU node (H100, H200: 90a)")
    parser.add_argument("--dest", type=Path, default=stage.ROOT / "wheelhouse", help="the wheelhouse")
    parser.add_argument("--build-dir", type=Path, default=stage.BUILD_DIR / "gpu-kernels",
                        help="CMake build directory, kept: a second run compiles what changed")


if __name__ == "__main__":
    args = stage.parse_args(__doc__, extra=options)
    sys.exit(stage.main("gpu-kernels", body, args, budget_s=None))
