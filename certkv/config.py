"""Config composition: ``conf/`` and the one way to compose it outside Hydra's own entry point.

The CLI (:mod:`certkv.cli`), the Hydra entry point (:mod:`certkv.hydra_app`) and the
integrations (:mod:`certkv.integrations.lm_eval`) import this module; nothing imports the CLI.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

from certkv.errors import ConfigError, require

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# A directory of the user's own components (docs/adding-a-component.md): its YAMLs join the
# config groups of conf/ (Hydra's search path, conf/config.yaml) and its Python files import.
USER_CONF = "CERTKV_CONF_PATH"
DEFAULT_EXPERIMENT = "smoke"
MAX_DIRNAME = 120
# Overrides that never change a result, so they do not name the run directory: the experiment
# and output root (already in the path) and the logger (W&B logs the same run, no recompute).
NOT_IN_DIRNAME = ("experiment", "out_dir", "logger")
_UNSAFE = re.compile(r'[/\\:*?"<>|\x00-\x1f]')
_UNSAFE_OR_COMMA = re.compile(r'[/\\:*?"<>|\x00-\x1f,]')  # names joined by another separator


def override_key(item: str) -> str:
    """``+model.path=x`` -> ``model.path``."""
    return item.partition("=")[0].lstrip("+~")


def names_run_dir(item: str) -> bool:
    """Whether the override ``item`` takes part in the run directory's name."""
    key = override_key(item)
    return not any(key == k or key.startswith(f"{k}.") or key.startswith(f"{k}/")
                   for k in NOT_IN_DIRNAME) and not key.startswith(("hydra.", "hydra/"))


def run_dirname(overrides, sep: str = ",") -> str:
    """The directory name of a run (or a sweep point) from its overrides: the ones that can
    change results, sorted and joined by ``sep`` (``,``: Hydra's ``override_dirname`` form),
    with path separators and other characters a file system rejects replaced by ``_`` (and a
    hash of the original appended, so two values never share a directory); a name too long for
    a file system (e.g. a ``variants=[...]`` list) keeps its start and a hash of the whole.
    Another ``sep`` (lm-eval's ``+``: its model arguments are split at commas) makes ``,`` in a
    value unsafe too."""
    name = sep.join(sorted(str(o) for o in overrides if names_run_dir(str(o))))
    safe = (_UNSAFE if sep == "," else _UNSAFE_OR_COMMA).sub("_", name)
    digest = hashlib.md5(name.encode()).hexdigest()[:10]
    if safe != name:
        safe = f"{safe[:MAX_DIRNAME - 11]}-{digest}"
    elif len(safe) > MAX_DIRNAME:
        safe = f"{safe[:MAX_DIRNAME - 11].rstrip(sep)}-{digest}"
    return safe


def path_name(path: str | None, default: str) -> str:
    """A model's short name: ``default``, or the last part of ``path`` when one is given
    (``model.path=/models/Llama-3.1-8B`` on a config of another model)."""
    if not path:
        return default
    return Path(str(path).rstrip("/")).name or default


def register_resolvers() -> None:
    """OmegaConf resolvers ``conf/`` uses (``${run_dirname:...}``, ``${path_name:...}``,
    ``${option:...}``)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("certkv_searchpath", user_searchpath, replace=True)
    OmegaConf.register_new_resolver("run_dirname", run_dirname, replace=True)
    OmegaConf.register_new_resolver("path_name", path_name, replace=True)
    OmegaConf.register_new_resolver("option", option, replace=True)


def user_conf_dir() -> Path | None:
    """The directory ``$CERTKV_CONF_PATH`` names (None where unset); its Python files are made
    importable here. A path that is not a directory is one sentence."""
    value = os.environ.get(USER_CONF)
    if not value:
        return None
    path = Path(value).expanduser().resolve()
    require(path.is_dir(), ConfigError,
            f"{USER_CONF}={value} is not a directory; point it at the directory that holds your "
            f"components' YAMLs (e.g. quantizer/my_codec.yaml) and their Python files, or unset "
            f"it.")
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    return path


def user_searchpath() -> str:
    """Hydra's search path entry for :func:`user_conf_dir` (the package itself, which holds no
    YAML, where none is set: the entry must name something that exists)."""
    path = user_conf_dir()
    return f"file://{path}" if path is not None else "pkg://certkv"


def conf_dirs() -> list[Path]:
    """Where config options live: ``conf/``, then the user's directory."""
    return [CONF_DIR, *filter(None, [user_conf_dir()])]


def option(group: str, name: str, *changes: str) -> dict:
    """``${option:quantizer,tiers,'archive=kivi2'}``: the node of ``conf/<group>/<name>.yaml``
    with quoted ``key=value`` changes (dotted keys, YAML values), so an experiment's variants
    can use any config group option (e.g. another quantizer) without copying it."""
    import yaml
    from omegaconf import OmegaConf

    candidates = [d / group / f"{name}.yaml" for d in conf_dirs()]
    path = next((p for p in candidates if p.exists()), candidates[0])
    require(path.exists(), ConfigError,
            f"${{option:{group},{name}}} names no file conf/{group}/{name}.yaml; use one of "
            f"{config_groups().get(group, [])}.")
    node = OmegaConf.load(path)
    for change in changes:
        key, sep, value = change.partition("=")
        require(bool(sep), ConfigError,
                f"${{option:...}} change {change!r} must read key=value, e.g. archive=kivi2.")
        OmegaConf.update(node, key.strip(), yaml.safe_load(value), merge=False)
    return OmegaConf.to_container(node)


def config_groups() -> dict[str, list[str]]:
    """Config group -> option names, read from ``conf/`` (and the user's directory: its
    options in the groups ``conf/`` has)."""
    groups = {d.name: {p.stem for p in d.glob("*.yaml")}
              for d in sorted(CONF_DIR.iterdir()) if d.is_dir() and d.name != "hydra"}
    for extra in conf_dirs()[1:]:
        for name, options in groups.items():
            options.update(p.stem for p in (extra / name).glob("*.yaml"))
    return {name: sorted(options) for name, options in groups.items()}


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

    register_resolvers()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            cfg = compose("config", overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(_explain(exc, overrides)) from exc
    drop_unused_task_settings(cfg, overrides)
    return cfg


def drop_unused_task_settings(cfg, overrides) -> None:
    """Remove (in place) the settings an experiment gives tasks the run does not run:
    ``+experiment=tiny task=niah`` runs tiny's NIAH, and tiny's perplexity settings, which
    name no task, go. Settings the user typed (``task.perplexity.context=512``) for a task
    left out stay, so that validation names them."""
    from omegaconf import DictConfig, open_dict

    typed = {override_key(str(o)).split(".")[1] for o in overrides
             if override_key(str(o)).startswith("task.")}
    with open_dict(cfg):
        for name in list(cfg.get("task") or {}):
            node = cfg.task[name]
            if isinstance(node, DictConfig) and "_target_" not in node and name not in typed:
                del cfg.task[name]


_MISSING_OPTION = re.compile(r"Could not find '([^'/]+)/([^']+)'")
_MISSING_KEY = re.compile(r"Could not override '([^']+)'")


def _explain(exc: Exception, overrides: list[str]) -> str:
    """One message for a failed composition: an unknown option of a config group or an unknown
    field with the closest valid name, else Hydra's message and the valid options."""
    message = str(exc).strip() or str(exc.__cause__).strip()
    option = _MISSING_OPTION.search(message)
    groups = config_groups()
    if option and option[1] in groups:
        return _unknown_option(option[1], option[2], groups[option[1]])
    key = _MISSING_KEY.search(message)
    if key:
        valid = [o for o in overrides if override_key(o) != key[1]]
        hint = _unknown_field(key[1], valid)
        if hint:
            return hint
    listed = "; ".join(f"{g}: {', '.join(o)}" for g, o in groups.items())
    return (f"{message}\nValid config groups and options: {listed}. "
            "Print the composed config with `certkv run --cfg job`.")


def _closest(word: str, choices) -> list[str]:
    """The choices most like ``word`` (a typo's fix): every one tied at the best similarity
    (``int9`` -> the three ``int*`` quantizers, ``kivi3`` -> ``kivi2`` and ``kivi4``), or none
    when nothing is close."""
    import difflib

    choices = [str(c) for c in choices]
    scores = {c: difflib.SequenceMatcher(None, word, c).ratio() for c in choices}
    best = max(scores.values(), default=0.0)
    return [c for c in choices if scores[c] == best] if best >= 0.45 else []


def _did_you_mean(names: list[str]) -> str:
    """``; did you mean a?`` / ``; did you mean one of a, b?`` / ``.`` for no guess."""
    if not names:
        return "."
    return f"; did you mean {names[0]}?" if len(names) == 1 else \
        f"; did you mean one of {', '.join(names)}?"


def _unknown_option(group: str, option: str, options: list[str]) -> str:
    """``experiment=ruler_8kk`` -> which options ``experiment`` has, the closest first."""
    guess = _did_you_mean([f"{group}={c}" for c in _closest(option, options)])
    return (f"{group}={option} is not one of the {group} configs{guess} "
            f"Choose one of: {', '.join(options)}.")


def _unknown_field(key: str, overrides: list[str]) -> str | None:
    """``selector.kmax`` -> the nearest existing field (``selector.k_max``) in the config the
    other ``overrides`` compose (None where that fails too). Hydra's own advice, ``+key``,
    would only add a field no component takes."""
    from hydra import compose, initialize_config_dir
    from omegaconf import DictConfig

    try:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            node = compose("config", overrides=overrides)
    except Exception:  # the other overrides are bad too: Hydra's message says which
        return None
    parts, known = key.split("."), []
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        if part not in node:
            fields = [k for k in node if not str(k).startswith("_")]
            where = ".".join(known) or "the config"
            guess = _did_you_mean([".".join([*known, c, *parts[i + 1:]])
                                   for c in _closest(part, fields)])
            return (f"{key} is not a field of {where}{guess} Its fields: {', '.join(fields)} "
                    "(print the whole config with `certkv run --cfg job`).")
        node, known = node[part], [*known, part]
    return None


def check_types(node, path: str) -> None:
    """Check every field of a config node with a ``_target_`` (and its nested nodes) against
    the annotations of the class or function it builds, before anything is built: a value of
    the wrong kind (``selector.tau_cov=abc``) is a :class:`ConfigError` naming the field, what
    it must be and an example, not a ``TypeError`` from deep inside a constructor.

    ``node``: a ``DictConfig`` or dict; ``path``: its dotted name (``selector``).
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, dict) or "_target_" not in node:
        return
    hints, defaults, fields = _signature(node["_target_"])
    for key, value in node.items():
        if key.startswith("_"):
            continue
        if fields is not None and key not in fields:
            guess = _did_you_mean([f"{path}.{c}" for c in _closest(key, fields)])
            raise ConfigError(f"{path}.{key} is not a field of {path} "
                              f"({node['_target_'].rsplit('.', 1)[-1]}){guess} "
                              f"Its fields: {', '.join(fields)}.")
        if isinstance(value, dict) and "_target_" in value:
            check_types(value, f"{path}.{key}")
            continue
        hint = hints.get(key)
        if hint is not None and not _matches(value, hint):
            example = defaults.get(key)
            shown = f"; e.g. {path}.{key}={example}" if example is not None else ""
            raise ConfigError(f"{path}.{key}={value!r} must be {_describe(hint)}{shown}.")


def _signature(target: str) -> tuple[dict, dict, list[str] | None]:
    """``(annotations, defaults, parameter names)`` of the class or function ``target`` names
    (names None where it takes any keyword, or cannot be inspected)."""
    import dataclasses
    import inspect
    import typing

    from hydra.utils import get_object

    try:
        obj = get_object(target)
    except Exception:  # an unknown target fails later with Hydra's own message
        return {}, {}, None
    fn = obj.__init__ if inspect.isclass(obj) and not dataclasses.is_dataclass(obj) else obj
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # annotations that do not resolve: nothing to check against
        return {}, {}, None
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return hints, {}, None
    defaults = {p.name: p.default for p in params
                if p.default is not inspect.Parameter.empty and p.default is not None}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    names = None if takes_any else [p.name for p in params
                                      if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    return hints, defaults, names


def _matches(value, hint) -> bool:
    """Whether a plain config value fits a type annotation (ints are floats; bools are not
    numbers; unknown annotation kinds are accepted)."""
    import types
    import typing

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    if hint in (list, tuple) or origin in (list, tuple):
        return isinstance(value, list | tuple)
    return True


def _describe(hint) -> str:
    """``float | None`` -> ``a number or null``."""
    import types
    import typing

    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_describe(h) for h in typing.get_args(hint)))
    names = {float: "a number", int: "an integer", bool: "true or false", str: "a string",
             type(None): "null", dict: "a mapping", list: "a list", tuple: "a list"}
    return names.get(hint, names.get(typing.get_origin(hint), getattr(hint, "__name__",
                                                                     str(hint))))
