"""What the gateway and the worker share: config, wire messages, errors, the CLI."""
