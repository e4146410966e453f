"""The lm-evaluation-harness model ``certkv``: any lm-eval task through the certified decode path.

Importing this module registers the model (``import certkv.integrations.lm_eval``; ``certkv
lm-eval`` does it for you)::

    lm_eval.simple_evaluate(model="certkv", model_args="model=smollm2_135m,mode=certified,"
                            "quantizer.key_codec.bits=2,value_policy.v_tol=0.02", tasks=[...])

Model arguments: ``model`` (a ``conf/model`` name, or a hub id / local directory), ``mode``
(``dense``, ``naive``, ``certified``), ``experiment`` (a ``conf/experiment`` name whose
components to use), ``max_length`` (tokens; default the model's), ``run_dir`` (where the
certificate statistics go), a config group option (``quantizer=innerq``) and any dotted config
field as a Hydra override
(``value_policy.v_tol=0.02``).

The protocol is ``certkv run``'s: the context is prefilled with dense attention (the model's own
cache and SDPA) except its last token, and every later token is one decode step of the method
under test, so the quantized cache, the certificate and the ladder really run:

* ``generate_until``: greedy; the first generated token already comes from the method's step on
  the context's last token; stops at end-of-sequence, a stop string or ``max_gen_toks``.
* ``loglikelihood``: the continuation is teacher-forced token by token through the method.
* ``loglikelihood_rolling``: lm-eval's rolling windows, each scored like ``loglikelihood``
  (its context prefilled dense, its predicted tokens decoded by the method).

Certificate statistics (rungs, E_key / E_val / E_arith, K*, value promotions, bytes) of every
request are pooled: :meth:`CertKVLM.certificate_summary`, and ``certificates_<time>.json`` in
``run_dir`` after every request type (one file per evaluation, next to lm-eval's
``results_<time>.json``; ``run_dir`` defaults to ``runs/lm_eval/<model>_<mode>[+<overrides>]``,
one directory per configuration).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import lm_eval.models  # noqa: F401 (lm-eval's own models stay registered next to ours)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from certkv.errors import ConfigError, require
from certkv.files import write_atomic
from certkv.integrations.lm_eval_args import _compose

MODES = ("dense", "naive", "certified")


ARGS = ("model", "mode", "experiment", "max_length", "run_dir", "batch_size", "device")


def batch_sequences(batch_size: int | str) -> int:
    """lm-eval's ``batch_size`` as the sequences certkv decodes at once: a positive number, or
    ``auto`` (``auto:N``), which takes the evaluation runner's default
    (:data:`certkv.eval.tasks.BATCH_SIZE`)."""
    from certkv.eval.tasks import BATCH_SIZE

    text = str(batch_size).strip()
    if text.startswith("auto"):
        return BATCH_SIZE
    require(text.isdigit() and int(text) > 0, ConfigError,
            f"batch_size={batch_size!r} must be a positive number of sequences or auto; e.g. "
            "--batch_size 4.")
    return int(text)


def method_config(model: str = "smollm2_135m", mode: str = "certified",
                  experiment: str | None = None, overrides: dict | None = None):
    """``(config, built components)`` of one certkv method, composed and every component
    built and checked (no model is loaded): bad model arguments fail here with one sentence."""
    from certkv.config import config_groups
    from certkv.eval.runner import validate

    overrides = {k: str(v) for k, v in (overrides or {}).items()}
    require(mode in MODES, ConfigError,
            f"mode={mode!r} is unknown; use one of {list(MODES)}, e.g. mode=certified.")
    groups = config_groups()
    bad = [k for k in overrides if "." not in k and k not in groups]
    require(not bad, ConfigError,
            f"unknown model argument(s) {bad}; use {', '.join(ARGS[:5])}, a config group "
            "option such as quantizer=innerq, or a dotted config field such as "
            "value_policy.v_tol=0.02.")
    cfg = _compose(str(model), mode, experiment, overrides)
    return cfg, validate(cfg)


def run_name(model_name: str, mode: str, args: dict) -> str:
    """The results directory name of one configuration: ``<model>_<mode>`` and every other
    model argument that can change a result (``smollm2_135m_naive+quantizer.key_codec.bits=2``;
    ``+``, not ``,``: lm-eval splits model arguments at commas), so two configurations never
    share (or replace) a directory."""
    from certkv.config import run_dirname

    experiment = args.get("experiment")
    rest = [f"{k}={v}" for k, v in sorted(args.items())
            if k not in ("model", "mode", "run_dir", "experiment", "batch_size", "device")]
    suffix = run_dirname(rest, sep="+")
    return (f"{model_name}_{mode}" + (f"_{experiment}" if experiment else "")
            + (f"+{suffix}" if suffix else ""))


def task_manager(model: str = "smollm2_135m", context: int = 4096, samples: int = 5, **kwargs):
    """An lm-eval ``TaskManager`` that knows certkv's offline tasks (``certkv_ruler``,
    ``certkv_ruler_<subtask>``, ``certkv_niah``, ``certkv_needle_choice``, ``certkv_books``),
    generated for ``model``'s tokenizer at ``context`` tokens (once, under ``$CERTKV_DATA``)::

        lm_eval.simple_evaluate(model="certkv", model_args="model=smollm2_135m,mode=certified",
                                tasks=["certkv_needle_choice"], limit=2,
                                task_manager=task_manager(context=1024))

    ``kwargs`` go to ``TaskManager`` (e.g. ``verbosity``; ``include_defaults=False`` leaves
    out lm-eval's own tasks, whose index takes seconds to build)."""
    from lm_eval.tasks import TaskManager

    from certkv.integrations.lm_eval_tasks import task_folder

    folder = task_folder(model, context, samples, fix="task_manager(context=...)")
    return TaskManager(include_path=str(folder), **kwargs)


def _progress(items, description: str, disable: bool = False):
    """``items`` with a rich progress bar on stderr (requests done, elapsed, remaining)."""
    from rich.console import Console
    from rich.progress import track

    return track(items, description=description, disable=disable,
                 console=Console(stderr=True))


@register_model("certkv")
class CertKVLM(TemplateLM):
    """lm-eval model whose every scored or generated token is a decode step of a certkv method."""

    def __init__(self, model: str = "smollm2_135m", mode: str = "certified",
                 experiment: str | None = None, max_length: int | None = None,
                 run_dir: str | None = None, batch_size: int | str = 1, device=None,
                 **overrides) -> None:
        super().__init__()
        from certkv.models.loading import load_model

        cfg, built = method_config(str(model), mode, experiment, overrides)
        (self.method,), self.spec = built.variants, built.cache
        self.lm = load_model(built.model)
        self.method.quantizer.validate(self.lm.head_dim)
        self.tokenizer = self.lm.tokenizer
        self._max_length = int(max_length) if max_length else self.lm.max_context
        args = {"experiment": experiment, "max_length": max_length, **overrides}
        self.run_dir = Path(run_dir or Path("runs") / "lm_eval" / run_name(
            cfg.model.name, mode, {k: v for k, v in args.items() if v is not None}))
        self.started = time.strftime("%Y-%m-%dT%H-%M-%S")  # names this evaluation's file
        self.batch_size = batch_sequences(batch_size)
        self.records: list[dict] = []
        self._prefill = None  # the last context's dense prefill (a multiple-choice doc's
        # requests share one context: prefilled once, each choice decodes its own copy)

    # ---------------------------------------------------------------- lm-eval's interface
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        out = []
        for chunk in self._batches(requests, "certkv loglikelihood", disable_tqdm):
            asked = [self._scoring(context, continuation) for _, context, continuation in chunk]
            out += [(sum(answer.logprobs), answer.greedy) for answer in self._answer(asked)]
        self._save()
        for (key, _, _), result in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        results = []
        for chunk in self._batches([r.args for r in requests], "certkv rolling loglikelihood",
                                   disable_tqdm):
            windows = [[self._scoring(*make_disjoint_window(w)) for w in
                        get_rolling_token_windows(self.tok_encode(string), self.prefix_token_id,
                                                  self.max_length, 1)]
                       for (string,) in chunk]
            answers = iter(self._answer([w for ws in windows for w in ws]))
            for (string,), ws in zip(chunk, windows, strict=True):
                total = sum(sum(next(answers).logprobs) for _ in ws)
                self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
                results.append(total)
        self._save()
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = []
        for chunk in self._batches([r.args for r in requests], "certkv generate_until",
                                   disable_tqdm):
            asked = [self._generation(context, dict(gen_kwargs)) for context, gen_kwargs in chunk]
            answers = self._answer([request for request, _ in asked])
            for (context, gen_kwargs), (_, until), answer in zip(chunk, asked, answers,
                                                                 strict=True):
                text = self.tok_decode(answer.tokens)
                text = text[:min((text.index(u) for u in until if u in text), default=len(text))]
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                results.append(text)
        self._save()
        return results

    # ---------------------------------------------------------------- the decode path
    def _batches(self, items: list, description: str, disable: bool):
        """``items`` in chunks of :attr:`batch_size`, with a progress bar of chunks done."""
        chunks = [items[i : i + self.batch_size] for i in range(0, len(items), self.batch_size)]
        return _progress(chunks, f"{description} ({len(items)} in batches of {self.batch_size})",
                         disable)

    def _answer(self, requests: list) -> list:
        """The answers of ``requests``, decoded :attr:`batch_size` at a time; each request's
        certificate record kept."""
        from certkv.eval.batch import answer_all

        with torch.inference_mode():
            answers = answer_all(requests, self.batch_size)
        for request in requests:
            if self.method.mode != "dense":
                self.records.append(request.session.certificate_record())
        return answers

    def _session(self, context: list[int]):
        """A session on the dense prefill of ``context[:-1]`` for the method (a multiple-choice
        doc's requests share one context: prefilled once, each choice decodes its own copy)."""
        from certkv.eval.decode import Prefill
        from certkv.eval.runner import prompt_window

        prefix = context[:-1]
        if self._prefill is None or self._prefill[0] != prefix:  # SnapKV: the prompt's queries
            self._prefill = (prefix, Prefill(self.lm, prefix, prompt_window([self.method])))
        return self._prefill[1].session(self.method, self.spec)

    def _scoring(self, context: list[int], continuation: list[int]):
        """The request scoring ``continuation`` after ``context`` (left-truncated to
        ``max_length``): the context prefilled, then one method step per scored token."""
        from certkv.eval.batch import Request

        require(0 < len(continuation) <= self.max_length, ConfigError,
                f"a continuation of {len(continuation)} tokens cannot be scored within "
                f"max_length={self.max_length}; raise max_length.")
        whole = (context + continuation)[-(self.max_length + 1):]
        context = whole[:len(whole) - len(continuation)]
        return Request(self._session(context), context[-1], target=list(continuation))

    def _generation(self, context: str, gen_kwargs: dict):
        """``(request, until)``: greedy generation after ``context``, stopping at
        end-of-sequence, a stop string or ``max_gen_toks``."""
        from certkv.eval.batch import Request

        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.pop("max_gen_toks", 256))
        require(not gen_kwargs.get("do_sample", False), ConfigError,
                "certkv decodes greedily; drop do_sample=true from the task's generation_kwargs.")
        ids = self.tok_encode(context) or [self.prefix_token_id]
        ids = ids[-max(1, self.max_length - max_new):]

        def stop(tokens: list[int]) -> bool:
            return any(u in self.tok_decode(tokens) for u in until)

        return Request(self._session(ids), ids[-1], max_new_tokens=max_new, stop=stop), until

    # ---------------------------------------------------------------- certificates
    def certificate_summary(self) -> dict:
        """Pooled certificate statistics of every request so far (``certkv report``'s
        Tables 11-12 and 15 numbers; empty for the dense method)."""
        from certkv.eval.summary import certificate_summary

        return certificate_summary(self.records) if self.records else {}

    def _save(self) -> None:
        from certkv.provenance import environment

        write_atomic(self.run_dir / f"certificates_{self.started}.json",
                     json.dumps({"mode": self.method.mode, "requests": len(self.records),
                                 **environment(), **self.certificate_summary()}, indent=2)
                     + "\n")
