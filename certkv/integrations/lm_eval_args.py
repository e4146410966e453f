"""A certkv method's config from lm-eval's model arguments (``model=``, ``experiment=`` and
config overrides): shared by the lm-eval model and its task folders."""

from __future__ import annotations

from certkv.errors import ConfigError, require


def _model_overrides(model: str) -> list[str]:
    """Hydra overrides that pick ``model``: a ``conf/model`` name, or a hub id / directory."""
    from certkv.config import config_groups
    from certkv.models.loading import missing_local_path

    if model in config_groups()["model"]:
        return [f"model={model}"]
    require(not missing_local_path(model), ConfigError,
            f"model={model!r} in --model_args is not a directory here; pass a model "
            f"directory, a hub id such as HuggingFaceTB/SmolLM2-135M or one of "
            f"{config_groups()['model']}.")
    return [f"model.path={model}"]  # any model config takes a path (named after it)


def _compose(model: str, mode: str, experiment: str | None, overrides: dict):
    """The Hydra config of one method: the model, the experiment's components, overrides."""
    from certkv.config import compose_config

    items = [f"+experiment={experiment}"] if experiment else []
    items += _model_overrides(model)
    items += [f"{key}={value}" for key, value in overrides.items()]
    items.append(f"variants=[{{name: {mode}, mode: {mode}}}]")
    return compose_config(items)


def model_spec(model: str):
    """The :class:`~certkv.models.ModelSpec` that ``model=`` names."""
    from hydra.utils import instantiate

    return instantiate(_compose(model, "dense", None, {}).model)
