"""Communication backends behind `moe_ep.Buffer`."""
