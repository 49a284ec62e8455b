"""The decode service: continuous batching over pages pulled from prefill workers; never imports another
service."""
