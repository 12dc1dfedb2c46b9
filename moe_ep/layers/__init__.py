"""nn.Modules built on the communication ops."""
