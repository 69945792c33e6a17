"""Entry points: the command line and the `serve` launcher (its worker supervisor, worker plan
and stop signals)."""
