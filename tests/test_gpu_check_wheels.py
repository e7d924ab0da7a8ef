"""The wheels scripts/gpu_check.sh installs on the GPU machine: only those whose distribution
this Python lacks (scripts/missing_wheels.py), so the image's own packages are never shadowed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "missing_wheels.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_only_the_distributions_not_installed(tmp_path):
    names = ["numpy-2.5.2-cp312-cp312-manylinux_2_28_x86_64.whl",   # installed here
             "ml_dtypes-0.7.0-cp312-cp312-manylinux_2_28_x86_64.whl",  # installed ('_' vs '-')
             "cugrouped_no_such_dist-1.0-py3-none-any.whl",           # not installed
             "Zz_Not_Installed_Either-2.0-py2.py3-none-any.whl",
             "README.txt"]                                             # not a wheel
    for n in names:
        (tmp_path / n).write_bytes(b"")
    res = _run(str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert [Path(p).name for p in res.stdout.split()] == [
        "Zz_Not_Installed_Either-2.0-py2.py3-none-any.whl",
        "cugrouped_no_such_dist-1.0-py3-none-any.whl"]


def test_a_folder_of_installed_wheels_prints_nothing(tmp_path):
    (tmp_path / "numpy-1.0-py3-none-any.whl").write_bytes(b"")
    res = _run(str(tmp_path))
    assert res.returncode == 0 and res.stdout == ""


def test_refuses_what_is_not_a_folder(tmp_path):
    res = _run(str(tmp_path / "nope"))
    assert res.returncode != 0 and "usage: missing_wheels.py FOLDER" in res.stderr
