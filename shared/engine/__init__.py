"""The engine core: block pool, scheduler, model runner, sampler, `LLM`; imports no grpc, protobuf, tracing,
registry or service code."""
