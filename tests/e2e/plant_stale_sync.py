"""Run the driver with an engine that stops applying adapter syncs from version STALE_FROM on (default
1): it keeps serving the last adapter it really loaded while claiming the new version. The sync
verification must catch it: `STALE_FROM=4 python tests/e2e/plant_stale_sync.py cfg.yaml --key=value ...`."""

import os
import sys

from driver.engine.colocate import ColocatedGenerator

STALE_FROM = int(os.environ.get("STALE_FROM", "1"))
_real_sync = ColocatedGenerator.sync


def stale_sync(self, adapter_dir, version):
    if version < STALE_FROM:
        _real_sync(self, adapter_dir, version)
    else:  # claims the new version, serves the last one it loaded under that version's name
        self._loras[version] = self._lora
        self.adapter_version = version


if __name__ == "__main__":
    ColocatedGenerator.sync = stale_sync
    from driver.train import main

    sys.exit(main(sys.argv[1:]))
