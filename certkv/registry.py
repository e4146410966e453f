"""Components by name, in the manner of lm-evaluation-harness's ``lm_eval/api/registry.py``.

Every component registers where it is defined, with a decorator::

    @KEY_CODECS.register("kivi")
    class KiviKeyCodec(KeyCodec): ...

and is found by name (``KEY_CODECS.get("kivi")``); an unknown name is one sentence with the
closest registered names. A registry knows the package that fills it (``home``) and imports it
before it answers, so a lookup never depends on what the caller happened to import. The config
groups of ``conf/`` name the same components through Hydra's ``_target_``; a test holds the two
in agreement (every target registered, every registered component in a YAML of its group).

Adding a component is one file that registers it and one YAML in its group
(``docs/adding-a-component.md``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from difflib import get_close_matches
from functools import lru_cache
from typing import TypeVar

from certkv.errors import ConfigError

T = TypeVar("T")


class Registry:
    """Names -> components of one kind (``kind``: how a sentence names it), filled by the
    modules of ``home`` (a package imported before each lookup); ``group``: the ``conf/``
    config group that selects them, if any."""

    def __init__(self, kind: str, home: str, group: str | None = None) -> None:
        self.kind, self.home, self.group = kind, home, group
        self._items: dict[str, object] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the class (or factory) under ``name``; a second component under
        the same name is a programming error, raised at import."""
        def add(component: T) -> T:
            known = self._items.get(name)
            if known is not None and known is not component:
                raise ValueError(f"{self.kind} {name!r} is registered twice: {known!r} and "
                                 f"{component!r}; give one of them another name.")
            self._items[name] = component
            return component
        return add

    def _filled(self) -> dict[str, object]:
        importlib.import_module(self.home)
        return self._items

    def get(self, name: str, label: str | None = None):
        """The component registered as ``name``; unknown: one sentence with the closest names
        (``label``: the setting that named it, e.g. ``protect.code``)."""
        items = self._filled()
        if name not in items:
            close = get_close_matches(str(name), list(items), n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            what = f"{label}={name!r} is unknown" if label else f"unknown {self.kind} {name!r}"
            raise ConfigError(f"{what}; {hint}use one of {', '.join(sorted(items))}.")
        return items[name]

    def names(self) -> list[str]:
        return sorted(self._filled())

    def name_of(self, component) -> str | None:
        """The name ``component`` (a registered class or factory) is registered under."""
        return next((n for n, c in self._filled().items() if c is component), None)

    def __contains__(self, name: str) -> bool:
        return name in self._filled()

    def __iter__(self) -> Iterator[tuple[str, object]]:
        return iter(sorted(self._filled().items()))

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(sorted(self._items)) or 'nothing loaded'})"


def inherits(component, owner: type, *methods: str) -> bool:
    """Whether ``component`` is an ``owner`` whose class overrides none of ``methods`` (names
    ``owner`` lacks count as kept): what a capability claim of ``owner`` rests on (a fast path
    that computes ``owner``'s methods its own way), so a subclass that changes one of them
    loses the claim without saying so."""
    return _inherits(type(component), owner, methods)


@lru_cache(maxsize=256)
def _inherits(cls: type, owner: type, methods: tuple[str, ...]) -> bool:
    """:func:`inherits` by class (memoised: a decode step asks it of its components at every
    layer; classes are not changed after they are used)."""
    return issubclass(cls, owner) and all(
        getattr(cls, name, None) is getattr(owner, name, None) for name in methods)


KEY_CODECS = Registry("key codec", "certkv.quant")
VALUE_CODECS = Registry("value codec", "certkv.quant")
QUANTIZERS = Registry("quantizer", "certkv.quant", "quantizer")
PROTECTION_CODES = Registry("protection code", "certkv.quant.protect", "protect")
EVICTION_POLICIES = Registry("eviction policy", "certkv.evict", "evict")
SUMMARIES = Registry("summary", "certkv.quant.summaries")  # evict.summary: a policy's field
SELECTORS = Registry("selector", "certkv.certify", "selector")
VALUE_POLICIES = Registry("value policy", "certkv.certify", "value_policy")
LADDERS = Registry("ladder", "certkv.certify", "ladder")
BACKENDS = Registry("backend", "certkv.kernels", "backend")
TASKS = Registry("task", "certkv.eval.tasks", "task")

REGISTRIES = (KEY_CODECS, VALUE_CODECS, QUANTIZERS, PROTECTION_CODES, EVICTION_POLICIES,
              SUMMARIES, SELECTORS, VALUE_POLICIES, LADDERS, BACKENDS, TASKS)
