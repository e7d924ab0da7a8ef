"""The notebooks, run top to bottom (a cell that raises fails the test), with every figure they
draw saved as a PNG for a person to look at: ``build/notebook-figures/`` (or
``$CUGROUPED_FIGURES_DIR``), one file per image output, named ``<notebook>-<cell>-<n>.png``.
GPU-only cells print why they skip on a machine without one."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def figures_dir() -> Path:
    d = Path(os.environ.get("CUGROUPED_FIGURES_DIR", ROOT / "build" / "notebook-figures"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_its_figures_render(path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=900,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()                       # raises CellExecutionError on the first failing cell
    out = figures_dir()
    for old in out.glob(f"{path.stem}-*.png"):
        old.unlink()
    saved = []
    for c, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []):
            assert o.get("output_type") != "error", f"cell {c}: {o.get('ename')}"
            png = o.get("data", {}).get("image/png")
            if png:
                raw = base64.b64decode(png)
                assert raw.startswith(PNG_MAGIC) and len(raw) > 2000, f"cell {c}: not a PNG"
                f = out / f"{path.stem}-{c:02d}-{len(saved)}.png"
                f.write_bytes(raw)
                saved.append(f)
    assert saved, f"{path.name} drew no figure"
    print(f"{path.name}: {len(saved)} figure(s) in {out}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_valid_nbformat(path):
    """Every cell has its id (nbformat 4.5; nbformat warns today and will refuse later)."""
    import json

    raw = json.loads(path.read_text())      # as stored (nbformat.read would fill missing ids in)
    assert (raw["nbformat"], raw["nbformat_minor"]) >= (4, 5)
    missing = [i for i, c in enumerate(raw["cells"]) if "id" not in c]
    assert not missing, f"cells without an id: {missing}"
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.reads(path.read_text(), as_version=4))
