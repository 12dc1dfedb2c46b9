"""Run a program written for DeepEP with moe_ep installed as `deep_ep` in its process.

    python -m moe_ep.deep_ep_alias SCRIPT [ARGS...]
    python -m moe_ep.deep_ep_alias -m MODULE [ARGS...]

Works under `torchrun ... -m moe_ep.deep_ep_alias ...` (every rank runs it). Programs that start their
own worker processes need the `packaging/deep_ep` distribution instead (docs/clients.md).
"""

from __future__ import annotations

import os
import runpy
import sys

from . import install_as_deep_ep


def main(argv: list[str]) -> None:
    """Install the alias, then run `argv` (a script or `-m module`, with its arguments) as `__main__`."""
    if not argv or argv[0] in ("-h", "--help") or argv == ["-m"]:
        raise SystemExit(__doc__)
    install_as_deep_ep()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` would set it
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
