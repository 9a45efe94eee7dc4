"""make gpu-build: builds pykernels' extension against the image's torch (>= 2.9 with CUDA),
without build isolation, for the architectures of the GPUs present and with every core, then prints
pykernels.build_info() and fails when CUDA is off, a kernel family has no CUDA kernel registered, or
the extension carries its own static libstdc++ (linkage.py).

The CUDA kernels' objects come from wheelhouse/kernels/ when `make gpu-kernels` compiled them from
these sources for this GPU's archs and this nvcc release (kernels.py): only the torch-facing
files compile here then. Otherwise, or when that build or its checks fail, the kernels compile here.

    python .ci/gpu/build.py [--dry-run] [--wheelhouse wheelhouse]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import kernels
import linkage
import stage

FAMILY_OPS = {  # op name prefixes of each family in the pykernels:: namespace (csrc/torch_bindings.cpp)
    "nf4": ("nf4_", "dynamic8_"),
    "lora": ("lora_",),
    "logprobs": ("token_logprobs",),
    "moe": ("moe_",),
}
INFO_SCRIPT = """
import json, torch, pykernels
from pykernels import _extension
names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("pykernels::"))
cuda = {n: torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA") for n in names}
print(json.dumps({"build_info": pykernels.build_info(), "cuda_ops": cuda}))
"""


def arch_of(capability: tuple[int, int]) -> str:
    """PYKERNELS_CUDA_ARCHS entry for a compute capability: Hopper gets the arch-specific sm_90a
    (wgmma, TMA), Ampere and Ada their own sm_8x; others have no kernels here."""
    major, minor = capability
    if major == 9:
        return f"{major}{minor}a"
    if major == 8:
        return f"{major}{minor}"
    raise stage.StageError(f"no kernels for compute capability {major}.{minor}: pykernels builds sm_80-sm_89 "
                           "and sm_90a (set PYKERNELS_CUDA_ARCHS to override)")


def gpu_archs() -> str:
    import torch

    if not torch.cuda.is_available():
        raise stage.StageError("torch sees no CUDA device (nvidia-smi?)")
    archs = {arch_of(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())}
    return ";".join(sorted(archs))


def check_families(info: dict) -> list[str]:
    """The problems that fail the stage: CUDA off, a family with no CUDA kernel, or sm_90a among the
    archs without the Hopper GEMM core (cmake/sm90_sources.cmake)."""
    build_info = info["build_info"]
    problems = [] if build_info["cuda"] else ["build_info()['cuda'] is False: no CUDA kernels were built"]
    if "90a" in build_info["cuda_archs"] and not build_info.get("hopper_gemm"):
        problems.append("built for sm_90a without the Hopper GEMM core (build_info()['hopper_gemm'] is False)")
    for family, prefixes in FAMILY_OPS.items():
        ops = [name for name in info["cuda_ops"] if name.split("::")[1].startswith(prefixes)]
        if not ops:
            problems.append(f"{family}: no op registered (expected names starting with {', '.join(prefixes)})")
        elif not any(info["cuda_ops"][name] for name in ops):
            problems.append(f"{family}: none of {', '.join(ops)} has a CUDA kernel")
    return problems


def extension_problems(info: dict, package: Path) -> list[str]:
    """check_families' problems, and each _C of package that carries its own static libstdc++."""
    problems = check_families(info)
    for extension in sorted(package.glob("_C*.so")):
        if (problem := linkage.static_libstdcxx_problem(extension)) is not None:
            problems.append(problem)
    return problems


def body(args, started: float) -> int:
    print(stage.check_cuda_torch(args.dry_run))
    if "PYKERNELS_CUDA_ARCHS" in os.environ:
        archs = os.environ["PYKERNELS_CUDA_ARCHS"]
    elif args.dry_run:  # the bundle's archs stand in for the GPU's: the dry run checks the bundle's sources
        archs = kernels.DEFAULT_ARCHS
        print(f"note: archs {archs} stand in for torch.cuda.get_device_capability's")
    else:
        archs = gpu_archs()
    env = {"PYKERNELS_CUDA_ARCHS": archs, "MAX_JOBS": str(os.cpu_count() or 1)}
    objects, how = kernels.prepare(args.wheelhouse, archs, stage.BUILD_DIR / "prebuilt-kernels", args.dry_run)
    print(how)
    if objects is not None:
        try:
            return build_and_check(args, started, {**env, "PYKERNELS_PREBUILT_KERNELS": str(objects)})
        except stage.StageError as error:  # another image's libraries, say: the kernels' sources still build
            print(f"gpu-build: with the prebuilt kernels: {error}; compiling the kernels here instead", flush=True)
    return build_and_check(args, started, env)


def build_and_check(args, started: float, env: dict[str, str]) -> int:
    """The editable build under env, then the extension's import, ops and linkage checks."""
    build = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", "-e", "."]
    result = stage.run(build, dry_run=args.dry_run, timeout_s=stage.remaining(started), env=env)
    if result is not None and result.returncode != 0:
        raise stage.StageError("the build failed (output above)")
    info_command = [sys.executable, "-c", INFO_SCRIPT]
    if args.dry_run:  # the same check against this machine's build: catches a broken script or op table
        print("would run: " + stage.show([sys.executable, "-c", "<build_info and CUDA ops>"]))
    result = stage.run(info_command, dry_run=False, timeout_s=stage.remaining(started), capture=True)
    if result.returncode != 0:
        raise stage.StageError("pykernels does not import after the build (output above)")
    info = json.loads(result.stdout.strip().splitlines()[-1])
    print("build_info:", info["build_info"])
    missing = sorted(name for name, has in info["cuda_ops"].items() if not has)
    if missing:
        print("ops without a CUDA kernel: " + ", ".join(missing))
    problems = extension_problems(info, stage.ROOT / "pykernels")
    if problems and not args.dry_run:
        raise stage.StageError("; ".join(problems))
    for problem in problems:
        print(f"note: {problem} (fails the real run)")
    return 0


def options(parser) -> None:
    parser.add_argument("--wheelhouse", type=Path, default=stage.ROOT / "wheelhouse",
                        help="where `make gpu-kernels` put the prebuilt kernels (kernels/)")


if __name__ == "__main__":
    args = stage.parse_args(__doc__, extra=options)
    sys.exit(stage.main("gpu-build", body, args))
