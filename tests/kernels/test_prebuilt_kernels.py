"""The prebuilt kernel modules (realizar_backend/kernels/cubin, made by tools/build_kernels.py)
match the kernel sources as they are now: a kernel edited without rebuilding them fails here. The
loader would not use a stale cubin (its key is the source text), but every GPU start would then
compile with NVRTC again."""

from __future__ import annotations

import importlib.util
import lzma
import shutil
from pathlib import Path

import pytest

from realizar_backend.kernels import catalog

REPO = Path(__file__).resolve().parents[2]
REBUILD = "the prebuilt kernels are stale: run `python tools/build_kernels.py` and commit kernels/cubin"


def _tool():
    spec = importlib.util.spec_from_file_location("build_kernels", REPO / "tools" / "build_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_manifest_matches_the_kernel_sources():
    shipped = {m["key"]: m for m in catalog.manifest().get("modules", ())}
    assert shipped, f"no kernels/cubin/manifest.json: {REBUILD}"
    assert catalog.manifest()["nvcc_flags"] == list(catalog.NVRTC_IMPLIED), REBUILD
    wanted = _tool().plan(catalog.manifest()["nvcc"])
    missing = [f"{e['arch']} {e['file']} {' '.join(e['options'][2:])}" for e in wanted if e["key"] not in shipped]
    assert not missing, f"{REBUILD} (no cubin of the current source for: {missing})"
    extra = set(shipped) - {e["key"] for e in wanted}
    assert not extra, f"{REBUILD} (cubins of sources or variants that are gone: " \
                      f"{sorted(shipped[k]['cubin'] for k in extra)})"
    for e in wanted:
        assert (catalog.CUBIN_DIR / shipped[e["key"]]["cubin"]).is_file(), f"{e['cubin']} missing: {REBUILD}"
    on_disk = {f"{p.parent.name}/{p.name}" for p in catalog.CUBIN_DIR.glob("sm_*/*")}
    assert on_disk == {m["cubin"] for m in shipped.values()}, f"files beside the manifest's: {REBUILD}"


def test_every_kernel_source_is_prebuilt():
    built = {name for name, _ in catalog.variants()}
    sources = {p.name for p in catalog.KERNEL_DIR.glob("*.cu")}
    assert sources - built == set(), ("kernel files no prebuilt module is made of: add the modules the loader "
                                      "builds from them to kernels/catalog.py variants(), then run "
                                      "`python tools/build_kernels.py`")
    assert built <= sources


def test_cubins_hold_the_kernels_the_loader_asks_for():
    mods = catalog.manifest()["modules"]
    assert {m["arch"] for m in mods} == set(catalog.ARCHS)
    for m in mods:
        cubin = lzma.decompress((catalog.CUBIN_DIR / m["cubin"]).read_bytes())
        assert len(cubin) == m["cubin_bytes"]
        assert catalog.cubin_kernels(cubin) == m["kernels"], m["cubin"]
        opts = dict(o[2:].split("=", 1) for o in m["options"] if o.startswith("-D"))
        assert opts["REALIZAR_CC"] == m["arch"].removeprefix("sm_")
        names = set(m["kernels"])
        if m["file"] == "mmvf.cu":
            assert names == {f"{'mmvf' if opts['MMVF_KIND'] == '1' else 'ffnf'}_nb{opts['MMVF_NB']}"}
        elif m["file"] == "mmv8.cu":
            assert names == {"1": {"mmv8_nb1", "mmv8_q8"}, "2": {"ffn8_nb1"},
                             "3": {"moe8_gate_up_nb1", "moe8_gemv_nb1", "moe8_down_combine_nb1"}}[opts["MMV8_KIND"]]
        elif m["file"] == "attention.cu":
            assert names == {catalog.ATT_KINDS[int(opts["ATT_KIND"]) - 1]}
        elif m["file"] == "dequant.cu":     # every quant type (no mask)
            for sfx in ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"):
                assert {f"dequant_{sfx}", f"embed_{sfx}"} <= names, (m["cubin"], sfx)
        elif m["file"] == "gemv.cu":        # the float types only: the quantized ones take mmvf.cu
            assert names == {f"{k}_{sfx}" for k in ("gemv", "ffn_gate_up") for sfx in ("f32", "f16", "bf16")}
        elif m["file"] == "norm.cu":
            assert names == {"rms_norm"}
        elif m["file"] == "mmq.cu" and opts.get("MMQ_A8") == "1":   # the 8-bit variant, its grouped experts too
            bn = opts["MMQ_BN"]
            assert names == ({"mmq8_prep"} if bn == "0" else {f"mmq8_bn{bn}", f"mmq8_moe_bn{bn}"}), m["cubin"]
    total = sum(m["xz_bytes"] for m in mods)
    print(f"{len(mods)} prebuilt modules, {total / 1e6:.2f} MB compressed, "
          f"{sum(m['cubin_bytes'] for m in mods) / 1e6:.1f} MB of cubins")


def test_a_model_specific_request_finds_the_general_module():
    """The loader asks with the model's quant mask and head size; the general prebuilt module (no
    mask, or no fixed head size) serves such a request, an exact one wins where it ships. The
    decode GEMVs (QMASK_EXACT) are never served by a module of another mask."""
    arch = catalog.ARCHS[-1]
    cc = arch.removeprefix("sm_")
    base = catalog.base_options(cc)
    by_key = {m["key"]: m for m in catalog.manifest()["modules"]}

    def found(name, *extra):
        hit = catalog.find_prebuilt(catalog.source(name), base + extra)
        return None if hit is None else (by_key[catalog.module_key(catalog.source(name), hit[1])], hit[1])

    mask = catalog.qmask_option([12, 14])                   # Q4_K + Q6_K
    ffnf1 = catalog.mmvf_options(1, 2)                      # the batch-1 gate/up module's options
    m, used = found("mmvf.cu", mask, *ffnf1)
    assert m["arch"] == arch and used == base + (mask, *ffnf1)             # shipped for this mask
    assert m["kernels"] == ["ffnf_nb1"]
    odd = catalog.qmask_option([2, 14])                     # Q4_0 + Q6_K: no decode GEMV of its own ships
    gemv = (catalog.source("mmvf.cu"), base + (odd, *ffnf1))
    assert "mmvf.cu" in catalog.QMASK_EXACT
    assert catalog.find_prebuilt(*gemv, keep_mask=True) is None          # the loader compiles it for its mask
    assert catalog.find_prebuilt(*gemv)[1] == base + ffnf1
    for m in catalog.PREBUILT_QMASKS:
        for nb in catalog.MMV_NB:
            hit = catalog.find_prebuilt(catalog.source("mmvf.cu"),
                                        base + (catalog.qmask_option(m), *catalog.mmvf_options(nb, 1)), keep_mask=True)
            assert hit is not None and hit[1][2] == catalog.qmask_option(m), (m, nb)
        hit = catalog.find_prebuilt(catalog.source("mmqs.cu"), base + (catalog.qmask_option(m),), keep_mask=True)
        assert hit is not None and hit[1][2] == catalog.qmask_option(m), m
    m, used = found("attention.cu", "-DATT_KIND=1", "-DATT_HEAD_DIM=128")
    assert used == base + ("-DATT_KIND=1", "-DATT_HEAD_DIM=128")           # shipped exactly
    m, used = found("attention.cu", "-DATT_KIND=1", "-DATT_HEAD_DIM=96")
    assert used == base + ("-DATT_KIND=1",) and m["kernels"] == ["attn_decode"]
    m, used = found("prefill.cu", mask)
    assert used == base
    m, used = found("mmq.cu", mask, "-DMMQ_A8=1", "-DMMQ_BN=64")           # the loader's 8-bit tiles
    assert used == base + ("-DMMQ_A8=1", "-DMMQ_BN=64") and set(m["kernels"]) == {"mmq8_bn64", "mmq8_moe_bn64"}
    # the arch is part of the key: no module of another GPU is taken, except one of the same major
    # and a lower minor, whose machine code the GPU runs (sm_80 on 8.6 and 8.9)
    norm = catalog.source("norm.cu")
    for cc in ("75", "100", "120"):
        assert catalog.find_prebuilt(norm, catalog.base_options(cc)) is None, cc
    for cc in ("86", "89"):
        path, used = catalog.find_prebuilt(norm, catalog.base_options(cc))
        assert used == catalog.base_options("80") and path.parent.name == "sm_80"
        path, used = catalog.find_prebuilt(catalog.source("attention.cu"),
                                           catalog.base_options(cc) + ("-DATT_KIND=1", "-DATT_HEAD_DIM=96"))
        assert used == catalog.base_options("80") + ("-DATT_KIND=1",)
    assert catalog.find_prebuilt(catalog.source("norm.cu") + "\n// edited", base) is None


def test_the_tool_rebuilds_a_module_byte_for_byte(tmp_path):
    """Deterministic: the tool's nvcc run on one (small) module gives the file that ships."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    tool = _tool()
    if tool.nvcc_version(shutil.which("nvcc"))[0] != catalog.manifest()["nvcc"]:
        pytest.skip("another nvcc than the one that built the shipped cubins")
    entry = next(e for e in tool.plan(catalog.manifest()["nvcc"]) if e["file"] == "rope.cu"
                 and e["arch"] == catalog.ARCHS[-1])
    packed, info = tool.compile_one(shutil.which("nvcc"), entry, tmp_path)
    assert packed == (catalog.CUBIN_DIR / entry["cubin"]).read_bytes(), REBUILD
    assert info["kernels"] == ["rope_kv"] and info["warnings"] == ""
