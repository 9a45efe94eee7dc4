"""Reads back what an offline wandb run logged, for tests: the run's .wandb file is a LevelDB-style log
(a 7-byte ":W&B" header, then 32 KiB blocks of records, each with a 7-byte header: crc32, length,
type FULL/FIRST/MIDDLE/LAST) of protobuf Records. wandb 0.2x+ reads it only in its Go core, so the
format is read here directly (checksums not verified)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
FILE_HEADER = struct.Struct("<4sHB")
RECORD_HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, _magic, _version = FILE_HEADER.unpack_from(data)
    if ident != b":W&B":
        raise ValueError(f"{path} is not a wandb run file")
    position, pieces = FILE_HEADER.size, []
    while position + RECORD_HEADER.size <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < RECORD_HEADER.size:  # the block's tail is padding
            position += left_in_block
            continue
        _crc, length, kind = RECORD_HEADER.unpack_from(data, position)
        position += RECORD_HEADER.size
        pieces.append(data[position:position + length])
        position += length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def history(path: Path) -> list[dict]:
    """Every logged step as {key: value} (values JSON-decoded; tables appear as their metadata dict)."""
    steps = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            steps.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                          for item in record.history.item})
    return steps
