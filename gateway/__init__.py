"""The gateway: public gRPC and OpenAI HTTP APIs, tokenization, routing, detokenization; imports no torch, no
engine and no kernels."""
