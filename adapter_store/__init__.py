"""The adapter store: an S3-backed catalog of PEFT LoRA adapters, streamed over gRPC.

Modules, one job each: `s3` (boto3 access), `cache` (content keyed disk cache), `catalog`
(listing, validation, change events), `records`, `read_plans` and `shard_wire` (what a fetch
reads and sends), `server` (gRPC), `client` (typed client), `push` (uploads), `auth`,
`metrics`, `seaweedfs` (embedded object store), `cli`. Untrusted names and keys, and PEFT
config and safetensors checks, are in lora_common (names, validation), shared with the node.
"""
