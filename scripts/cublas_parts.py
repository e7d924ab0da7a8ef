"""Carry a newer libcublasLt to the lent GPU machine in parts, for cuBLASLt's grouped GEMM.

The GPU image has cuBLAS 13.1, which has no grouped GEMM (Hopper FP8 needs 13.5+, design.md
§5), so there every grouped call runs as the per-expert loop. The library alone is ~550 MB
(~360 MB as xz) and the device tool carries 64 MiB a call, the checkout included; ignored files
it carried stay on the machine while it is held. So the library goes in parts, one device call
each, stashed outside the checkout there, then joined and checked against its SHA-256:

here (network):   python scripts/cublas_parts.py make [--version 13.10.0.20] [--part-mib 56]
                  -> .cublas/manifest.json and .cublas/libcublasLt.so.13.xz.NN (ignored by git);
                     prints the device calls to make
each device call: carry [".cublas/manifest.json", ".cublas/libcublasLt.so.13.xz.NN"] and run
                  python3 scripts/cublas_parts.py stash         (checks the part, moves it out)
then:             bash scripts/gpu_grouped_check.sh "$OUT/gg"   (joins the parts, sets
                  CUGROUPED_CUBLASLT to the library, runs the GPU check with it)

``join`` alone (``python3 scripts/cublas_parts.py join``) prints the library's path, or which
parts are missing (exit 1); its messages go to stderr. A second libcublasLt beside the one
torch loaded: the library is linked ``-Bsymbolic`` (DT_SYMBOLIC), and cugrouped loads it with
``RTLD_LOCAL``. Seen on the CPU (2026-12-05): with 13.1.1 loaded ``RTLD_GLOBAL`` first, 13.10
named by CUGROUPED_CUBLASLT reported its own version and passed tests/test_cublaslt.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS_DIR = pathlib.Path(os.environ.get("CUGROUPED_CUBLAS_PARTS", ROOT / ".cublas"))
STASH_DIR = pathlib.Path(os.environ.get("CUGROUPED_CUBLAS_STASH", "/tmp/cugrouped-cublas"))
LIB_NAME = "libcublasLt.so.13"
MEMBER = f"nvidia/cu13/lib/{LIB_NAME}"     # inside the nvidia-cublas wheel
DEFAULT_VERSION = "13.10.0.20"
# the device tool's 64 MiB a call, less the checkout (~6 MiB) and the manifest
DEFAULT_PART_MIB = 56
CHUNK = 1 << 22


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def download_wheel(version: str, dest: pathlib.Path) -> pathlib.Path:
    """The ``nvidia-cublas`` wheel of ``version`` for x86-64 Linux, fetched with pip."""
    platforms = []
    for tag in ("manylinux_2_27", "manylinux_2_28", "manylinux_2_17", "manylinux2014"):
        platforms += ["--platform", f"{tag}_x86_64"]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                    "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", *platforms, "-d", str(dest),
                    f"nvidia-cublas=={version}"], check=True)
    wheels = sorted(dest.glob(f"nvidia_cublas-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"cublas_parts: pip left no nvidia_cublas-{version} wheel in {dest}")
    return wheels[0]


def _compress(src, dst: pathlib.Path) -> None:
    """xz of the file object ``src`` into ``dst``: the xz program on every core where there is
    one (minutes fewer), else Python's lzma; both give one .xz stream that lzma reads."""
    xz = shutil.which("xz")
    with open(dst, "wb") as out:
        if xz:
            proc = subprocess.Popen([xz, "-6", "-T0", "-c"], stdin=subprocess.PIPE, stdout=out)
            shutil.copyfileobj(src, proc.stdin, CHUNK)
            proc.stdin.close()
            if proc.wait():
                raise SystemExit(f"cublas_parts: xz exited with {proc.returncode}")
        else:
            comp = lzma.LZMACompressor(preset=6)
            while block := src.read(CHUNK):
                out.write(comp.compress(block))
            out.write(comp.flush())


def make(lib_source: pathlib.Path, out_dir: pathlib.Path, part_bytes: int, version: str) -> dict:
    """Split ``lib_source`` (a wheel holding :data:`MEMBER`, or the library itself) into xz parts
    of at most ``part_bytes`` in ``out_dir``, with a manifest of every SHA-256."""
    if part_bytes < 1:
        raise ValueError(f"part size: got {part_bytes} bytes, expected at least 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{LIB_NAME}.xz.*"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        lib = pathlib.Path(tmp) / LIB_NAME
        if zipfile.is_zipfile(lib_source):
            with zipfile.ZipFile(lib_source) as whl, whl.open(MEMBER) as src, open(lib, "wb") as dst:
                shutil.copyfileobj(src, dst, CHUNK)
        else:
            shutil.copyfile(lib_source, lib)
        lib_sha, lib_size = _sha256(lib), lib.stat().st_size
        packed = pathlib.Path(tmp) / f"{LIB_NAME}.xz"
        with open(lib, "rb") as src:
            _compress(src, packed)
        parts = []
        with open(packed, "rb") as f:
            index = 0
            while block := f.read(part_bytes):
                name = f"{LIB_NAME}.xz.{index:02d}"
                (out_dir / name).write_bytes(block)
                parts.append({"name": name, "bytes": len(block),
                              "sha256": hashlib.sha256(block).hexdigest()})
                index += 1
    manifest = {"library": LIB_NAME, "version": version, "bytes": lib_size, "sha256": lib_sha,
                "parts": parts}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _manifest(parts_dir: pathlib.Path, stash: pathlib.Path) -> dict:
    for where in (parts_dir, stash):
        path = where / "manifest.json"
        if path.is_file():
            return json.loads(path.read_text())
    raise SystemExit(f"cublas_parts: no manifest.json in {parts_dir} or {stash}")


def stash(parts_dir: pathlib.Path, stash_dir: pathlib.Path) -> tuple[list[str], list[str]]:
    """Move the parts found in ``parts_dir`` whose SHA-256 matches the manifest into
    ``stash_dir`` (a bad part is deleted and named); return (present, missing) part names."""
    manifest = _manifest(parts_dir, stash_dir)
    stash_dir.mkdir(parents=True, exist_ok=True)
    old = stash_dir / "manifest.json"
    if old.is_file() and json.loads(old.read_text())["sha256"] != manifest["sha256"]:
        _clear(stash_dir)          # parts of another library, left on a machine still held
    if (parts_dir / "manifest.json").is_file():
        shutil.copyfile(parts_dir / "manifest.json", stash_dir / "manifest.json")
    present, missing = [], []
    for part in manifest["parts"]:
        src, dst = parts_dir / part["name"], stash_dir / part["name"]
        if src.is_file():
            if _sha256(src) != part["sha256"]:
                src.unlink()
                print(f"cublas_parts: {part['name']} does not match its SHA-256: dropped",
                      file=sys.stderr)
            else:
                shutil.move(str(src), dst)
        if dst.is_file() and dst.stat().st_size == part["bytes"]:
            present.append(part["name"])
        else:
            missing.append(part["name"])
    return present, missing


def _clear(stash_dir: pathlib.Path) -> None:
    """Remove every part, partial join and library from ``stash_dir``."""
    for f in stash_dir.glob(f"{LIB_NAME}*"):
        f.unlink()


def join(parts_dir: pathlib.Path, stash_dir: pathlib.Path) -> pathlib.Path | None:
    """The joined library in ``stash_dir`` (decompressed once, checked against the manifest), or
    None when parts are missing (named on stdout)."""
    manifest = _manifest(parts_dir, stash_dir)
    lib = stash_dir / LIB_NAME
    if lib.is_file() and lib.stat().st_size == manifest["bytes"] and _sha256(lib) == manifest["sha256"]:
        return lib
    _, missing = stash(parts_dir, stash_dir)
    if missing:
        print(f"cublas_parts: missing {len(missing)} of {len(manifest['parts'])} parts: "
              + " ".join(missing), file=sys.stderr)
        return None
    bad = [p["name"] for p in manifest["parts"]
           if _sha256(stash_dir / p["name"]) != p["sha256"]]
    if bad:                  # (a part stashed for another manifest of the same sizes)
        for name in bad:
            (stash_dir / name).unlink()
        print(f"cublas_parts: {' '.join(bad)} did not match the manifest's SHA-256: dropped; "
              "carry them again", file=sys.stderr)
        return None
    tmp = stash_dir / f"{LIB_NAME}.partial"
    dec, h = lzma.LZMADecompressor(), hashlib.sha256()
    why = None
    try:
        with open(tmp, "wb") as out:
            for part in manifest["parts"]:
                with open(stash_dir / part["name"], "rb") as f:
                    while block := f.read(CHUNK):
                        data = dec.decompress(block)
                        h.update(data)
                        out.write(data)
    except lzma.LZMAError as exc:
        why = f"not an xz stream ({exc})"
    if why is None and (not dec.eof or h.hexdigest() != manifest["sha256"]):
        why = "truncated stream" if not dec.eof else "wrong bytes"
    if why is not None:
        _clear(stash_dir)
        raise SystemExit(f"cublas_parts: the joined library does not match the manifest ({why}); "
                         "the stash is cleared: carry every part again")
    tmp.replace(lib)
    for part in manifest["parts"]:       # the library alone stays (disk: 64 GiB there)
        (stash_dir / part["name"]).unlink()
    return lib


def device_calls(manifest: dict) -> list[str]:
    """The device tool calls that carry and join the parts, one line each."""
    calls = []
    for part in manifest["parts"]:
        calls.append(f'run carry [".cublas/manifest.json", ".cublas/{part["name"]}"]  '
                     f'command: python3 scripts/cublas_parts.py stash')
    calls.append('run command: bash scripts/gpu_grouped_check.sh "$OUT/gg"  (joins, then checks)')
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="here: split the library into parts in .cublas/")
    mk.add_argument("--version", default=DEFAULT_VERSION, help="nvidia-cublas version to fetch")
    mk.add_argument("--wheel", type=pathlib.Path,
                    help="an nvidia-cublas wheel or a libcublasLt file to use instead of fetching")
    mk.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB)
    mk.add_argument("--out", type=pathlib.Path, default=PARTS_DIR)
    for name, text in (("stash", "there: check the carried part(s) and move them out of the tree"),
                       ("join", "there: join the parts; prints the library's path")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--parts", type=pathlib.Path, default=PARTS_DIR)
        p.add_argument("--stash", type=pathlib.Path, default=STASH_DIR)
    args = ap.parse_args(argv)
    if args.cmd == "make":
        part_bytes = int(args.part_mib * (1 << 20))
        with tempfile.TemporaryDirectory() as tmp:
            source = args.wheel or download_wheel(args.version, pathlib.Path(tmp))
            manifest = make(source, args.out, part_bytes, args.version)
        total = sum(p["bytes"] for p in manifest["parts"])
        print(f"cublas_parts: {manifest['library']} {manifest['version']}: "
              f"{manifest['bytes'] / 2**20:.0f} MiB, {total / 2**20:.0f} MiB as xz in "
              f"{len(manifest['parts'])} parts in {args.out}. Device calls:")
        print("\n".join(device_calls(manifest)))
        return 0
    if args.cmd == "stash":
        present, missing = stash(args.parts, args.stash)
        print(f"cublas_parts: {len(present)} parts stashed in {args.stash}"
              + (f", missing: {' '.join(missing)}" if missing else ", all there"))
        return 0
    lib = join(args.parts, args.stash)
    if lib is None:
        return 1
    print(lib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
