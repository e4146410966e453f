"""Ablation sweeps (``certkv sweep``): the paper's four knobs with their grids, and any config
field, each run as a Hydra multirun, then aggregated (:mod:`certkv.report.sweep`).

A sweep is ``certkv run -m`` underneath: Hydra composes every point, its launcher runs them
(``hydra/launcher=joblib`` on one machine, ``submitit_slurm`` on a cluster), and each point is
an ordinary run directory under ``<out_dir>/sweeps/<name>/<experiment>/<overrides>/``. A point
that finished earlier is skipped, a killed point resumes sample by sample, and a point that
fails (e.g. a value group larger than the head dimension) records why in ``failed.json`` while
the others go on.
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass

from certkv.errors import ConfigError, require


@dataclass(frozen=True)
class Knob:
    """One ablation: the config fields it sets (all to the same value) and the paper's grid."""

    name: str
    keys: tuple[str, ...]
    grid: tuple[str, ...]
    source: str
    help: str


KNOBS: dict[str, Knob] = {
    "kmax": Knob("kmax", ("selector.k_max",), ("64", "128", "256", "512"), "Table 9",
                 "selector K_max (the ladder's cap follows at 2 K_max unless set)"),
    "vtol": Knob("vtol", ("value_policy.v_tol",), ("0.01", "0.02", "0.05", "0.1", "0.2"),
                 "Section 9.4.1 (paper default 0.05)", "value tolerance v_tol"),
    "group": Knob("group", ("quantizer.value_codec.group",), ("8", "16", "32"),
                  "Section 9.7 (g=16 vs g=32)", "INT4 value group size g"),
    "scratch": Knob("scratch", ("cache.scratch_key_blocks",),
                    ("0", "256", "512", "1024", "1536", "2048", "4096"), "Tables 17-18",
                    "FP16 scratch capacity in blocks per layer (values follow keys unless "
                    "--value-blocks is given, Table 19)"),
}

_KEY = re.compile(r"^[A-Za-z_][\w.]*$")


def parse_grid(text: str | None, knob: str) -> list[str]:
    """``"0.02,0.05"`` -> ``["0.02", "0.05"]``; an empty grid is an error naming the fix."""
    values = [v.strip() for v in (text or "").split(",") if v.strip()]
    require(bool(values), ConfigError,
            f"the {knob} grid is empty; pass values separated by commas, e.g. "
            f"--values {','.join(KNOBS[knob].grid) if knob in KNOBS else '1,2'}.")
    return values


def parse_axis(item: str) -> tuple[str, list[str]]:
    """``KEY=V1,V2`` of ``certkv sweep custom`` -> ``(KEY, [V1, V2])``."""
    key, sep, values = item.partition("=")
    key = key.lstrip("+")
    require(bool(sep) and _KEY.match(key) is not None, ConfigError,
            f"{item!r} is not a sweep axis; write KEY=V1,V2 with a config field as KEY, e.g. "
            "value_policy.v_tol=0.02,0.05.")
    return key, parse_grid(values, key)


def knob_axes(knob: str, values: str | None, value_blocks: str | None = None
              ) -> dict[str, list[str]]:
    """The sweep axes (config key -> values) of a named knob."""
    require(knob in KNOBS, ConfigError,
            f"unknown sweep {knob!r}; use one of {sorted(KNOBS)} or `certkv sweep custom "
            "KEY=V1,V2`.")
    spec = KNOBS[knob]
    grid = parse_grid(values, knob) if values is not None else list(spec.grid)
    axes = {key: grid for key in spec.keys}
    if value_blocks is not None:
        axes["cache.scratch_value_blocks"] = parse_grid(value_blocks, knob)
    return axes


def multirun_args(name: str, axes: dict[str, list[str]], overrides: list[str]) -> list[str]:
    """The ``certkv run`` arguments of a sweep: ``-m``, the sweep directory, the user's
    overrides (experiment, launcher ...) and one ``key=v1,v2`` per axis."""
    swept = set(axes)
    clash = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in swept]
    require(not clash, ConfigError,
            f"{', '.join(clash)} sets a field this sweep varies; drop it or use `certkv sweep "
            "custom` with the grid you want.")
    return ["-m", f"hydra.sweep.dir=${{out_dir}}/sweeps/{name}/${{experiment}}", *overrides,
            *[f"{key}={','.join(values)}" for key, values in axes.items()]]


def sweep_name(knob: str, axes: dict[str, list[str]]) -> str:
    """The sweep's directory name: the knob, or the custom axes' last key parts."""
    if knob != "custom":
        return knob
    return "+".join(key.split(".")[-1] for key in axes)


def sweep_points(axes: dict[str, list[str]], overrides: list[str]) -> list[list[str]]:
    """Every point of a sweep as the overrides its job gets: the command's own (not Hydra's)
    and one value per axis, in grid order (the product of the axes)."""
    own = [o for o in overrides if not o.lstrip("+").startswith(("hydra.", "hydra/"))
           and o != "-m"]
    grids = [[f"{key}={value}" for value in values] for key, values in axes.items()]
    return [[*own, *combo] for combo in itertools.product(*grids)]


def invocation(knob: str, axes: dict[str, list[str]], overrides: list[str],
               out: str | None) -> str:
    """The ``certkv sweep`` command as a user would type it again (recorded by every point)."""
    args = ["certkv", "sweep", knob]
    if knob == "custom":
        args += [f"{key}={','.join(values)}" for key, values in axes.items()]
    else:
        keys = list(axes)
        args += ["--values", ",".join(axes[keys[0]])]
        if "cache.scratch_value_blocks" in axes:
            args += ["--value-blocks", ",".join(axes["cache.scratch_value_blocks"])]
    args += overrides + (["--out", out] if out else [])
    return shlex.join(args)
