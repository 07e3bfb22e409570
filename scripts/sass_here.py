#!/usr/bin/env python3
"""SASS of this build's CUDA kernels on a machine without a GPU or cuobjdump 13.

nvcc 13.0 here ships without cuobjdump and nvdisasm. Debian 12's non-free nvidia-cuda-toolkit
(CUDA 11.8) has both, and 11.8 decodes sm_90, but it rejects CUDA 13's cubins only for their ELF
header (ABI version 8 moved the SM number in e_flags). This script takes the sm_90 cubins out of
an object file's .nv_fatbin (stored uncompressed), rewrites the two header fields to the older
layout, and runs 11.8's cuobjdump on them: a table of what each kernel's SASS holds
(instructions, local-memory spill stores STL and loads LDL), or the SASS itself.

  scripts/sass_here.py OBJ.o                  # table: kernel, instructions, STL, LDL
                                              # (OBJ.o: an object file, or a cubin from
                                              # nvcc -cubin -arch=sm_90, whose SASS is never
                                              # compressed as large objects' fatbins are)
  scripts/sass_here.py OBJ.o --dump REGEX     # the SASS of the kernels whose name matches

The tools are fetched once into .sass-tools/ (git-ignored; ~85 MB download from Debian's
bookworm non-free). A reading aid, not a build step: the bytes are 13.0's, only the decoder is
older, so an instruction 11.8 cannot decode would show as unknown.
"""
import argparse
import os
import re
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, ".sass-tools")
CUOBJDUMP = os.path.join(TOOLS, "usr", "bin", "cuobjdump")


def fail(msg):
    print(f"sass_here: {msg}", file=sys.stderr)
    sys.exit(1)


def fetch_tools():
    if os.path.exists(CUOBJDUMP):
        return
    os.makedirs(os.path.join(TOOLS, "lists", "partial"), exist_ok=True)
    src = os.path.join(TOOLS, "sources.list")
    with open(src, "w") as f:
        f.write("deb http://deb.debian.org/debian bookworm non-free\n")
    opts = [f"-oDir::Etc::SourceList={src}", "-oDir::Etc::SourceParts=/dev/null",
            f"-oDir::State::Lists={os.path.join(TOOLS, 'lists')}", "-oAPT::Sandbox::User=root"]
    for cmd in (["apt-get", *opts, "update"], ["apt-get", *opts, "download", "nvidia-cuda-toolkit"]):
        r = subprocess.run(cmd, cwd=TOOLS, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{' '.join(cmd[:1] + cmd[-2:])} failed: {r.stderr.strip().splitlines()[-1:]}")
    debs = [d for d in os.listdir(TOOLS) if d.startswith("nvidia-cuda-toolkit_") and d.endswith(".deb")]
    if not debs:
        fail("apt-get download left no nvidia-cuda-toolkit .deb in .sass-tools/")
    subprocess.run(["dpkg", "-x", os.path.join(TOOLS, debs[0]), TOOLS], check=True)
    if not os.path.exists(CUOBJDUMP):
        fail(f"{debs[0]} has no usr/bin/cuobjdump")


def elf_end(e):
    """Bytes the ELF image at the start of e spans (headers, sections, section table)."""
    phoff, = struct.unpack_from("<Q", e, 0x20)
    shoff, = struct.unpack_from("<Q", e, 0x28)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", e, 0x36)
    end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    for i in range(shnum):
        b = shoff + i * shentsize
        kind, = struct.unpack_from("<I", e, b + 4)
        off, size = struct.unpack_from("<QQ", e, b + 0x18)
        if kind != 8:  # SHT_NOBITS occupies no bytes
            end = max(end, off + size)
    return end


def cubins(obj, workdir):
    """The object's embedded cubins, their headers rewritten for CUDA 11.8's tools."""
    head = open(obj, "rb").read(20)
    if head[:4] == b"\x7fELF" and struct.unpack_from("<H", head, 18)[0] == 190:  # EM_CUDA
        data = open(obj, "rb").read()  # a cubin itself (nvcc -cubin)
    else:
        fatbin = os.path.join(workdir, "fatbin")
        r = subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", obj, fatbin],
                           capture_output=True, text=True)
        if r.returncode != 0 or not os.path.getsize(fatbin):
            fail(f"{obj}: no .nv_fatbin section (not a CUDA object file?)")
        data = open(fatbin, "rb").read()
    out = []
    for m in re.finditer(b"\x7fELF\x02\x01\x01", data):
        e = bytearray(data[m.start():])
        try:
            e = e[:elf_end(e)]
        except struct.error:
            continue
        abi, = struct.unpack_from("<B", e, 8)
        flags, = struct.unpack_from("<I", e, 0x30)
        sm = (flags >> 8) & 0xFF if abi >= 8 else flags & 0xFF
        if abi >= 8:
            e[8] = 7
            struct.pack_into("<I", e, 0x30, (sm << 16) | 0x500 | sm)
        path = os.path.join(workdir, f"sm{sm}_{len(out)}.cubin")
        open(path, "wb").write(e)
        out.append((sm, path))
    if not out:
        fail(f"{obj}: no cubin in .nv_fatbin (compressed: compile the file with nvcc -cubin "
             "-arch=sm_90 and pass the cubin)")
    return out


def functions(sass):
    """{kernel name: [instruction lines]} from cuobjdump -sass output."""
    funcs, name = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            funcs[name] = []
        elif name and re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
            funcs[name].append(line)
    return funcs


def demangle(names):
    r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return r.stdout.splitlines() if r.returncode == 0 else names


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("obj", help="an object file nvcc compiled (CMakeFiles/.../*.cu.o)")
    ap.add_argument("--dump", metavar="REGEX", help="print the SASS of the matching kernels")
    args = ap.parse_args()
    if not os.path.isfile(args.obj):
        fail(f"{args.obj}: no such file")
    fetch_tools()
    with tempfile.TemporaryDirectory() as workdir:
        for sm, path in cubins(args.obj, workdir):
            r = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True)
            if r.returncode != 0:
                fail(f"cuobjdump (11.8) on the sm_{sm} cubin: {r.stderr.strip()}")
            funcs = functions(r.stdout)
            names = list(funcs)
            pretty = dict(zip(names, demangle(names)))
            if args.dump:
                for n in names:
                    if re.search(args.dump, pretty[n]) or re.search(args.dump, n):
                        print(f"// {pretty[n]} (sm_{sm})")
                        print("\n".join(funcs[n]))
                continue
            print(f"sm_{sm}: {len(names)} kernels")
            print(f"{'instructions':>12} {'STL':>5} {'LDL':>5}  kernel")
            for n in sorted(names, key=lambda n: -len(funcs[n])):
                body = funcs[n]
                stl = sum(1 for s in body if re.search(r"\bSTL(\.\w+)*\s", s))
                ldl = sum(1 for s in body if re.search(r"\bLDL(\.\w+)*\s", s))
                print(f"{len(body):>12} {stl:>5} {ldl:>5}  {pretty[n][:110]}")


if __name__ == "__main__":
    main()
