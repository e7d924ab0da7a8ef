#!/usr/bin/env python3
"""Print the wheels in a folder whose distributions this Python does not have installed.

    python3 scripts/missing_wheels.py .whl

scripts/gpu_check.sh installs only these from the wheels carried to the GPU machine, so that
the image's own copy of anything (numpy, packaging, ...) is never shadowed. A wheel's
distribution name is the first field of its file name (PEP 427), compared as
``importlib.metadata`` normalizes names (``python_dateutil`` finds ``python-dateutil``).
"""

from __future__ import annotations

import importlib.metadata as md
import pathlib
import sys


def missing(folder: str) -> list[pathlib.Path]:
    out = []
    for wheel in sorted(pathlib.Path(folder).glob("*.whl")):
        try:
            md.version(wheel.name.split("-")[0])
        except md.PackageNotFoundError:
            out.append(wheel)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2 or not pathlib.Path(sys.argv[1]).is_dir():
        sys.exit("usage: missing_wheels.py FOLDER (a folder of .whl files)")
    for w in missing(sys.argv[1]):
        print(w)
