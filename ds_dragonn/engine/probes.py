"""Checks that DeepSpeed still has the methods the hooks replace or call, with the parameters they pass.

These read attributes and signatures, never source text: a reformat of DeepSpeed passes them, a renamed or
removed method or a changed parameter list fails them, at ``initialize``, with a message naming the method.
What the methods *do* is checked by the behaviour tests (density 1.0 equals DeepSpeed's dense engine).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Sequence

#: the DeepSpeed versions the hooks were tested with (setup.py pins below the next minor)
TESTED_DEEPSPEED = ("0.19.8",)


def unwrapped(fn: Any) -> Optional[Callable]:
    """``fn`` without DeepSpeed's ``instrument_w_nvtx`` wrapper (``(*args, **kwargs)``, no ``__wrapped__``): the
    function in its closure, else ``inspect.unwrap(fn)``; None where ``fn`` is not callable."""
    if not callable(fn):
        return None
    fn = inspect.unwrap(fn)
    try:
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
    except (TypeError, ValueError):
        return fn
    if kinds - {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        return fn  # a signature of its own: not a pass-through wrapper
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if inspect.isfunction(inner):
            return inner
    return fn


def parameters(fn: Any) -> Optional[list]:
    """The parameter names of ``fn`` (unwrapped, ``self`` dropped), or None where it has no signature."""
    inner = unwrapped(fn)
    try:
        names = list(inspect.signature(inner).parameters) if inner is not None else None
    except (TypeError, ValueError):
        return None
    return names[1:] if names and names[0] == "self" else names


def require_methods(cls: type, expected: Dict[str, Sequence[str]], what: str) -> None:
    """Raise where ``cls`` lacks one of ``expected``'s methods, or one's parameters do not start with the
    names given (leading parameters: DeepSpeed may add optional ones at the end).

    Args:
        cls: the DeepSpeed class whose methods the hook replaces or calls.
        expected: method name (as ``getattr`` sees it, name-mangled where private) -> leading parameter names.
        what: the consequence, for the message (e.g. "ds_dragonn's ZeRO-1/2 hook would be bypassed").
    Raises:
        RuntimeError: naming ``cls.method``, what was expected and what was found, and the tested versions.
    """
    for name, params in expected.items():
        method = getattr(cls, name, None)
        if method is None:
            raise RuntimeError(f"this DeepSpeed version has no {cls.__name__}.{name}; {what} "
                               f"(tested with {', '.join(TESTED_DEEPSPEED)})")
        found = parameters(method)
        if found is not None and list(found[:len(params)]) != list(params):
            raise RuntimeError(f"this DeepSpeed version changed {cls.__name__}.{name} (parameters {found}, expected "
                               f"to start with {list(params)}); {what} (tested with {', '.join(TESTED_DEEPSPEED)})")


def version_warning(version: str, tested: Sequence[str] = TESTED_DEEPSPEED) -> Optional[str]:
    """The start-up warning for a DeepSpeed ``version`` outside ``tested`` (None inside it). Not an error:
    :func:`require_methods` refuses a version whose hooked methods changed, at ``initialize``."""
    if version.split("+")[0] in tested:
        return None
    return (f"DRAGONN: warning: DeepSpeed {version} is not a tested version ({', '.join(tested)}); ds_dragonn "
            f"replaces private methods of its engine and ZeRO optimizers, so check that density 1.0 trains as the "
            f"dense engine does (tests/test_engine.py) before relying on it")


__all__ = ["TESTED_DEEPSPEED", "parameters", "require_methods", "unwrapped", "version_warning"]
