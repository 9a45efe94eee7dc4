"""Which shared libraries an ELF file asks the loader for (its DT_NEEDED entries), read from the file
itself (no readelf needed), and the check gpu-build applies to pykernels' extension with it.

Why: a toolchain that ships only libstdc++.a (the CUDA images' CXX=/opt/gcc/bin/g++) links it into
_C silently; that second C++ runtime beside torch's shared one segfaults as soon as an error message
formats a number (pytorch#109923). CMakeLists.txt links torch's libstdc++.so.6 to prevent it; this
catches any build where that did not take.
"""

from __future__ import annotations

import struct
from pathlib import Path

SHT_DYNAMIC = 6
DT_NULL, DT_NEEDED = 0, 1


def needed_libraries(path: Path) -> list[str]:
    """The DT_NEEDED names of a 64-bit little-endian ELF shared object, in order."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    section_offset, = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQII", data, section_offset + i * entry_size) for i in range(count)]
    names = []
    for _, kind, _, _, offset, size, link, _ in sections:
        if kind != SHT_DYNAMIC:
            continue
        strings_offset = sections[link][4]
        for tag, value in struct.iter_unpack("<qQ", data[offset:offset + size]):
            if tag == DT_NULL:
                break
            if tag == DT_NEEDED:
                start = strings_offset + value
                names.append(data[start:data.index(b"\0", start)].decode())
    return names


def static_libstdcxx_problem(extension: Path) -> str | None:
    """A message when the extension does not load the shared libstdc++ (it carries its own), else None."""
    needed = needed_libraries(extension)
    if any(name.startswith("libstdc++.so") for name in needed):
        return None
    return (f"{extension.name} does not load libstdc++.so (it needs only {', '.join(needed)}): the compiler "
            "linked libstdc++ statically, which crashes beside torch's shared one on the first error message "
            "(pytorch#109923). Build with a compiler that has libstdc++.so (e.g. CXX=/usr/bin/g++)")
