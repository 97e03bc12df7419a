"""Prebuild every kernel module the CUDA loader builds, for the GPUs in catalog.ARCHS, with the local
nvcc: realizar_backend/kernels/cubin/<arch>/*.cubin.xz and cubin/manifest.json. Run it after any change
to realizar_backend/kernels/ (tests/kernels/test_prebuilt_kernels.py says when):

    python tools/build_kernels.py              # incremental: only modules whose source changed
    python tools/build_kernels.py --force      # everything again

Deterministic (same sources and nvcc: same files, same manifest); compiles on every core.
The loader uses a cubin only where its key (source text + options) matches what it would compile,
and the driver is at least the CUDA version of the nvcc that built it; otherwise NVRTC compiles.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realizar_backend.kernels import catalog  # noqa: E402


# files whose modules take longest to compile (gemv.cu: ~65 s per arch on one core)
SLOW = ("gemv.cu", "mmvq.cu", "mmvf.cu", "dequant.cu", "sampling.cu", "attention.cu", "prefill.cu")


def nvcc_version(nvcc: str) -> tuple[str, int]:
    """('13.0.88', 13000): the release and the CUDA version number the driver must support."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    full = re.search(r"V(\d+)\.(\d+)\.(\d+)", out)
    major, minor = int(full.group(1)), int(full.group(2))
    return ".".join(full.groups()), major * 1000 + minor * 10


def plan(release: str) -> list[dict]:
    """One entry per module and arch, in a fixed order. A file's name holds a hash of the module's
    key and of the compiler (release and flags), so a file that exists is up to date."""
    entries = []
    sources = {}
    for arch in catalog.ARCHS:
        cc = arch.removeprefix("sm_")
        for name, extra in catalog.variants():
            text = sources.setdefault(name, catalog.source(name))
            options = list(catalog.base_options(cc) + extra)
            key = catalog.module_key(text, options)
            tag = hashlib.sha256(" ".join([key, release, *catalog.NVRTC_IMPLIED]).encode()).hexdigest()[:16]
            entries.append({"file": name, "options": options, "arch": arch, "key": key,
                            "cubin": f"{arch}/{Path(name).stem}-{tag}.cubin.xz"})
    return entries


def compile_one(nvcc: str, entry: dict, work: Path) -> tuple[bytes, dict]:
    """nvcc on one module: (its xz-compressed cubin, {kernels, cubin_bytes, seconds, warnings})."""
    t0 = time.perf_counter()
    d = work / entry["key"]
    d.mkdir()
    (d / entry["file"]).write_text(catalog.source(entry["file"]))   # the same name in every build
    cmd = [nvcc, "-cubin", f"-arch={entry['arch']}", *catalog.NVRTC_IMPLIED, *entry["options"], "-o", "module.cubin",
           entry["file"]]
    r = subprocess.run(cmd, cwd=d, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"nvcc failed on {entry['file']} {' '.join(entry['options'])} ({entry['arch']}):\n"
                         f"{r.stderr}")
    cubin = (d / "module.cubin").read_bytes()
    info = {"kernels": catalog.cubin_kernels(cubin), "cubin_bytes": len(cubin),
            "seconds": time.perf_counter() - t0, "warnings": r.stderr.strip()}
    return lzma.compress(cubin, preset=9 | lzma.PRESET_EXTREME), info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="rebuild every module, not only changed ones")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    args = ap.parse_args()

    release, cuda_version = nvcc_version(args.nvcc)
    old = catalog.manifest()
    entries = plan(release)
    todo = [e for e in entries if args.force or not (catalog.CUBIN_DIR / e["cubin"]).is_file()]
    for arch in catalog.ARCHS:
        (catalog.CUBIN_DIR / arch).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"nvcc {release}: {len(entries)} modules for {', '.join(catalog.ARCHS)}; {len(todo)} to compile "
          f"on {args.jobs} jobs", flush=True)
    with tempfile.TemporaryDirectory() as work, ThreadPoolExecutor(args.jobs) as pool:
        # the slowest first, so that no long compile starts last
        todo.sort(key=lambda e: (SLOW.index(e["file"]) if e["file"] in SLOW else len(SLOW), e["arch"]))
        known = {m["cubin"]: m for m in old.get("modules", ())}
        for entry, (packed, info) in zip(todo, pool.map(lambda e: compile_one(args.nvcc, e, Path(work)), todo)):
            out = catalog.CUBIN_DIR / entry["cubin"]
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_bytes(packed)
            tmp.replace(out)
            known[entry["cubin"]] = info
            print(f"  {info['seconds']:5.1f} s  {entry['cubin']}  {' '.join(entry['options'][1:])}", flush=True)
            if info["warnings"]:
                print("    " + info["warnings"].replace("\n", "\n    "), flush=True)
    for e in entries:
        k = known.get(e["cubin"], {})
        if "kernels" not in k or "cubin_bytes" not in k:      # a file without a manifest entry
            cubin = lzma.decompress((catalog.CUBIN_DIR / e["cubin"]).read_bytes())
            k = {"kernels": catalog.cubin_kernels(cubin), "cubin_bytes": len(cubin)}
        e["kernels"] = k["kernels"]
        e["cubin_bytes"] = k["cubin_bytes"]
        e["xz_bytes"] = (catalog.CUBIN_DIR / e["cubin"]).stat().st_size
    keep = {e["cubin"] for e in entries}
    for stale in catalog.CUBIN_DIR.glob("sm_*/*"):
        if f"{stale.parent.name}/{stale.name}" not in keep:
            stale.unlink()
    for d in catalog.CUBIN_DIR.glob("sm_*"):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    doc = {"nvcc": release, "cuda_version": cuda_version, "nvcc_flags": list(catalog.NVRTC_IMPLIED),
           "archs": list(catalog.ARCHS), "modules": entries}
    catalog.MANIFEST.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"{catalog.MANIFEST}: {len(entries)} modules, {sum(e['xz_bytes'] for e in entries) / 1e6:.2f} MB "
          f"({sum(e['cubin_bytes'] for e in entries) / 1e6:.1f} MB of cubins), {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
