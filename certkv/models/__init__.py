"""Model glue: loading (hub id, local dir, GGUF, tiny random) and the transformers hook."""

from certkv.models.hook import certkv_attention, enable, register
from certkv.models.loading import LoadedModel, ModelSpec, load_model

__all__ = ["LoadedModel", "ModelSpec", "certkv_attention", "enable", "load_model", "register"]
