"""Marks this `deep_ep` package as moe_ep's stand-in (`moe_ep.deep_ep_alias.ALIAS_MARKER`), so that
`moe_ep.install_as_deep_ep()` does not take it for a real DeepEP."""
