"""Let programs written for DeepEP V1 find moe_ep under the name `deep_ep`.

Two routes: `install_as_deep_ep()` in the running process, before the program imports `deep_ep`;
or the separate distribution built from `packaging/deep_ep/` for programs whose worker processes
import `deep_ep` themselves. Both serve the modules of `moe_ep.deep_ep_alias.deep_ep`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional

from . import deep_ep as _deep_ep

NAME = "deep_ep"
ALIAS_MARKER = "_moe_ep_alias.py"
"""File that the `packaging/deep_ep` distribution ships inside its `deep_ep` package, so that it is
told apart from a real DeepEP."""


def register_modules() -> ModuleType:
    """Make `deep_ep` and `deep_ep.utils` resolve to moe_ep's modules, dropping other `deep_ep.*` entries."""
    for name in [name for name in sys.modules if name.startswith(NAME + ".")]:
        del sys.modules[name]
    sys.modules[NAME] = _deep_ep
    sys.modules[NAME + ".utils"] = _deep_ep.utils
    return _deep_ep


def install_as_deep_ep(force: bool = False) -> ModuleType:
    """Make `import deep_ep` in this process give moe_ep (`deep_ep.Buffer is moe_ep.Buffer`).

    Provides `deep_ep.Buffer`, `Config`, `EventOverlap`, `EventHandle`, `topk_idx_t` and
    `deep_ep.utils.EventHandle` / `EventOverlap`. Call it before the program imports `deep_ep`;
    calling it again changes nothing. Refuses (RuntimeError) when another `deep_ep`, e.g. a real
    DeepEP, is imported or importable, unless `force=True`; modules that already imported that one
    keep it. Returns the module now named `deep_ep`.
    """
    if not isinstance(force, bool):
        raise TypeError(f"force: expected a bool, got {type(force).__name__}")
    if sys.modules.get(NAME) is not _deep_ep and not force:
        other = _other_deep_ep()
        if other is not None:
            raise RuntimeError(f"install_as_deep_ep: another deep_ep package is {other}; moe_ep does not shadow "
                               "it. Uninstall it, or pass force=True to use moe_ep under that name in this process")
    return register_modules()


def _other_deep_ep() -> Optional[str]:
    """Where a `deep_ep` other than moe_ep's stand-in is imported or importable from, or None."""
    present = sys.modules.get(NAME)
    if present is not None:
        return f"imported from {getattr(present, '__file__', None) or present!r}"
    try:
        spec = importlib.util.find_spec(NAME)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if any(os.path.isfile(os.path.join(location, ALIAS_MARKER)) for location in locations):
        return None  # the packaging/deep_ep distribution: moe_ep's own stand-in
    return f"importable from {spec.origin or locations}"
