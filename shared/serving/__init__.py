"""Serving plumbing between the engine and the services: rpc, registry, telemetry, metrics, KV transfer, the
engine thread; never imports a service. The modules the gateway uses load no torch."""
