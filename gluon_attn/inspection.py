"""Compile-only inspection of the package's Gluon kernels: no GPU needed.

A kernel is compiled with ``triton.compile`` for a chosen target (a ptxas bundled in the triton
wheel assembles it: ``kernels.toolchain.ptxas_for``) and its cubin is read with the bundled ``cuobjdump``: registers, stack and local
memory, shared and tensor memory, warps, and a SASS instruction histogram.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .kernels import registry  # noqa: F401  (importing it registers the builders)
from .kernels.build import ARCHS, BUILDERS, BuildRequest, KernelBuild, check_arch  # noqa: F401
from .kernels.toolchain import COMPILE_OPTIONS, ptxas_for

# MMA opcodes listed first in histograms: Hopper warpgroup MMA (16-bit, fp8) and Blackwell tcgen05 MMA.
MMA_OPCODES = ("HGMMA", "QGMMA", "UTCHMMA", "UTCQMMA")


def toolchain_bin(tool: str) -> str:
    import triton
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    if not path.exists():
        raise FileNotFoundError(f"{tool} not found in the triton wheel at {path}")
    return str(path)


def make_build(req: BuildRequest) -> KernelBuild:
    check_arch(req.arch)
    if req.kernel not in BUILDERS:
        raise ValueError(f"unknown kernel {req.kernel!r}; available: {', '.join(sorted(BUILDERS))}")
    return BUILDERS[req.kernel](req)


def compile_build(build: KernelBuild, arch: str):
    """Compile for ``arch`` without a GPU; returns Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cc = check_arch(arch)
    # Pointers 16-byte aligned, as the JIT specializes them for torch's allocations (vector accesses).
    names = build.fn.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in build.signature.items() if t.startswith("*")}
    src = GluonASTSource(build.fn, signature=build.signature, constexprs=build.constexprs, attrs=attrs)
    with ptxas_for(cc):
        return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                              options={"num_warps": build.num_warps, **COMPILE_OPTIONS, **build.extra})


def _run_tool(tool: str, args: list[str], cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([toolchain_bin(tool), *args, path], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)} failed: {res.stderr.strip()}")
    return res.stdout


def sass_text(cubin: bytes) -> str:
    return _run_tool("cuobjdump", ["-sass"], cubin)


_RES_RE = re.compile(r"(\w+(?:\[\d+\])?):(\d+)")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """cuobjdump -res-usage for the kernel: REG, STACK, SHARED, LOCAL, ..."""
    out = _run_tool("cuobjdump", ["-res-usage"], cubin)
    for line in out.splitlines():
        if "REG:" in line:
            return {k: int(v) for k, v in _RES_RE.findall(line)}
    raise RuntimeError(f"no resource line in cuobjdump output:\n{out}")


_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)")


def sass_instructions(sass: str) -> list[str]:
    """Full mnemonics (with modifiers) of every instruction, in order."""
    ops = []
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if m:
            ops.append(m.group(1) + m.group(2))
    return ops


def opcode_histogram(sass: str) -> collections.Counter:
    """Instruction counts by base opcode (the mnemonic before its first '.')."""
    return collections.Counter(op.split(".")[0] for op in sass_instructions(sass))


def ordered_histogram(hist: collections.Counter) -> list[tuple[str, int]]:
    """MMA opcodes first (in a fixed order), then the rest by count."""
    head = [(op, hist[op]) for op in MMA_OPCODES if hist.get(op)]
    rest = sorted(((op, n) for op, n in hist.items() if op not in MMA_OPCODES), key=lambda t: (-t[1], t[0]))
    return head + rest


_ADDR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/")
_BACK_BRANCH = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?0x([0-9a-f]+)")


def sass_rows(sass: str) -> list[tuple[int, str]]:
    """(address, line) of every instruction line."""
    return [(int(m.group(1), 16), line) for line in sass.splitlines() if (m := _ADDR.match(line))]


def back_branches(sass: str) -> list[tuple[int, int]]:
    """(target, branch) address spans of every backward branch: the loops (and a wait's retry branch from
    out-of-line code after the function's end, which jumps back too)."""
    spans = []
    for addr, line in sass_rows(sass):
        m = _BACK_BRANCH.match(line)
        if m and int(m.group(2), 16) < addr:
            spans.append((int(m.group(2), 16), addr))
    return spans


def innermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (lo, hi) spans that contain no other span of the list (the innermost loops of backward branches)."""
    return [a for a in spans if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in spans)]


def mma_loops(sass: str) -> list[tuple[int, int]]:
    """Address spans of the innermost loops that issue tensor-core MMAs (the attention kernels' K/V
    loops, run once per key block). A loop is a backward branch's span."""
    rows = sass_rows(sass)
    return [(lo, hi) for lo, hi in innermost(back_branches(sass))
            if any(lo <= addr <= hi and any(op in line for op in MMA_OPCODES) for addr, line in rows)]


def mma_loop_spills(sass: str) -> int:
    """LDL/STL inside ``mma_loops``: the spills that cost per key block rather than per tile."""
    loops = mma_loops(sass)
    return sum(1 for addr, line in sass_rows(sass) if _LOCAL.search(line) and any(lo <= addr <= hi for lo, hi in loops))


_ROW = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s*([^;]*);")
# Base opcodes whose first operand is not a register they write: stores, reductions, barriers, branches, fences,
# asynchronous copies.
_NO_DEST = frozenset("ST STS STG STL STSM RED REDG ATOMS BAR BRA BRX EXIT RET CALL SYNCS WARPGROUP UTMALDG UTMASTG "
                     "UTMAREDG UTMACCTL UTMAPF UBLKCP MEMBAR FENCE CCTL BSYNC BSSY WARPSYNC NOP ERRBAR DEPBAR "
                     "USETMAXREG BPT YIELD ELECT".split())


def _wgmma_hazards_straight(rows: list[tuple[int, str, str, list[str]]]) -> list[tuple[int, str]]:
    closed: list[frozenset] = []  # A-operand registers of each committed group still in flight, oldest first
    open_regs: set[int] = set()  # of the group being issued (its last MMA carries gsb0)
    found = []
    for addr, line, op, operands in rows:
        base = op.split(".")[0]
        if base in ("HGMMA", "QGMMA"):
            a = operands[1] if len(operands) > 1 else ""
            if re.fullmatch(r"R\d+", a):
                open_regs |= set(range(int(a[1:]), int(a[1:]) + 4))
            if "gsb0" in operands:
                closed.append(frozenset(open_regs))
                open_regs = set()
        elif op.startswith("WARPGROUP.DEPBAR"):
            keep = int(operands[-1], 16)
            closed = closed[len(closed) - keep:] if keep else []
        elif base in ("EXIT", "RET"):
            closed, open_regs = [], set()
        elif base not in _NO_DEST and operands and re.fullmatch(r"R\d+", operands[0]):
            width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
            first = int(operands[0][1:])
            live = open_regs.union(*closed)
            if live.intersection(range(first, first + width)):
                found.append((addr, line.strip()))
    return found


def wgmma_operand_hazards(sass: str) -> list[str]:
    """Instructions that write a register a register-input wgmma (HGMMA/QGMMA with A in registers) may still be
    reading: after the MMA issues and before the WARPGROUP.DEPBAR that retires its group. ptxas of CUDA 12.x can
    emit such writes (NVIDIA's CUDA 13.3 release notes list the fix; triton-lang/triton#11781), and the sm_90a
    kernels are assembled with the wheel's 12.9 ptxas (``kernels.toolchain``), so the compile tests assert none.
    The SASS is scanned in address order, and each loop's body twice in a row for writes across its back edge."""
    rows = []
    for line in sass.splitlines():
        m = _ROW.match(line)
        if m:
            rows.append((int(m.group(1), 16), line, m.group(2), [a.strip() for a in m.group(3).split(",") if a.strip()]))
    found = set(_wgmma_hazards_straight(rows))
    for lo, hi in back_branches(sass):
        body = [r for r in rows if lo <= r[0] <= hi]
        found |= set(_wgmma_hazards_straight(body + body))
    return [line for _, line in sorted(found)]


_LOCAL = re.compile(r"\b(LDL|STL)\b")
_SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)")


def register_budgets(ptx: str) -> list[int]:
    """Distinct per-thread register counts that warp-specialized partitions set with setmaxnreg."""
    return sorted({int(n) for _, n in _SETMAXNREG.findall(ptx)})


@dataclass
class InspectReport:
    kernel_name: str
    arch: str
    registers: int
    stack_bytes: int
    local_bytes: int
    spill_instructions: int  # LDL/STL in SASS: local-memory traffic, i.e. register spills
    loop_spill_instructions: int  # of those, inside the innermost MMA loops (per key block, see mma_loop_spills)
    shared_bytes: int
    tmem_columns: int
    num_warps: int  # of the default partition (the kernel's num_warps)
    total_warps: int  # all partitions of a warp-specialized kernel (rounded up to warpgroups)
    setmaxnreg: list[int]  # register budgets the partitions switch to (empty if not warp-specialized)
    instructions: int
    histogram: list[tuple[str, int]]
    description: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def has(self, opcode: str) -> bool:
        return any(op == opcode and n > 0 for op, n in self.histogram)


@dataclass
class Inspected:
    report: InspectReport
    compiled: Any
    sass: str


def analyze(compiled, arch: str, description: str = "", num_warps: int | None = None) -> Inspected:
    cubin = compiled.asm["cubin"]
    sass = sass_text(cubin)
    res = resource_usage(cubin)
    hist = opcode_histogram(sass)
    meta = compiled.metadata
    report = InspectReport(
        kernel_name=compiled.name,
        arch=arch,
        registers=res.get("REG", 0),
        stack_bytes=res.get("STACK", 0),
        local_bytes=res.get("LOCAL", 0),
        spill_instructions=hist.get("LDL", 0) + hist.get("STL", 0),
        loop_spill_instructions=mma_loop_spills(sass),
        shared_bytes=int(meta.shared),
        tmem_columns=int(getattr(meta, "tmem_size", 0) or 0),
        num_warps=int(num_warps if num_warps is not None else meta.num_warps),
        total_warps=int(meta.num_warps),
        setmaxnreg=register_budgets(compiled.asm["ptx"]),
        instructions=sum(hist.values()),
        histogram=ordered_histogram(hist),
        description=description,
    )
    return Inspected(report, compiled, sass)


def inspect_kernel(req: BuildRequest) -> Inspected:
    build = make_build(req)
    compiled = compile_build(build, req.arch)
    return analyze(compiled, req.arch, build.description, num_warps=build.num_warps)


def dump(inspected: Inspected, directory: str | os.PathLike) -> list[Path]:
    """Write PTX, cubin, SASS (and TTGIR) of a compiled kernel into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    name = inspected.report.kernel_name
    asm = inspected.compiled.asm
    files = {
        d / f"{name}.ptx": asm["ptx"],
        d / f"{name}.ttgir": asm.get("ttgir", ""),
        d / f"{name}.sass": inspected.sass,
    }
    written = []
    for path, text in files.items():
        path.write_text(text)
        written.append(path)
    cubin = d / f"{name}.cubin"
    cubin.write_bytes(asm["cubin"])
    written.append(cubin)
    return written
