#!/usr/bin/env python3
"""Shape twins of Qwen2.5-7B-Instruct in more quant mixes (Q6_K, IQ4_XS, a UD-Q4_K_XL-style mix), and
the expansion of any twin whose types shared/tools/twin_expand.py does not know (the I-quants).

    python tools/make_quant_twins.py make [--out .twins] [NAME ...]     # NAME.head.gz + NAME.json
    python tools/make_quant_twins.py expand PREFIX OUT.gguf             # a full file, random valid blocks

`make` builds on shared/tools/make_bigtwins.py (the real config, metadata keys, tokenizer from the
qwen15 header, chat template from llama.cpp's copy, tensor order and offsets, the check through
GGUFReader) and replaces only its choice of each tensor's type:
- qwen7_q6k (LLAMA_FTYPE_MOSTLY_Q6_K): llama.cpp src/llama-quant.cpp gives every matrix Q6_K (no
  rule moves a Q6_K tensor; the output stays Q6_K);
- qwen7_iq4xs (LLAMA_FTYPE_MOSTLY_IQ4_XS, made with an importance matrix as published files are):
  IQ4_XS, attn_v Q5_K (n_gqa 7 >= 4), output Q6_K; without an imatrix the first n_layer/8
  ffn_down would be Q5_K (the rule is `!qs.has_imatrix`);
- qwen7_udq4kxl: a UD-Q4_K_XL-style mix. Unsloth publishes no recipe, so this one is a stated rule
  set in its manner (llama-quantize's --tensor-type overrides on the Q4_K_M rules): token_embd Q8_0;
  attn_k and attn_v Q6_K; attn_q Q4_K; attn_output Q5_K on llama.cpp's use_more_bits layers, IQ4_XS
  on the others; ffn_gate and ffn_up Q4_K on use_more_bits layers, IQ4_XS on the others (a layer's
  gate and up share a type); ffn_down Q6_K on use_more_bits layers, Q5_K on the others; output Q6_K.
`expand` is twin_expand.py's format (NAME.head or NAME.head.gz, NAME.json) with every block type
of realizar_backend.formats.quants.random_blocks (valid random blocks, small finite scales).

llama.cpp's source: --llama-cpp DIR (a tree with models/templates), else make_bigtwins fetches the
llama-cpp-python sdist with pip. --shared: the shared tools and models (default ../shared beside
the repository, then /work/shared).
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from realizar_backend.formats.quants import random_blocks  # noqa: E402

CHUNK_BLOCKS = 1 << 21     # blocks generated at a time (bounded memory for multi-GB tensors)
# llama_ftype values (llama.h); a UD file states the ftype of the mix it extends
FTYPES = {"Q6_K": (18, Q.Q6_K), "IQ4_XS": (30, Q.IQ4_XS), "UD-Q4_K_XL": (15, Q.Q4_K)}
TWINS = {"qwen7_q6k": "Q6_K", "qwen7_iq4xs": "IQ4_XS", "qwen7_udq4kxl": "UD-Q4_K_XL"}


def shared_dir(arg: str | None) -> Path:
    for d in ([Path(arg)] if arg else []) + [REPO.parent / "shared", Path("/work/shared")]:
        if (d / "tools" / "make_bigtwins.py").is_file():
            return d
    raise SystemExit("make_bigtwins.py not found: pass --shared DIR (the directory holding tools/ and models/)")


def load_bigtwins(shared: Path):
    spec = importlib.util.spec_from_file_location("make_bigtwins", shared / "tools" / "make_bigtwins.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class MixPicker:
    """llama-quant.cpp's llama_tensor_get_type for the mixes above (the same interface as
    make_bigtwins.QuantState: pick(name, ne) in the order llama-quantize visits the tensors)."""

    def __init__(self, s: dict, names: list[str]):
        self.ftype = s["ftype"]
        self.default = FTYPES[self.ftype][1]
        self.n_layer = s["n_layer"]
        self.n_gqa = s["heads"] // s["kv"]
        self.has_imatrix = True             # as published IQ4_XS and UD files are made
        self.i_ffn_down = 0

    @staticmethod
    def allows_quantization(name: str, ne) -> bool:
        return (len(ne) >= 2 and name.endswith("weight") and "_norm.weight" not in name
                and "ffn_gate_inp.weight" not in name)

    def _more_bits(self, name: str) -> bool:
        i = int(name.split(".")[1])
        n = self.n_layer
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    def pick(self, name: str, ne) -> Q:
        if not self.allows_quantization(name, ne):
            return Q.F32
        t = self.default
        if name == "output.weight":
            t = Q.Q8_0 if ne[0] % GGML_QUANT_SIZES[t][0] else Q.Q6_K
        elif self.ftype == "IQ4_XS":
            if "attn_v.weight" in name and self.n_gqa >= 4:
                t = Q.Q5_K
            elif "ffn_down" in name:
                if self.i_ffn_down < self.n_layer // 8 and not self.has_imatrix:
                    t = Q.Q5_K
                self.i_ffn_down += 1
        elif self.ftype == "UD-Q4_K_XL":
            t = self._ud(name, t)
        if ne[0] % GGML_QUANT_SIZES[t][0]:           # tensor_type_fallback
            t = {Q.IQ4_XS: Q.IQ4_NL, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}.get(t, t)
            if ne[0] % GGML_QUANT_SIZES[t][0]:
                t = Q.F16
        return t

    def _ud(self, name: str, t: Q) -> Q:
        if name == "token_embd.weight":
            return Q.Q8_0
        if not name.startswith("blk."):
            return t
        more = self._more_bits(name)
        if "attn_k.weight" in name or "attn_v.weight" in name:
            return Q.Q6_K
        if "attn_output.weight" in name:
            return Q.Q5_K if more else Q.IQ4_XS
        if "ffn_gate" in name or "ffn_up" in name:
            return Q.Q4_K if more else Q.IQ4_XS
        if "ffn_down" in name:
            return Q.Q6_K if more else Q.Q5_K
        return t


def make(args) -> None:
    shared = shared_dir(args.shared)
    mb = load_bigtwins(shared)
    mb.FTYPES.update(FTYPES)
    mb.QuantState = MixPicker
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        llama_cpp = mb.llama_cpp_source(args.llama_cpp, Path(tmp))
        qwen = mb.qwen_source(shared / "models" / "qwen15")
        for name in args.names:
            spec = dict(mb.SPECS["qwen7"], ftype=TWINS[name])
            info = mb.build(name, spec, out, qwen, None, llama_cpp)
            mb.check(out, name)
            head = out / f"{name}.head"
            (out / f"{name}.head.gz").write_bytes(gzip.compress(head.read_bytes(), 9, mtime=0))
            head.unlink()
            print(json.dumps(info))


def expand(prefix: str, dst: str) -> None:
    meta = json.loads(Path(prefix + ".json").read_text())
    rng = np.random.default_rng(0)
    head = Path(prefix + ".head")
    with open(dst, "wb") as f:
        f.write(head.read_bytes() if head.exists() else gzip.decompress(Path(str(head) + ".gz").read_bytes()))
        for t in meta["tensors"]:
            f.seek(t["offset"])
            n, typ = t["nbytes"], Q[t["type"]]
            if typ == Q.F32:                               # norms ~1, biases small
                v = 0.02 * rng.standard_normal(n // 4) + (0.0 if t["name"].endswith(".bias") else 1.0)
                f.write(v.astype(np.float32).tobytes())
            elif typ == Q.F16:
                f.write((0.02 * rng.standard_normal(n // 2)).astype(np.float16).tobytes())
            else:
                size = GGML_QUANT_SIZES[typ][1]
                nb = n // size
                for s in range(0, nb, CHUNK_BLOCKS):
                    f.write(random_blocks(typ, min(CHUNK_BLOCKS, nb - s), rng, scale=(0.0005, 0.0025)).tobytes())
        f.truncate(meta["total"])
    print("wrote", dst, os.path.getsize(dst))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write NAME.head.gz + NAME.json")
    m.add_argument("names", nargs="*", default=list(TWINS), help=f"twins to make (default all: {', '.join(TWINS)})")
    m.add_argument("--out", default=str(REPO / ".twins"))
    m.add_argument("--shared", help="the shared directory (tools/make_bigtwins.py, models/qwen15.*)")
    m.add_argument("--llama-cpp", help="a llama.cpp source tree (default: fetch the llama-cpp-python sdist)")
    e = sub.add_parser("expand", help="PREFIX (NAME.head[.gz] + NAME.json) -> a full GGUF")
    e.add_argument("prefix")
    e.add_argument("out")
    args = ap.parse_args()
    if args.cmd == "make":
        unknown = set(args.names) - set(TWINS)
        if unknown:
            ap.error(f"unknown twins {sorted(unknown)}; known: {', '.join(TWINS)}")
        make(args)
    else:
        expand(args.prefix, args.out)


if __name__ == "__main__":
    main()
