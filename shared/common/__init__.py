"""Value types every part imports (config, errors, sampling parameters, validation); imports nothing but the
standard library: no torch, no grpc, nothing else of tandem."""
