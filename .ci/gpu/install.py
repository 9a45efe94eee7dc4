"""make gpu-install (first half; the Makefile then runs gpu-build): installs the packages of
wheelhouse/ (made by `make gpu-wheels` on a machine with a package index) into the image's python,
without an index. Packages the image already has in a fitting version are left as they are.

    python .ci/gpu/install.py [--dry-run] [--wheelhouse wheelhouse]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import stage
import wheels


def body(args, started: float) -> int:
    print(stage.check_cuda_torch(args.dry_run))
    bundle, _ = wheels.requirements()
    manifest_path = args.wheelhouse / "MANIFEST.json"
    if manifest_path.is_file():
        present = {wheel["name"] for wheel in json.loads(manifest_path.read_text())["wheels"]}
        absent = [req for req in bundle if wheels.requirement_name(req) not in present]
        if absent:
            print("not in the wheelhouse (left out or on the image): " + " ".join(absent))
        bundle = [req for req in bundle if req not in absent]
    else:
        message = (f"no {manifest_path}: run `make gpu-wheels` on a machine with a package index "
                   "and copy wheelhouse/ along with the repository")
        if not args.dry_run:
            raise stage.StageError(message)
        print(f"note: {message} (the real run stops here)")
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(args.wheelhouse)]
    headers_only = [req for req in bundle if wheels.requirement_name(req) in wheels.HEADERS_ONLY]
    rest = [req for req in bundle if req not in headers_only]
    commands = [[*pip, "--no-deps", *headers_only]] if headers_only else []  # headers only: no scipy & co.
    commands += [[*pip, *rest]] if rest else []
    for command in commands:
        result = stage.run(command, dry_run=args.dry_run, timeout_s=stage.remaining(started))
        if result is not None and result.returncode != 0:
            raise stage.StageError(f"pip could not install from {args.wheelhouse} (output above)")
    if shutil.which("cmake") is None and not args.dry_run:  # gpu-wheels leaves CMake out when over budget
        raise stage.StageError("no cmake on this node and none in the wheelhouse: on the connected machine run "
                               "`make gpu-wheels GPU_WHEELS_ARGS='--without bitsandbytes'` (keeps cmake in budget)")
    return 0


def options(parser) -> None:
    parser.add_argument("--wheelhouse", type=Path, default=stage.ROOT / "wheelhouse")


if __name__ == "__main__":
    args = stage.parse_args(__doc__, extra=options)
    sys.exit(stage.main("gpu-install", body, args))
