"""Generated wire contract (package lora.v1 of protos/)."""
