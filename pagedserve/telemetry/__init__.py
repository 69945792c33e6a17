"""Traces (OpenTelemetry) and metrics (Prometheus) of the gateway and the workers.

Both read what the other layers already hand out (the engine's `StepStats`, the gateway's
requests and answers) and never change it; both are per process objects, passed where
they are used.
"""
