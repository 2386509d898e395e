"""The adapter store: an S3-backed catalog of PEFT LoRA adapters, streamed over gRPC.

Modules, one job each: `names` (untrusted names and keys), `validation` (PEFT config and
safetensors checks, reused by the inference node), `s3` (boto3 access), `cache` (content
keyed disk cache), `catalog` (listing, validation, change events), `server` (gRPC),
`client` (typed client), `push` (uploads), `seaweedfs` (embedded object store), `cli`.
"""
