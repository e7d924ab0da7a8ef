"""Machine code (SASS) of the kernels, read without a GPU: NVRTC's cubin through ``nvdisasm``.

What the compiler's resource report cannot say, the disassembly can: whether the global loads
and stores are 16 bytes wide, whether the FP8 conversion became the hardware instruction
(``F2FP.SATFINITE``) on sm_89+, whether anything went to local memory. ``nvdisasm`` comes from
the ``nvidia-cuda-nvdisasm`` wheel (the ``test`` extra) or a CUDA toolkit, found by
``cuda.pathfinder``.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from pathlib import Path

from . import _compile_check, _jit

__all__ = ["find_nvdisasm", "disassemble", "disassemble_image", "memory_ops", "summary",
           "longest_load_run"]

_FUNC_RE = re.compile(r"^\s*\.text\.(\S+):\s*$", re.M)
_MEM_RE = re.compile(r"\b(?:LDG|STG|LDS|STS|LDL|STL|ATOMG|RED|F2FP)(?:\.[A-Z0-9_]+)*")
# One instruction line: "/*0a80*/  @!P2 LDG.E.128 R8, ..." -> the opcode; or a label line ".L_x_12:".
_INSN_RE = re.compile(r"^\s*(?:/\*[0-9a-f]+\*/\s*(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)|(\.L\w*):)", re.M)
# What consumes loaded data in the cast kernel (amax, scaling, conversion, sums, stores) and what
# ends a basic block.
_USE_PREFIXES = ("FMNMX", "FMUL", "FADD", "F2FP", "STS", "STG")
_BLOCK_END_PREFIXES = ("BRA", "EXIT", "RET", "BAR")


def find_nvdisasm() -> str | None:
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
    except ImportError:
        return None
    return find_nvidia_binary_utility("nvdisasm")


def disassemble(spec: _jit.KernelSpec, arch: str) -> dict[str, str]:
    """``{name expression: SASS text}`` for every instantiation of ``spec`` on ``sm_<arch>``."""
    if find_nvdisasm() is None:      # before the compile: say what is missing at once
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the test extra)")
    image, mapping, _ = _compile_check.compile_offline(spec, arch)
    return disassemble_image(image, mapping)


def disassemble_image(image: bytes, mapping: dict[str, str]) -> dict[str, str]:
    """``{name expression: SASS text}`` of a cubin from :func:`_compile_check.compile_offline`."""
    tool = find_nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the test extra)")
    # CuPy's getCUBIN drops the last byte (it strips a trailing NUL as for PTX text); the ELF
    # program headers end exactly there, so put the zero back for nvdisasm.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernels.cubin"
        path.write_bytes(image + b"\0")
        text = subprocess.run([tool, "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout
    parts = _FUNC_RE.split(text)
    by_mangled = dict(zip(parts[1::2], parts[2::2]))
    return {expr: by_mangled[mangled] for expr, mangled in mapping.items()}


def memory_ops(sass: str) -> collections.Counter:
    """Counts of the memory and FP8-conversion instructions in one kernel's SASS, by full
    opcode (``LDG.E.128``, ``STG.E.U8``, ``F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C``, ...)."""
    return collections.Counter(_MEM_RE.findall(sass))


def longest_load_run(sass: str, load: str = "LDG.E.128") -> int:
    """The most ``load`` instructions issued in one basic block before anything there uses data
    (``FMNMX``, ``FMUL``, ``FADD``, ``F2FP``, a shared or global store): how many loads of a
    thread can be in flight at once. A run ends at a use, a branch, a barrier or a label."""
    best = run = 0
    for m in _INSN_RE.finditer(sass):
        op = m.group(1)
        if op is None or op.startswith(_USE_PREFIXES + _BLOCK_END_PREFIXES):
            run = 0
        elif op == load:
            run += 1
            best = max(best, run)
    return best


def summary(sass: str) -> str:
    """One line: 16-byte global loads / stores, hardware FP8 conversions, local-memory accesses."""
    ops = memory_ops(sass)
    local = sum(v for op, v in ops.items() if op.startswith(("LDL", "STL")))
    f2fp = sum(v for op, v in ops.items() if op.startswith("F2FP"))
    return (f"LDG.128 x{ops['LDG.E.128']}, STG.128 x{ops['STG.E.128']}, F2FP x{f2fp}, "
            f"local memory x{local}")
