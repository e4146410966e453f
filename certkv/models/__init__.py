"""Model glue: loading (hub id, local dir, GGUF, tiny random) and the transformers hook."""

from certkv.models.hook import cache_kwargs, certkv_attention, enable, register
from certkv.models.loading import SMOLLM2, LoadedModel, ModelSpec, load_model, load_tokenizer

__all__ = ["SMOLLM2", "LoadedModel", "ModelSpec", "cache_kwargs", "certkv_attention", "enable",
           "load_model", "load_tokenizer", "register"]
