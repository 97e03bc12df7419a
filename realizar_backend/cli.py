"""`realizar`: serve, generate, pull, bench, loadtest, inspect, check."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from .errors import RealizarError


def _settings(args, **extra):
    from .settings import Settings
    return Settings.from_env(model=getattr(args, "model", None), backend=getattr(args, "backend", None),
                             context_length=getattr(args, "context_length", None), **extra)


def cmd_generate(args) -> int:
    from . import timeline
    from .engine.engine import Engine
    from .engine.sampling import SamplingParams

    timeline.mark("generate: imports done")
    # no guidance prewarm: a command-line generation has no grammar, and llguidance holds the GIL
    # for 0.2-3 s while it builds its vocabulary, which would delay the first token
    engine = Engine.from_settings(_settings(args, max_num_seqs=1), prewarm_guidance=False)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop or [],
                                repetition_penalty=args.repetition_penalty,
                                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
        if args.chat:
            ids = engine.prepare(None, params, messages=[{"role": "user", "content": args.prompt}])
        else:
            ids = engine.prepare(args.prompt, params)
        out = sys.stdout
        for piece in engine.generate_sync(ids, params):
            if piece.text:
                out.write(piece.text)
                out.flush()
        out.write("\n")
        timeline.mark("generate: done")
    finally:
        engine.shutdown()
        timeline.mark("generate: engine shut down")
    return 0


def _model_path(args) -> Path:
    from .model.default import default_model_path
    return Path(args.model) if args.model else default_model_path(_settings(args))


def cmd_pull(args) -> int:
    """Fetch the default model into the model cache now (checking the sha256 of a copy already
    there) and print where it is."""
    from .model.default import DEFAULT_MODEL, fetch, model_cache
    from .settings import Settings
    print(fetch(DEFAULT_MODEL, model_cache(Settings.from_env()), verify=True))
    return 0


def cmd_inspect(args) -> int:
    from .formats import open_model
    mf = open_model(_model_path(args))
    c = mf.config
    info = {
        "path": str(mf.path), "format": mf.format, "name": mf.name, "architecture": c.arch,
        "layers": c.n_layers, "hidden": c.hidden, "heads": c.n_heads, "kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "ffn": c.ffn_dim, "vocab": c.vocab_size, "context_length": c.context_length,
        "rope": f"{c.rope_style}, theta {c.rope_theta:g}" + (f", {c.rope_scaling.describe()}" if c.rope_scaling else ""),
        "tied_embeddings": c.tie_embeddings,
        "qkv_bias": c.qkv_bias, "qk_norm": c.qk_norm,
        "tokenizer": mf.metadata.get("tokenizer.ggml.model", "tokenizer.json" if mf.tokenizer_json else "?"),
        "tokenizer_pre": mf.metadata.get("tokenizer.ggml.pre"),
        "chat_template": bool(mf.metadata.get("tokenizer.chat_template") or mf.tokenizer_config.get("chat_template")),
        "tensors": len(mf.tensors), "tensor_bytes": mf.total_bytes, "quant_mix": mf.quant_mix(),
    }
    if c.n_experts:
        info["experts"] = f"{c.n_experts_used} of {c.n_experts} per token, FFN {c.expert_ffn_dim}" + (
            f", a shared expert of FFN {c.shared_expert_ffn_dim}" if c.shared_expert_ffn_dim else "")
    if c.has_recurrent_state:
        info["recurrent_layers"] = sum(c.recurrent)
        info["state_bytes_per_sequence"] = c.recurrent_state_bytes
    # which backend runs what: the NumPy backend every type it reads; the GPU's own table (support.py)
    from .backends.cuda import support
    gpu = support.gpu_types(mf)
    info["backends_by_type"] = {t: ["cpu", "cuda"] if gpu.get(t, True) else ["cpu"] for t in info["quant_mix"]}
    info["gpu"] = support.refusal(mf) or "runs"
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            if k in ("tensor_bytes", "state_bytes_per_sequence"):
                v = f"{v:,} ({v / 2**20:.1f} MiB)"
            elif k == "backends_by_type":
                v = ", ".join(f"{t}: {'+'.join(b)}" for t, b in v.items())
            elif k == "quant_mix":
                v = ", ".join(f"{t} x{n}" for t, n in v.items())
            print(f"{k:24} {v}")
    return 0


def cmd_check(args) -> int:
    """Open the model, build the chosen backend (which runs its self-check) and run one step."""
    import numpy as np
    from .backends import PrefillItem, create_backend
    from .engine.kv_manager import KVManager
    from .formats import open_model
    mf = open_model(_model_path(args))
    backend = create_backend(mf, _settings(args, max_num_seqs=1).replace(context_length=64))
    ids = np.array([1, 2, 3], dtype=np.int32)
    kv = KVManager(backend.num_blocks, backend.block_size)
    kv.allocate(0, lambda a, b: ids[a:b], len(ids))
    backend.set_block_table(0, kv.table(0))
    logits = backend.prefill([PrefillItem(0, ids, 0)])
    ok = bool(np.isfinite(logits).all())
    print(f"{mf.path}: {mf.config.arch}, {backend.name} backend, logits finite: {ok}")
    backend.close()
    return 0 if ok else 1


def cmd_bench(args) -> int:
    from .bench import run_bench
    return run_bench(args)


def cmd_loadtest(args) -> int:
    from .loadtest import run_loadtest
    return run_loadtest(args)


def cmd_serve(args) -> int:
    """`bentoml serve` of the packaged service, with this command's options as settings."""
    env = dict(os.environ)
    if args.model:
        env["REALIZAR_MODEL"] = str(Path(args.model).resolve())
    if args.backend:
        env["REALIZAR_BACKEND"] = args.backend
    if args.context_length:
        env["REALIZAR_CONTEXT_LENGTH"] = str(args.context_length)
    cmd = [sys.executable, "-m", "bentoml", "serve", "realizar_backend.serving.service:Realizar",
           "--host", args.host, "--port", str(args.port)]
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


MODEL_HELP = ("a .gguf file or a safetensors directory (default: SmolLM2-135M-Instruct, fetched into the "
              "model cache on first use)")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, where it has one its help does not name."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings
                or any(action.default is v for v in (None, False, argparse.SUPPRESS))):
            return text
        return super()._get_help_string(action)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"realizar {version('realizar-backend')}"
    except PackageNotFoundError:      # run from a checkout that is not installed
        return "realizar (not installed)"


def build_parser() -> argparse.ArgumentParser:
    # -v is accepted before and after the command: the command's copy only sets it when given
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log at INFO (default: warnings only)")
    ap = argparse.ArgumentParser(prog="realizar", description=__doc__, formatter_class=_Help)
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO (else warnings only)")
    ap.add_argument("--version", action="version", version=_version())
    sub = ap.add_subparsers(dest="cmd", required=True)

    def command(name: str, help: str):
        return sub.add_parser(name, help=help, description=help, parents=[verbose], formatter_class=_Help)

    def model_opts(p):
        # the model as the last positional argument or as --model, alike for every command
        p.add_argument("model", nargs="?", help=MODEL_HELP)
        p.add_argument("--model", dest="model_option", metavar="MODEL", help="the same, as an option")
        p.add_argument("--backend", choices=["auto", "cuda", "cpu"],
                       help="auto: CUDA where CuPy sees a GPU, else the NumPy backend (default: REALIZAR_BACKEND, auto)")
        p.add_argument("--context-length", type=int,
                       help="positions per sequence (default: REALIZAR_CONTEXT_LENGTH, 0: the model's own)")

    g = command("generate", "stream a completion to stdout")
    g.add_argument("prompt", help="the prompt text")
    model_opts(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens with this "
                                                           "much probability")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="divide the logits of tokens seen so far")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from tokens generated so far")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract per time a token was generated")
    g.add_argument("--seed", type=int, help="sampling seed (default: a random one)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.set_defaults(func=cmd_generate)

    i = command("inspect", "architecture, dims, tokenizer and quant mix of a model")
    model_opts(i)
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=cmd_inspect)

    c = command("check", "load a model on a backend and run one step")
    model_opts(c)
    c.set_defaults(func=cmd_check)

    b = command("bench", "prefill and decode speed (llama-bench-like)")
    model_opts(b)
    b.add_argument("--prompt-tokens", type=int, default=512, help="prompt length of the prefill test (pp)")
    b.add_argument("--gen-tokens", type=int, default=128, help="decode steps of the generation test (tg)")
    b.add_argument("--repetitions", type=int, default=5, help="runs of each test (the median is reported)")
    b.add_argument("--batch", type=int, default=1, help="concurrent sequences decoding together")
    b.add_argument("--depth", type=int, default=0,
                   help="tokens already in each sequence's context when the timed decode starts "
                        "(llama-bench -d); below 8, 8")
    b.add_argument("--constrained", choices=["all", "half"],
                   help="also decode with a JSON schema on every row (all) or on every other row (half), "
                        "beside the plain decode and the same batch sampled without masks")
    b.add_argument("--schema", help="the JSON schema file for --constrained (default: a small nested object)")
    b.add_argument("--json", help="write the results as JSON to this file")
    b.set_defaults(func=cmd_bench)

    lt = command("loadtest", "concurrent streaming OpenAI clients against a running server")
    lt.add_argument("url", help="the server's address, e.g. http://localhost:3000")
    lt.add_argument("--clients", type=int, default=8, help="concurrent streams")
    lt.add_argument("--requests", type=int, default=64, help="requests in all")
    lt.add_argument("--duration", type=float, default=600.0,
                    help="time limit in seconds; streams still open then are closed")
    lt.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of each request")
    lt.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    lt.add_argument("--model", help="the served model's id (default: the first of /v1/models)")
    lt.add_argument("--api-key", help="the server's API key")
    lt.add_argument("--mode", choices=["completions", "chat"], default="completions",
                    help="completions: token-id prompts of exactly --prompt-tokens; chat: random words")
    lt.add_argument("--random-cancel", type=float, default=0.0, metavar="FRACTION",
                    help="close this fraction of the streams at a random point")
    lt.add_argument("--seed", type=int, default=0,
                    help="seeds the prompts and the cancels (a run with the seed of an earlier one against the same "
                         "server finds its prompts in the prefix cache)")
    lt.add_argument("--no-ignore-eos", action="store_true",
                    help="leave out ignore_eos (for servers that reject it): outputs may end early")
    lt.add_argument("--processes", type=int, default=0,
                    help="client processes the clients are spread over (0: one per 4 clients, at most the CPUs)")
    lt.add_argument("--json", help="write the report as JSON to this file")
    lt.add_argument("--requests-out", metavar="FILE",
                    help="write one JSON line per request (start, first token, end of stream, close: Unix epoch "
                         "seconds; status, tokens) to this file")
    lt.set_defaults(func=cmd_loadtest)

    p = command("pull", "fetch the default model (SmolLM2-135M-Instruct) into the model cache "
                        "(REALIZAR_MODEL_CACHE) and print its path")
    p.set_defaults(func=cmd_pull)

    s = command("serve", "serve the OpenAI-compatible API with BentoML")
    model_opts(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on; 0.0.0.0 for every interface (then set REALIZAR_API_KEY)")
    s.add_argument("--port", type=int, default=3000, help="the port to listen on")
    s.set_defaults(func=cmd_serve)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if "model_option" in vars(args):
        given = {m for m in (args.model, args.model_option) if m}
        if len(given) > 1:
            ap.error(f"two models given: {args.model} and --model {args.model_option}")
        args.model = args.model or args.model_option
        del args.model_option
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.cmd == "generate":
        import atexit

        from . import timeline
        # registered first, so it runs after every other exit hook: what follows is the
        # interpreter's own teardown (and the CUDA context's)
        atexit.register(timeline.mark, "exit hooks done")
    # a first use of the default model downloads 98 MB: always say so
    logging.getLogger("realizar_backend.model.default").setLevel(logging.INFO)
    try:
        return args.func(args)
    except (RealizarError, ValueError) as e:
        print(f"realizar: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
