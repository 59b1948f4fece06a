"""gemm/warp_specialized.py's wgmma pipeline, checked in the machine code (runs on CPU: Triton
compiles for sm_90a offline).

A wgmma whose A operand (the dequantized weights) comes from registers reads those registers while
it is in flight, until a wait retires it. ptxas does not carry that through a loop back-edge: an
earlier version kept wgmmas in flight from one K tile to the next across iterations, and the next
tile's dequantization overwrote their operands (wrong results on the H100, intermittently or every
run depending on stages and registers). The scan below replays the SASS of the consumer loop
(entry, then the body three times), tracks which HGMMAs are in flight under the
`WARPGROUP.DEPBAR.LE gsb0, n` waits, and fails on any instruction that writes an in-flight HGMMA's
A registers.
"""
import os
import re
import shutil
import subprocess

import pytest

from gemm import warp_specialized as W

if W.gluon is None:
    pytest.skip("needs Triton's Gluon", allow_module_level=True)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
import triton.language as tl  # noqa: E402

# Under TRITON_INTERPRET=1 (the CPU tests) the interpreter swaps triton.language's builtins for its
# own while a kernel runs, and a library helper called inside a kernel (triton.language.standard's)
# leaves triton.language.core swapped for good, which breaks Gluon's compiler afterwards (unless its
# cache already holds the kernel). This module is imported at collection, before any test runs:
# keep the originals and put them back for each compile.
_ORIGINAL = [(o, {k: v for k, v in vars(o).items() if not k.startswith("__")})
             for o in (tl, tl.core, tl.math, tl.core.tensor, tl.core.dtype,
                       tl.core.tensor_descriptor_base)]


def _restore_language():
    for obj, attrs in _ORIGINAL:
        for k, v in attrs.items():
            if getattr(obj, k, None) is not v:
                setattr(obj, k, v)

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_NO_DEST = ("ST", "STS", "STG", "STL", "BAR", "BRA", "SYNCS", "HGMMA", "WARPGROUP", "RED", "ATOMS",
            "EXIT", "RET", "NOP", "DEPBAR", "WARPSYNC", "FENCE", "MEMBAR", "CCTL", "UTMALDG",
            "UTMACMDFLUSH", "ISETP", "FSETP", "PLOP3", "VOTEU", "UISETP", "ERRBAR", "CALL", "BSYNC",
            "BSSY", "LDGDEPBAR", "UTMAPF")


def parse(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS instruction."""
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*?)\s*;", sass)]


def written(text: str) -> set[int]:
    """General registers an instruction writes (its first register operand, by the width of .64 /
    .128 forms)."""
    op, _, rest = re.sub(r"^@!?U?P\w+\s+", "", text).partition(" ")
    if op.split(".")[0] in _NO_DEST:
        return set()
    for o in (o.strip() for o in rest.split(",")[:2]):
        if m := re.fullmatch(r"R(\d+)", o):
            w = 4 if ".128" in op else 2 if ".64" in op else 1
            return set(range(int(m.group(1)), int(m.group(1)) + w))
        if not re.fullmatch(r"!?U?P(T|\d+)", o):  # a predicate destination may come first
            break
    return set()


def overwrites(ins: list[tuple[int, str]]) -> list[str]:
    """Replay the loop that holds the HGMMAs (entry from the first HGMMA's neighbourhood, body three
    times, then the rest of the code in address order: every branch after the loop taken as if it
    falls through) and list every write to the A registers of an HGMMA still in flight."""
    hgmma = [a for a, t in ins if "HGMMA" in t]
    at = {a: k for k, (a, _) in enumerate(ins)}
    loop = next((int(m.group(1), 16), a) for a, t in ins
                if (m := re.search(r"BRA (0x[0-9a-f]+)", t))
                and int(m.group(1), 16) < a and any(int(m.group(1), 16) <= h <= a for h in hgmma))
    start = min(loop[0], hgmma[0])
    order = (list(range(at[start], at[loop[1]] + 1))
             + list(range(at[loop[0]], at[loop[1]] + 1)) * 3
             + list(range(at[loop[1]] + 1, len(ins))))
    flight, bad = [], []
    for k in order:
        a, t = ins[k]
        if m := re.search(r"HGMMA\.\S+ R\d+, R(\d+),", t):
            flight.append((a, set(range(int(m.group(1)), int(m.group(1)) + 4))))
        elif m := re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", t):
            n = int(m.group(1), 16)
            flight = flight[len(flight) - n:] if n else []
        elif hit := [(fa, written(t) & regs) for fa, regs in flight if written(t) & regs]:
            bad.append(f"{a:#06x} {t} overwrites R{sorted(hit[0][1])}, "
                       f"read by the HGMMA at {hit[0][0]:#06x}")
    return bad


def compiled(BM: int, S: int, maxnreg, split: int = 1, RP: int = 0):
    """The kernel's machine code for one configuration, compiled for sm_90a without a GPU."""
    wl = gl.NVMMASharedLayout.get_default_for([W.BN, 16], gl.int32)
    sl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    xl = gl.NVMMASharedLayout.get_default_for([BM, 128], gl.bfloat16)
    sig = {"w_desc": f"tensordesc<i32[{W.BN}, 16],{wl!r}>",
           "s_desc": f"tensordesc<i32[{W.BN // 2}, 4],{sl!r}>",
           "x_desc": f"tensordesc<bf16[{BM}, 128],{xl!r}>",
           "gs_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "st_ptr": "*i32", "xa_ptr": "*bf16", "lb_ptr": "*bf16",
           "M": "i32", "MX": "i32", "N": "i32", "NP": "i32", "NT": "i32", "stride_ym": "i32",
           "R": "i32", "BM": "constexpr", "S": "constexpr", "SPLIT": "constexpr",
           "HAS_BIAS": "constexpr", "RP": "constexpr"}
    _restore_language()
    src = GluonASTSource(W._ws_kernel, sig, dict(BM=BM, S=S, SPLIT=split, HAS_BIAS=True, RP=RP))
    opts = dict(num_warps=4, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm


def test_scan_catches_an_overwrite():
    """The scan itself: a write to the A registers of an in-flight HGMMA is reported, after the wait
    it is not."""
    loop = [
        "/*0100*/ HGMMA.64x128x16.F32.BF16 R24, R100, gdesc[UR8], R24, gsb0 ;",
        "/*0110*/ WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
        "/*0120*/ LOP3.LUT R102, R5, 0x81c081c0, RZ, 0xc0, !PT ;",
        "/*0130*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "/*0140*/ HMUL2.BF16_V2 R101, R7, R8.H0_H0 ;",
        "/*0150*/ @P0 BRA 0x100 ;",
    ]
    bad = overwrites(parse("\n".join(loop)))
    # entry + 3 replays; not R101's write
    assert len(bad) == 4 and all("0x0120" in b for b in bad), bad
    assert written("LDS.128 R4, [R2]") == {4, 5, 6, 7} and written("STS [R1], R2") == set()


@pytest.mark.skipif(not shutil.which("cuobjdump", path=BIN),
                    reason="Triton's CUDA binaries are not installed")
@pytest.mark.parametrize("BM,S,maxnreg,split,RP", [
    (128, 4, None, 1, 0),
    (64, 4, 128, 1, 0),
    (64, 4, 128, 2, 0),
    (128, 3, None, 1, 0),
    (128, 4, 168, 1, 0),
    (256, 3, None, 1, 0),
    (128, 5, None, 1, 0),
    (64, 4, 128, 2, 32),
    (256, 3, None, 1, 128),
    (64, 5, 128, 1, 32),
    (64, 5, 128, 4, 0),
])
def test_ws_no_inflight_operand_overwritten(tmp_path, BM, S, maxnreg, split, RP):
    """No instruction overwrites an in-flight wgmma's registers, in the configurations the dispatch
    uses and in the two (3 stages; 168 registers) that failed every run before, while the wgmmas do
    stay asynchronous (up to 7 in flight: else the check would hold trivially), with and without
    split K. The kernel holds S tiles of 8 wgmmas in its loop (a lap of the ring) and S - 1 after it
    (the K tiles past the last whole lap), plus RP / 16 for a LoRA term of rank up to RP in the
    epilogue."""
    path = tmp_path / "ws.cubin"
    path.write_bytes(compiled(BM, S, maxnreg, split, RP)["cubin"])
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", str(path)], check=True,
                          capture_output=True, text=True).stdout
    ins = parse(sass)
    assert (sum("HGMMA" in t for _, t in ins) == 8 * (2 * S - 1) + RP // 16
            and any("DEPBAR.LE gsb0, 0x7" in t for _, t in ins))
    assert overwrites(ins) == []
