"""The prefill service: batched prompt forwards that ship their KV pages; never imports another service."""
