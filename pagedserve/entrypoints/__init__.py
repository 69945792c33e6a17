"""Entry points: the command line, the `serve` launcher, the embedded Redis."""
