"""A faster Triton interpreter for the tests (``TRITON_INTERPRET=1``, every CPU run).

Triton's interpreter (3.4 to 3.9 at least) patches ``triton.language`` at every launch, which is
needed, and again at every call of a ``@triton.jit`` helper from inside a kernel, which repeats
the launch's own patch: the same builtins wrapped the same way, at about 1.7 ms a call. certkv's
kernels call their helpers (code unpacking, two-level dot products) once per block, so on the
test shapes that repeated patch was about a third of an interpreted decode step.

:func:`install` keeps the patch of a helper only where its module reaches a language module
the launch has not patched yet (helpers of ``triton.language.standard`` use ``core``, which a
kernel importing ``triton.language as tl`` does not patch): the kernels run the same
interpreted code on the same patched builtins; and ``tl.sort`` sorts the NumPy data at once.
Where Triton's interpreter lacks the pieces this relies on, or its helper call is not the one
this replaces (:func:`_replaceable`), nothing is installed and the tests run at the
interpreter's own speed.
"""

from __future__ import annotations

import inspect

_INSTALLED = False


def _replaceable(call) -> bool:
    """Whether ``InterpretedFunction.__call__`` is the one this replaces: patch the language,
    rewrite the function, call it, wrap its errors (a Triton that changed it keeps its own)."""
    try:
        lines = [line.strip() for line in inspect.getsource(call).splitlines()]
    except (OSError, TypeError):
        return False
    body = [line for line in lines if line and not line.startswith(("#", "def ", "@"))]
    return body == ["_patch_lang(self.fn)", "fn = self.rewrite()", "try:",
                    "return fn(*args, **kwargs)", "except Exception as e:",
                    "raise InterpreterError(repr(e)) from e"]


def install() -> bool:
    """Skip the interpreter's repeated language patch in nested helper calls (idempotent);
    True where installed."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    grid, helper = getattr(interp, "GridExecutor", None), getattr(interp, "InterpretedFunction",
                                                                  None)
    if grid is None or helper is None or not hasattr(interp, "_patch_lang") \
            or not hasattr(helper, "rewrite") or not _replaceable(helper.__call__):
        return False
    launches: list[set[int]] = []  # per launch in progress: the language modules it patched
    seen: dict = {}  # function -> the language modules its globals reach

    def languages(fn) -> frozenset[int]:
        if fn not in seen:
            seen[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                 if inspect.ismodule(value) and value in (tl, tl.core))
        return seen[fn]

    launch = grid.__call__

    def launched(self, *args, **kwargs):
        launches.append(set(languages(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def called(self, *args, **kwargs):  # InterpretedFunction.__call__: a nested helper
        wanted = languages(self.fn)
        if not launches or not wanted <= launches[-1]:
            interp._patch_lang(self.fn)
            if launches:
                launches[-1] |= wanted
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    grid.__call__, helper.__call__ = launched, called
    tl.sort = _sorted(tl, interp)
    _lighter_bookkeeping(interp)
    _memoised_types(tl.core)
    _INSTALLED = True
    return True


def _lighter_bookkeeping(interp) -> None:
    """Two costs of the interpreter's own that no compiled kernel pays: every 32-bit integer
    add, subtract and multiply is checked for overflow by redoing it in int64 (a third of an
    interpreted decode step; a compiled kernel checks only under ``debug``, which certkv never
    sets), and the NumPy dtype of a Triton dtype is looked up by building a dict at each of
    ~20 thousand calls a step (memoised here). Neither changes a value the kernels compute."""
    import dataclasses

    builder = getattr(interp, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    lookup = getattr(interp, "_get_np_dtype", None)
    if lookup is not None and not hasattr(lookup, "memo"):
        memo: dict = {}

        def np_dtype(tt_dtype):
            try:
                return memo[tt_dtype]
            except KeyError:
                return memo.setdefault(tt_dtype, lookup(tt_dtype))
            except TypeError:  # an unhashable dtype: the interpreter's own lookup
                return lookup(tt_dtype)

        np_dtype.memo = memo
        interp._get_np_dtype = np_dtype


def _memoised_types(core) -> None:
    """Every interpreted operation builds a block type (its shape unwrapped, checked to be
    powers of two, its name formatted) and a tensor (its shape and element count as constexprs)
    anew, about a quarter of an interpreted decode step. Both depend only on the element type
    and the shape, so they are computed once per (element type, shape) of plain integers and
    handed to every later one (any other shape takes Triton's own path): each attribute holds
    what Triton's own constructor gives it, so every kernel computes the same values."""
    block_type, tensor = core.block_type, core.tensor
    if getattr(block_type.__init__, "memo", None) is not None:
        return
    make_type, make_tensor = block_type.__init__, tensor.__init__
    types: dict = {}
    shapes: dict = {}

    def type_init(self, element_ty, shape):
        key = (element_ty.name, tuple(shape)) if all(type(s) is int for s in shape) else None
        made = types.get(key) if key is not None else None
        if made is None:
            make_type(self, element_ty, shape)
            if key is not None:
                types[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = made

    def tensor_init(self, handle, type):
        made = shapes.get(type.name)  # a block type's name is its element type and shape
        if made is None:
            make_tensor(self, handle, type)
            shapes[type.name] = (self.numel, self.shape)
            return
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.numel, self.shape = made

    type_init.memo, tensor_init.memo = types, shapes
    block_type.__init__, tensor.__init__ = type_init, tensor_init


def _sorted(tl, interp):
    """``tl.sort`` on the interpreter's NumPy data: the values Triton's bitonic network gives,
    without running its ``log^2 n`` stages op by op (three quarters of the selection kernel's
    interpreted time). The compiled kernels keep Triton's own (``test_cuda_compile.py``)."""
    import numpy as np

    def sort(x, dim=None, descending=False):
        axis = -1 if getattr(dim, "value", dim) is None else getattr(dim, "value", dim)
        data = np.sort(x.handle.data, axis=axis)
        if bool(getattr(descending, "value", descending)):
            data = np.flip(data, axis=axis).copy()
        return tl.tensor(interp.TensorHandle(data, x.handle.dtype), x.type)

    return sort
