"""Run the driver with an engine that ignores adapter syncs (keeps serving the first adapter).
The sync verification must catch it: `python tests/e2e/plant_stale_sync.py cfg.yaml --key=value ...`."""

import sys

from driver.rollout.colocate import ColocatedGenerator

_real_sync = ColocatedGenerator.sync


def stale_sync(self, adapter_dir, version):
    if version == 0:
        _real_sync(self, adapter_dir, version)
    else:
        self.adapter_version = version  # claims the new version, serves the old one


if __name__ == "__main__":
    ColocatedGenerator.sync = stale_sync
    from driver.train import main

    sys.exit(main(sys.argv[1:]))
