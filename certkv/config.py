"""Config composition: ``conf/`` and the one way to compose it outside Hydra's own entry point.

The CLI (:mod:`certkv.cli`), the Hydra entry point (:mod:`certkv.hydra_app`) and the
integrations (:mod:`certkv.integrations.lm_eval`) import this module; nothing imports the CLI.
"""

from __future__ import annotations

from pathlib import Path

from certkv.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
DEFAULT_EXPERIMENT = "smoke"


def config_groups() -> dict[str, list[str]]:
    """Config group -> option names, read from ``conf/``."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in sorted(CONF_DIR.iterdir()) if d.is_dir() and d.name != "hydra"}


def first_choices(overrides: list[str]) -> list[str]:
    """For validation of a sweep: ``k=a,b`` -> ``k=a`` (sweep functions are left out)."""
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        if "(" in value and value.rstrip().endswith(")"):
            continue
        if "," in value and not value.lstrip().startswith(("[", "{", "'", '"')):
            value = value.split(",")[0]
        out.append(f"{key}={value}")
    return out


def with_experiment(args: list[str]) -> list[str]:
    """``args`` with ``+experiment=smoke`` in front unless they name an experiment."""
    if any(a.lstrip("+").startswith("experiment=") for a in args):
        return list(args)
    return [f"+experiment={DEFAULT_EXPERIMENT}", *args]


def compose_config(overrides: list[str]):
    """The config ``certkv run OVERRIDES`` composes from ``conf/`` (one job: no sweep values).

    Bad overrides raise :class:`ConfigError` with Hydra's message and the valid options.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            return compose("config", overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        groups = "; ".join(f"{g}: {', '.join(o)}" for g, o in config_groups().items())
        raise ConfigError(f"{str(exc).strip()}\nValid config groups and options: {groups}. "
                          "Print the composed config with `certkv run --cfg job`.") from exc
