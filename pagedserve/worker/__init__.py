"""The worker service: the Redis-facing process around one engine (`pagedserve/engine/`).
It reads requests from the queue, runs the engine's step loop, writes each step's deltas
back, and beats its heartbeat; its traces and step statistics go to telemetry."""
