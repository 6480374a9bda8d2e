"""Instruction mix of compiled kernels, per kernel, from their SASS: no GPU needed.

How session 31 found that the quantised prefill GEMMs spent most of their instructions rounding floats to bf16 in
integer code (docs/KERNEL_NOTES.md): ptxas's register report says how many registers a kernel holds, not what it
issues; the SASS does. This compiles one cuda/*.cu file for one architecture (nvcc -cubin), disassembles it
(nvdisasm -c) and prints, per kernel, the static instruction count and its most frequent opcodes, optionally next
to the same file at another git revision (the whole cuda/ directory of that revision, so headers match).

    python tools/sass_counts.py cuda/gemm_quant.cu --kernels 'silu_i[48]$'
    python tools/sass_counts.py cuda/gemm_quant.cu --base 586c527 --kernels v4_silu
    python tools/sass_counts.py cuda/gemv_quant.cu -D GEMV_HALF_I4=1 --kernels _i4

nvdisasm: $NVDISASM, else on PATH, else next to nvcc. Without a CUDA toolkit's nvdisasm, the `nvidia-cuda-nvdisasm`
wheel on PyPI carries it (`pip download --no-deps nvidia-cuda-nvdisasm`, unzip, nvidia/cu13/bin/nvdisasm).
Static counts (a loop body counts once; the NOPs padding a function's end included, as in the notes' figures): what
matters is the mix and how it moves between builds.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_SECTION = re.compile(r"^\.text\.(\w+):\s*$")
# "        /*0730*/                   I2FP.F32.U32 R15, R15 ;"  (optionally a predicate "@!P0" before the opcode)
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]+)?\b")


def parse_sass(text: str) -> dict[str, collections.Counter]:
    """nvdisasm -c output -> kernel name -> Counter of base opcodes (LDG.E.128 counts as LDG)."""
    counts: dict[str, collections.Counter] = {}
    current = None
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            current = counts.setdefault(m.group(1), collections.Counter())
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            current[m.group(1)] += 1
    return counts


def _tool(name: str, env: str) -> str:
    found = os.environ.get(env) or shutil.which(name)
    if not found and shutil.which("nvcc"):
        beside = Path(shutil.which("nvcc")).parent / name
        found = str(beside) if beside.exists() else None
    if not found:
        sys.exit(f"sass_counts: {name} not found (set ${env}; see this script's docstring)")
    return found


def compile_counts(src: Path, include: Path, arch: str, defines: list[str]) -> dict[str, collections.Counter]:
    nvcc, nvdisasm = _tool("nvcc", "NVCC"), _tool("nvdisasm", "NVDISASM")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / (src.stem + ".cubin")
        proc = subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-O3", "-std=c++17", "-I", str(include),
                               *("-D" + d for d in defines), "-o", str(cubin), str(src)], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"sass_counts: nvcc failed on {src}:\n{proc.stderr}")
        out = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return parse_sass(out)


def counts_at_revision(rev: str, src: Path, arch: str, defines: list[str]) -> dict[str, collections.Counter]:
    """The same file compiled from the cuda/ directory of git revision ``rev``."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", rev, "cuda/"], capture_output=True,
                              text=True)
        names = proc.stdout.split()
        if proc.returncode or f"cuda/{src.name}" not in names:
            sys.exit(f"sass_counts: no cuda/{src.name} at revision {rev!r} {proc.stderr.strip()}".rstrip())
        for name in names:
            blob = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{name}"], capture_output=True, check=True)
            (Path(tmp) / Path(name).name).write_bytes(blob.stdout)
        return compile_counts(Path(tmp) / src.name, Path(tmp), arch, defines)


def report(now: dict[str, collections.Counter], base: dict[str, collections.Counter] | None, pattern: str,
           top: int) -> str:
    lines = []
    for name in sorted(k for k in now if re.search(pattern, k)):
        c = now[name]
        head = f"{name}: {sum(c.values())} instructions"
        if base is not None and name in base:
            head += f" (base {sum(base[name].values())})"
        lines.append(head)
        cells = []
        for op, n in c.most_common(top):
            was = f" ({base[name][op]})" if base is not None and name in base else ""
            cells.append(f"{op} {n}{was}")
        lines.append("    " + ", ".join(cells))
    return "\n".join(lines) if lines else f"no kernel matches {pattern!r}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", type=Path, help="a cuda/*.cu file")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a macro (NAME=VALUE), repeatable")
    ap.add_argument("--kernels", default="", help="regular expression on kernel names")
    ap.add_argument("--top", type=int, default=12, help="opcodes shown per kernel")
    ap.add_argument("--base", help="git revision to compare with (its base counts in brackets)")
    a = ap.parse_args(argv)
    src = a.src.resolve()
    now = compile_counts(src, src.parent, a.arch, a.defines)
    base = counts_at_revision(a.base, src, a.arch, a.defines) if a.base else None
    print(report(now, base, a.kernels, a.top))


if __name__ == "__main__":
    main()
