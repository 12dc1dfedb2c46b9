"""The `deep_ep` package name, served by moe_ep: importing it gives `moe_ep.deep_ep_alias.deep_ep`.

Remove with `pip uninstall moe-ep-deep-ep-alias` (moe_ep's docs/clients.md).
"""

try:
    from moe_ep.deep_ep_alias import register_modules
except ImportError as exc:
    raise ImportError("deep_ep: this is moe_ep's stand-in for DeepEP and needs moe_ep installed; install moe_ep, "
                      "or remove the stand-in with `pip uninstall moe-ep-deep-ep-alias`") from exc

# The import system hands out whatever sys.modules holds under this name once this file has run.
register_modules()
