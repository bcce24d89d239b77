"""What triton 3.6's Gluon can express of FA3/FA4's remaining Hopper levers, compile-only (sm_90a, no GPU).

Each probe compiles one small kernel in a child process (a failed layout assertion aborts the process) and
prints what happened:

  n80-acc      a wgmma accumulator of 80 columns ([64, 80]: FA3/FA4's 80-query backward tile, wgmma N=80)
  n80-smem     an [80, 128] shared-memory tile (the 80 query rows of Q or dO as one TMA box / wgmma operand)
  split-64-16  the same 80 columns as a [64, 64] and a [64, 16] wgmma on one A operand (what Gluon allows)
  multicast    two CTAs per cluster (num_ctas=2), one K tile in a shared layout broadcast to both CTAs
               (cga_layout [[0, 0]]): is the TMA copy a .multicast::cluster one, as FA3's cluster K/V loads?

Usage: python3 experiments/gluon_limits.py [PROBE...]   (NOTES v51 has its output and what follows from it)
"""
import re
import subprocess
import sys
import tempfile

PRELUDE = """
import re, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, mbarrier, tma
from triton.experimental.gluon._runtime import GluonASTSource
from triton.backends.compiler import GPUTarget

def build(fn, signature, **options):
    src = GluonASTSource(fn, signature=signature, constexprs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

def wgmma_shapes(ptx):
    return sorted(set(re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.(m\\d+n\\d+k\\d+)", ptx)))
"""

PROBES = {
    "n80-acc": """
@gluon.jit
def k(out):
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 80, 16])
    a = gl.allocate_shared_memory(gl.float16, [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], gl.float16))
    b = gl.allocate_shared_memory(gl.float16, [128, 128], gl.NVMMASharedLayout.get_default_for([128, 128], gl.float16))
    acc = warpgroup_mma(a, b.permute((1, 0)), gl.zeros([64, 80], gl.float32, acc_l))
    gl.store(out + gl.arange(0, 64, gl.SliceLayout(1, acc_l)), gl.sum(acc, axis=1))
print("compiled:", wgmma_shapes(build(k, {"out": "*fp32"})))
""",
    "n80-smem": """
@gluon.jit
def k(out):
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    a = gl.allocate_shared_memory(gl.float16, [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], gl.float16))
    q = gl.allocate_shared_memory(gl.float16, [80, 128], gl.NVMMASharedLayout.get_default_for([64, 128], gl.float16))
    acc = warpgroup_mma(a, q.slice(0, 64).permute((1, 0)), gl.zeros([64, 64], gl.float32, acc_l))
    gl.store(out + gl.arange(0, 64, gl.SliceLayout(1, acc_l)), gl.sum(acc, axis=1))
print("compiled:", wgmma_shapes(build(k, {"out": "*fp32"})))
""",
    "split-64-16": """
@gluon.jit
def k(out):
    l64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    l16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    kw = gl.allocate_shared_memory(gl.float16, [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], gl.float16))
    q64 = gl.allocate_shared_memory(gl.float16, [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], gl.float16))
    q16 = gl.allocate_shared_memory(gl.float16, [16, 128], gl.NVMMASharedLayout.get_default_for([16, 128], gl.float16))
    s64 = warpgroup_mma(kw, q64.permute((1, 0)), gl.zeros([64, 64], gl.float32, l64))
    s16 = warpgroup_mma(kw, q16.permute((1, 0)), gl.zeros([64, 16], gl.float32, l16))
    rows = gl.sum(s64, axis=1) + gl.convert_layout(gl.sum(s16, axis=1), gl.SliceLayout(1, l64))
    gl.store(out + gl.arange(0, 64, gl.SliceLayout(1, l64)), rows)
ptx = build(k, {"out": "*fp32"})
print("compiled:", wgmma_shapes(ptx), "- A operand (K's 64 x 128 tile) read from shared memory by both wgmmas")
""",
    "multicast": """
kl = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=[[0, 0]])
LOAD = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=[[0, 0]]))

@gluon.jit
def k(desc, out):
    buf = gl.allocate_shared_memory(gl.float16, [128, 128], desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.expect(bar.index(0), desc.block_type.nbytes)
    tma.async_load(desc, [0, 0], bar.index(0), buf)
    mbarrier.wait(bar.index(0), 0)
    x = buf.load(LOAD)
    gl.store(out + gl.arange(0, 128, gl.SliceLayout(1, LOAD)), gl.sum(x.to(gl.float32), axis=1))
ptx = build(k, {"desc": f"tensordesc<fp16[128, 128],{kl!r}>", "out": "*fp32"}, num_ctas=2)
copies = [line.strip() for line in ptx.splitlines() if "cp.async.bulk.tensor" in line]
print("compiled, cluster of", re.search(r"reqnctapercluster (\\d+)", ptx).group(1), "CTAs; TMA copies:", copies)
print("multicast::cluster copies:", sum(".multicast::cluster" in c for c in copies))
""",
}


def run(name: str) -> str:
    # (from a file: gluon.jit reads the kernel's source)
    with tempfile.NamedTemporaryFile("w", suffix=f"_{name.replace('-', '_')}.py") as script:
        script.write(PRELUDE + PROBES[name])
        script.flush()
        proc = subprocess.run([sys.executable, script.name], capture_output=True, text=True)
    if proc.returncode == 0:
        return proc.stdout.strip()
    lines = [line for line in (proc.stderr or "").splitlines() if line.strip() and not line.startswith("  ")]
    why = next((line for line in lines if re.search(r"power of 2|must be|Assertion|Error", line)), lines[-1])
    return f"rejected (exit {proc.returncode}): {why.strip()[:300]}"


def main(argv):
    names = argv or list(PROBES)
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        sys.exit(f"unknown probe(s) {unknown}; probes: {', '.join(PROBES)}")
    for name in names:
        print(f"{name:12s} {run(name)}")


if __name__ == "__main__":
    main(sys.argv[1:])
