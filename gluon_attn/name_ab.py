"""Kernel-name A/B: what a name (``cutlass_`` in particular) does to ptxas, statically and timed.

Static part (any machine): the same kernel and specialization compiled under two names. The name is a
constexpr of the kernel, so the compile cache keys on it and cannot hand one name the other's binary;
each build's symbol is checked. Compared: PTX (must be identical but for the name), SASS instruction
counts and per-opcode histogram, registers, stack and spills, shared memory, cubin size and its
sections, and whether the SASS differs at all beyond register numbering.

Timed part (a GPU of the matching arch): both names on the same inputs, interleaved A, B, A, B over
several rounds; median ratio and its spread; outputs compared.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import re
import statistics
import struct
from dataclasses import dataclass
from typing import Iterable, Optional

from .inspection import BuildRequest, analyze, compile_build, make_build, sass_instructions

DEFAULT_NAMES = ("gluon_attention", "cutlass_gluon_attention")
SECTION_PREFIXES = (".nv.capmerc", ".text.")


def elf_sections(blob: bytes) -> dict[str, int]:
    """Section name -> size of an ELF64 little-endian image (a cubin)."""
    if blob[:4] != b"\x7fELF" or blob[4] != 2:
        raise ValueError("not an ELF64 image")
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    str_off, str_size = headers[shstrndx][4], headers[shstrndx][5]
    names = blob[str_off:str_off + str_size]
    out = {}
    for h in headers:
        end = names.index(b"\0", h[0])
        out[names[h[0]:end].decode()] = h[5]
    return out


def section_sizes(blob: bytes, symbol: str) -> dict[str, int]:
    """Sizes of the sections ptxas emits per kernel, with the kernel's own name taken out so both
    builds' sections line up (".text.<name>" -> ".text.*")."""
    sizes = collections.Counter()
    for name, size in elf_sections(blob).items():
        for prefix in SECTION_PREFIXES:
            if name.startswith(prefix):
                sizes[name.replace(symbol, "*")] += size
    return dict(sizes)


_REG = re.compile(r"\b(U?R\d+|U?P\d+)\b")
_HEX = re.compile(r"0x[0-9a-f]+")
_BRANCHES = ("BRA", "BRX", "BSSY", "CALL", "JMP", "JMX")


def normalized_sass(sass: str) -> list[str]:
    """The instruction sequence with register numbers ignored (every register operand becomes R, UR,
    P or UP) and branch targets blanked (they move when code size changes). Two listings that
    normalise alike differ at most by register allocation."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if not m:
            continue
        body = _REG.sub(lambda r: re.match(r"U?[RP]", r.group(0)).group(0), m.group(1).strip())
        opcode = body.split()[0] if not body.startswith("@") else body.split()[1]
        if opcode.split(".")[0] in _BRANCHES:
            body = _HEX.sub("#", body)
        out.append(body)
    return out


def ptx_code(ptx: str, symbol: str) -> list[str]:
    """The PTX program without comments, DWARF sections (which spell the name out byte by byte and
    shift offsets with its length) and `.file` directives (source paths: a checkout's location, or
    another checkout's when the compile cache hands back its build), the symbol replaced by a
    placeholder."""
    cut = ptx.find("\t.section\t.debug")
    if cut >= 0:
        ptx = ptx[:cut]
    lines = []
    for line in ptx.replace(symbol, "@@KERNEL@@").splitlines():
        line = re.sub(r"\s+", " ", line.split("//", 1)[0]).strip()
        if line and not line.startswith(".file"):
            lines.append(line)
    return lines


@dataclass
class Build:
    name: str
    symbol: str
    ptx: str
    sass: str
    report: dict
    cubin_bytes: int
    sections: dict


def build(req: BuildRequest, name: str) -> Build:
    req = dataclasses.replace(req, kernel_name=name)
    kb = make_build(req)
    compiled = compile_build(kb, req.arch)
    inspected = analyze(compiled, req.arch, kb.description, num_warps=kb.num_warps)
    cubin = compiled.asm["cubin"]
    return Build(name, compiled.name, compiled.asm["ptx"], inspected.sass, inspected.report.to_dict(), len(cubin),
                 section_sizes(cubin, compiled.name))


@dataclass
class StaticResult:
    arch: str
    dtype: str
    head_dim: int
    causal: bool
    a: Build
    b: Build
    ptx_identical_but_name: bool
    sass_identical: bool
    sass_identical_modulo_registers: bool
    histogram_delta: list[tuple[str, int]]  # opcode, count(b) - count(a), largest changes first

    def metrics(self) -> dict[str, tuple]:
        """metric -> (value for a, value for b)."""
        ra, rb = self.a.report, self.b.report
        m = {k: (ra[k], rb[k]) for k in ("instructions", "registers", "stack_bytes", "spill_instructions",
                                         "shared_bytes", "tmem_columns")}
        m["cubin_bytes"] = (self.a.cubin_bytes, self.b.cubin_bytes)
        for sec in sorted(set(self.a.sections) | set(self.b.sections)):
            m[f"section {sec}"] = (self.a.sections.get(sec, 0), self.b.sections.get(sec, 0))
        return m


def static_ab(arch: str, dtype: str, head_dim: int, causal: bool, names=DEFAULT_NAMES,
              config: Optional[dict] = None) -> StaticResult:
    a_name, b_name = names
    if a_name == b_name:
        raise ValueError("name-ab needs two different names")
    req = BuildRequest(kernel="attention", arch=arch, dtype=dtype, head_dim=head_dim, causal=causal,
                       config=dict(config or {}))
    a, b = build(req, a_name), build(req, b_name)
    for bld in (a, b):
        if bld.symbol != bld.name or f"Function : {bld.name}" not in bld.sass:
            raise RuntimeError(f"compiled symbol {bld.symbol!r} is not the requested name {bld.name!r}")
    token = "@@KERNEL@@"
    ptx_same = ptx_code(a.ptx, a_name) == ptx_code(b.ptx, b_name)
    ops_a = collections.Counter(op.split(".")[0] for op in sass_instructions(a.sass))
    ops_b = collections.Counter(op.split(".")[0] for op in sass_instructions(b.sass))
    delta = [(op, ops_b[op] - ops_a[op]) for op in set(ops_a) | set(ops_b) if ops_b[op] != ops_a[op]]
    delta.sort(key=lambda t: (-abs(t[1]), t[0]))
    return StaticResult(arch, dtype, head_dim, causal, a, b, ptx_same,
                        sass_identical=a.sass.replace(a_name, token) == b.sass.replace(b_name, token),
                        sass_identical_modulo_registers=(normalized_sass(a.sass.replace(a_name, token))
                                                         == normalized_sass(b.sass.replace(b_name, token))),
                        histogram_delta=delta)


def static_rows(res: StaticResult) -> list[dict]:
    base = dict(part="static", arch=res.arch, dtype=res.dtype, head_dim=res.head_dim, causal=res.causal)
    rows = []
    for metric, (va, vb) in res.metrics().items():
        rows.append({**base, "name": res.a.name, "metric": metric, "value": va})
        rows.append({**base, "name": res.b.name, "metric": metric, "value": vb})
    for metric, value in (("ptx_identical_but_name", res.ptx_identical_but_name),
                          ("sass_identical", res.sass_identical),
                          ("sass_identical_modulo_registers", res.sass_identical_modulo_registers)):
        rows.append({**base, "name": f"{res.a.name} vs {res.b.name}", "metric": metric, "value": value})
    for op, d in res.histogram_delta:
        rows.append({**base, "name": f"{res.b.name} - {res.a.name}", "metric": f"opcode {op}", "value": d})
    return rows


# ---------------------------------------------------------------------------------------------
# Timed part
# ---------------------------------------------------------------------------------------------

def timed_ab(dtype: str, head_dim: int, causal: bool, names=DEFAULT_NAMES, *, n_ctx: int = 8192, batch: int = 4,
             heads: int = 32, rounds: int = 8, rep_ms: float = 50.0, warmup_ms: Optional[float] = None) -> list[dict]:
    """Both names on the same inputs, timed with ``time_rounds`` (A, B, then B, A, ...: the order turns
    each round, each turn warmed up first)."""
    import torch

    from .api import attention
    from .bench.timing import DEFAULT_WARMUP_MS, time_rounds
    from .problem import Problem, make_inputs

    p = Problem(batch, heads, n_ctx, head_dim, causal, dtype)
    inputs = make_inputs(p, "cuda")
    fp8 = dict(descale_q=inputs.descale_q, descale_k=inputs.descale_k, descale_v=inputs.descale_v) \
        if p.is_fp8 else {}
    fns = {n: (lambda n=n: attention(inputs.q, inputs.k, inputs.v, causal=causal, kernel_name=n, **fp8))
           for n in names}
    outs = {n: fn() for n, fn in fns.items()}
    same = bool(torch.equal(outs[names[0]], outs[names[1]]))
    max_diff = float((outs[names[0]].float() - outs[names[1]].float()).abs().max().item())
    timed, failed = time_rounds(fns, rounds=rounds, rep_ms=rep_ms,
                                warmup_ms=DEFAULT_WARMUP_MS if warmup_ms is None else warmup_ms)
    if failed:
        name, exc = next(iter(failed.items()))
        raise RuntimeError(f"timing {name} failed: {type(exc).__name__}: {exc}") from exc
    times = {n: timed[n].p50s for n in names}
    ratios = [b / a for a, b in zip(times[names[0]], times[names[1]])]
    major, minor = torch.cuda.get_device_capability()
    base = dict(part="timed", arch=f"sm_{major}{minor}a", dtype=dtype, head_dim=head_dim, causal=causal)
    rows = []
    for n in names:
        for i, t in enumerate(times[n]):
            rows.append({**base, "name": n, "metric": f"p50_ms round {i}", "value": t})
        rows.append({**base, "name": n, "metric": "tflops (median of rounds)",
                     "value": p.tflops(statistics.median(times[n]))})
    pair = f"{names[1]} / {names[0]}"
    rows += [{**base, "name": pair, "metric": "time ratio median", "value": statistics.median(ratios)},
             {**base, "name": pair, "metric": "time ratio min", "value": min(ratios)},
             {**base, "name": pair, "metric": "time ratio max", "value": max(ratios)},
             {**base, "name": pair, "metric": "outputs identical", "value": same},
             {**base, "name": pair, "metric": "outputs max |diff|", "value": max_diff},
             {**base, "name": pair, "metric": "n_ctx", "value": n_ctx}]
    del inputs, outs
    torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def _pct(a, b) -> str:
    if not a:
        return "n/a" if b else "0"
    return f"{100.0 * (b - a) / a:+.1f}%"


def report_markdown(rows: list[dict], names=DEFAULT_NAMES) -> str:
    import pandas as pd

    df = pd.DataFrame(rows)
    a, b = names
    lines = [f"# Kernel-name A/B: `{a}` (A) vs `{b}` (B)", ""]
    static = df[df.part == "static"]
    conclusions = []
    for arch, g in static.groupby("arch", sort=True):
        lines += [f"## {arch}: SASS and resources", "",
                  "| dtype | D | causal | instr A | instr B | Δ | regs A/B | spills A/B | stack A/B | cubin A/B | "
                  ".nv.capmerc A/B | .text A/B | PTX same but name | SASS same mod. registers | top opcode changes |",
                  "|" + "---|" * 15]
        changed = 0
        total = 0
        spill_worse = 0
        instr_deltas = []
        cubin_growth = []
        for (dtype, d, causal), c in g.groupby(["dtype", "head_dim", "causal"], sort=True):
            def val(name, metric):
                sel = c[(c.name == name) & (c.metric == metric)]
                return sel.value.iloc[0] if len(sel) else 0
            pair = f"{a} vs {b}"
            ia, ib = int(val(a, "instructions")), int(val(b, "instructions"))
            cap = [m for m in c.metric.unique() if m.startswith("section .nv.capmerc")]
            txt = [m for m in c.metric.unique() if m.startswith("section .text")]
            cap_a, cap_b = sum(int(val(a, m)) for m in cap), sum(int(val(b, m)) for m in cap)
            txt_a, txt_b = sum(int(val(a, m)) for m in txt), sum(int(val(b, m)) for m in txt)
            same_mod = bool(val(pair, "sass_identical_modulo_registers"))
            deltas = c[c.metric.str.startswith("opcode ")]
            top = ", ".join(f"{m.split()[1]} {int(v):+d}" for m, v in zip(deltas.metric[:4], deltas.value[:4]))
            sa, sb = int(val(a, "spill_instructions")), int(val(b, "spill_instructions"))
            lines.append(
                f"| {dtype} | {d} | {causal} | {ia} | {ib} | {_pct(ia, ib)} | {int(val(a, 'registers'))}/"
                f"{int(val(b, 'registers'))} | {sa}/{sb} | {int(val(a, 'stack_bytes'))}/{int(val(b, 'stack_bytes'))}"
                f" | {int(val(a, 'cubin_bytes'))}/{int(val(b, 'cubin_bytes'))} | {cap_a}/{cap_b} | {txt_a}/{txt_b} | "
                f"{bool(val(pair, 'ptx_identical_but_name'))} | {same_mod} | {top or '-'} |")
            total += 1
            changed += not same_mod
            spill_worse += sb > sa
            instr_deltas.append((ib - ia) / ia if ia else 0.0)
            ca, cb = int(val(a, "cubin_bytes")), int(val(b, "cubin_bytes"))
            cubin_growth.append((cb - ca, cap_a, cap_b))
        med = statistics.median(instr_deltas) if instr_deltas else 0.0
        if changed == 0:
            verdict = "no effect: ptxas emitted the same code under both names"
        elif spill_worse or med > 0:
            verdict = "it hurts: more instructions" + (" and register spills" if spill_worse else "")
        else:
            verdict = "it trims instructions" if med < 0 else "mixed"
        conclusions.append(
            f"- {arch}: {verdict}. The B name changed the SASS beyond register numbering in {changed} of "
            f"{total} builds (median instruction-count change {100 * med:+.1f}%, range "
            f"{100 * min(instr_deltas):+.1f}% to {100 * max(instr_deltas):+.1f}%); B spilled more than A in "
            f"{spill_worse} of {total}. Cubin size change (median) {statistics.median(g[0] for g in cubin_growth):+.0f} "
            f"bytes; .nv.capmerc sections {statistics.median(g[1] for g in cubin_growth):.0f} -> "
            f"{statistics.median(g[2] for g in cubin_growth):.0f} bytes (median).")
        lines.append("")
    timed = df[df.part == "timed"]
    if len(timed):
        lines += ["## Timings (interleaved A, B per round, same inputs)", "",
                  "| arch | dtype | D | causal | N_CTX | TFLOPS A | TFLOPS B | time B/A median | min | max | "
                  "outputs identical |", "|" + "---|" * 11]
        pair = f"{b} / {a}"
        ratios = []
        for (arch, dtype, d, causal), c in timed.groupby(["arch", "dtype", "head_dim", "causal"], sort=True):
            def tv(name, metric):
                sel = c[(c.name == name) & (c.metric == metric)]
                return sel.value.iloc[0] if len(sel) else float("nan")
            r = float(tv(pair, "time ratio median"))
            ratios.append(r)
            lines.append(f"| {arch} | {dtype} | {d} | {causal} | {int(tv(pair, 'n_ctx'))} | "
                         f"{float(tv(a, 'tflops (median of rounds)')):.1f} | "
                         f"{float(tv(b, 'tflops (median of rounds)')):.1f} | {r:.3f} | "
                         f"{float(tv(pair, 'time ratio min')):.3f} | {float(tv(pair, 'time ratio max')):.3f} | "
                         f"{tv(pair, 'outputs identical')} |")
        lines.append("")
        med_r = statistics.median(ratios)
        effect = ("no measurable effect" if abs(med_r - 1) < 0.01 else
                  ("B is faster" if med_r < 1 else "B is slower"))
        conclusions.append(
            f"- timed on {', '.join(sorted(timed.arch.unique()))}: {effect}: B's time over A's, median across "
            f"problems {med_r:.3f} (from {min(ratios):.3f} to {max(ratios):.3f}); outputs identical in "
            f"{int((timed[timed.metric == 'outputs identical'].value.astype(str) == 'True').sum())} of "
            f"{len(ratios)}.")
    lines = lines[:2] + ["## Conclusion", "", *conclusions, ""] + lines[2:]
    return "\n".join(lines) + "\n"


def grid(archs: Iterable[str], dtypes: Iterable[str], head_dims: Iterable[int], causal: Iterable[bool]):
    return list(itertools.product(archs, dtypes, head_dims, causal))


def run_name_ab(out_dir, *, archs, dtypes, head_dims, causal, names=DEFAULT_NAMES, timed: Optional[bool] = None,
                n_ctx: int = 8192, rounds: int = 8, rep_ms: float = 50.0, command_line=None, progress: bool = True):
    """Static A/B over the grid for every arch; timed A/B where a GPU of that arch is present
    (``timed=None``: whenever one is). Writes rows.csv, env.json and report.md under ``out_dir``."""
    import csv
    import json
    from pathlib import Path

    import torch
    from tqdm.auto import tqdm

    from .bench.environment import collect_env
    from .bench.sweep import prepare_out_dir

    out = prepare_out_dir(out_dir, resume=False)
    (out / "env.json").write_text(json.dumps(collect_env(command_line), indent=2) + "\n")
    gpu_arch = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu_arch = f"sm_{major}{minor}a"
    if timed and gpu_arch not in archs:
        raise ValueError(f"timed A/B needs a GPU of one of {', '.join(archs)}; this machine has "
                         f"{gpu_arch or 'no CUDA GPU'}")
    cells = grid(archs, dtypes, head_dims, causal)
    rows: list[dict] = []
    fields = ["part", "arch", "dtype", "head_dim", "causal", "name", "metric", "value"]
    with open(out / "rows.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()

        def emit(new):
            for r in new:
                writer.writerow(r)
            f.flush()
            rows.extend(new)

        for arch, dtype, d, c in tqdm(cells, desc="name-ab static", disable=not progress):
            emit(static_rows(static_ab(arch, dtype, d, c, names)))
        if timed is not False and gpu_arch in archs:
            timed_cells = [(dt, d, c) for a, dt, d, c in cells if a == gpu_arch]
            for dtype, d, c in tqdm(timed_cells, desc="name-ab timed", disable=not progress):
                emit(timed_ab(dtype, d, c, names, n_ctx=n_ctx, rounds=rounds, rep_ms=rep_ms))
    write_report(out, names)
    return Path(out)


def write_report(out_dir, names=DEFAULT_NAMES):
    """(Re)write report.md from a name-ab folder's rows.csv."""
    import csv
    from pathlib import Path

    out = Path(out_dir)
    with open(out / "rows.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["head_dim"] = int(r["head_dim"])
        r["causal"] = r["causal"] == "True"
        value = r["value"]
        if value in ("True", "False"):
            r["value"] = value == "True"
        else:
            try:
                r["value"] = float(value)
            except ValueError:
                pass
    (out / "report.md").write_text(report_markdown(rows, names))
