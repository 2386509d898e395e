"""Front ends: everything per request and nothing of the GPU (gRPC, validation, tokenising,
detokenising, stop strings, streaming, metrics), in processes of their own so request
handling never holds the engine's interpreter lock."""
