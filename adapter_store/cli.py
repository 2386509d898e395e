"""`adapter-store`: serve the catalog over gRPC, push an adapter, list adapters.

Every flag can also be set with ADAPTER_STORE_<FLAG> (see README.md); S3 credentials and
region come from the standard AWS variables and config files that boto3 reads.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Sequence

from lora_common.envargs import EnvArgumentParser
from lora_common.malloc import keep_freed_buffers
from lora_common.names import InvalidName, normalize_prefix
from lora_common.validation import DEFAULT_MAX_WEIGHT_ABS
from .s3 import S3Store, make_client
from lora_common.tls import TLSConfigError, add_client_flags, add_server_flags, client_tls_from_args, server_tls_from_args

log = logging.getLogger("adapter_store")


def _add_s3_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--s3-endpoint", type=_http_url, default=None,
                        help="S3 endpoint URL (MinIO, SeaweedFS...); AWS when empty")
    parser.add_argument("--bucket", required=True, help="bucket holding the adapters")
    parser.add_argument("--prefix", default="adapters/", help="key prefix: <prefix><name>/adapter_config.json")
    parser.add_argument("--region", default=None, help="S3 region (default: from the AWS environment)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def _add_weight_bound(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-weight-abs", type=float, default=DEFAULT_MAX_WEIGHT_ABS,
                        help="largest |value| of a LoRA weight; adapters with larger ones are refused as "
                             "numerically unsafe (0: no bound; the overflow probe still runs)")


def _http_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL")
    return text


def build_parser(prog: str = "adapter-store", command_names: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """command_names: what another program calls these commands (lora-client's store-ls is ls)."""
    parser = EnvArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    names = command_names or {}

    def command(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, prog=f"{prog} {names.get(name, name)}", **kwargs)

    serve = command("serve", help="run the gRPC store")
    _add_s3_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=50061, help="gRPC port")
    serve.add_argument("--cache-dir", default=".adapter-cache", help="local disk cache directory")
    serve.add_argument("--cache-max-gb", type=float, default=20.0, help="disk cache bound (LRU)")
    serve.add_argument("--poll-interval", type=float, default=5.0,
                       help="seconds between listings of the bucket (changes show up within this)")
    serve.add_argument("--max-adapter-mb", type=float, default=4096.0, help="largest safetensors file accepted")
    serve.add_argument("--shard-kb", type=int, default=4096, help="default shard size of FetchAdapter")
    _add_weight_bound(serve)
    serve.add_argument("--direct-reads", action="store_true",
                       help="answer GetReadPlan with presigned GETs, so nodes started with --adapter-direct-reads "
                            "read validated adapters straight from S3 (checked against the catalog's BLAKE3)")
    serve.add_argument("--direct-reads-endpoint", type=_http_url, default=None,
                       help="S3 endpoint URL the nodes reach, when it differs from --s3-endpoint (another "
                            "host name); the presigned URLs name it")
    serve.add_argument("--direct-reads-expiry", type=int, default=60,
                       help="seconds a read plan's presigned URLs stay valid")
    serve.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics port (0: off)")
    add_server_flags(serve, "store")
    serve.add_argument("--token", default=None, secret=True,
                       help="bearer token every AdapterStore RPC requires (nodes: --store-token); "
                            "health checks stay open (off when unset)")

    push = command("push", help="upload a local PEFT adapter folder")
    _add_s3_flags(push)
    push.add_argument("dir", help="folder with adapter_config.json and adapter_model.safetensors")
    push.add_argument("--name", required=True, help="adapter name in the catalog")
    push.add_argument("--no-validate", action="store_true", help="upload without checking the adapter first")
    push.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_weight_bound(push)

    ls = command("ls", help="list adapters")
    ls.add_argument("--store", default="", help="HOST:PORT of a running store (full, validated view); "
                                                "without it the bucket is listed directly")
    ls.add_argument("--s3-endpoint", type=_http_url, default=None, help="S3 endpoint URL")
    ls.add_argument("--bucket", default="", help="bucket (when --store is not given)")
    ls.add_argument("--prefix", default="adapters/", help="key prefix")
    ls.add_argument("--region", default=None, help="S3 region")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    add_client_flags(ls, "store-tls", "store")
    ls.add_argument("--store-token", default=None, secret=True, help="bearer token of a store started with --token")
    ls.add_argument("--log-level", default="WARNING", help="log level")
    return parser


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def cmd_serve(args: argparse.Namespace) -> int:
    from .read_plans import DirectReads
    from .server import StoreServer, StoreSettings

    settings = StoreSettings(bucket=args.bucket, s3_endpoint=args.s3_endpoint, region=args.region,
                             prefix=args.prefix, cache_dir=args.cache_dir,
                             cache_max_bytes=int(args.cache_max_gb * (1 << 30)), host=args.host, port=args.port,
                             poll_interval_s=args.poll_interval, max_adapter_bytes=int(args.max_adapter_mb * (1 << 20)),
                             shard_bytes=args.shard_kb << 10, metrics_port=args.metrics_port,
                             max_weight_abs=args.max_weight_abs,
                             tls=server_tls_from_args(args), token=args.token,
                             direct_reads=DirectReads(args.direct_reads, args.direct_reads_endpoint,
                                                      args.direct_reads_expiry))
    if not 1 <= args.direct_reads_expiry <= 604800:  # SigV4's longest
        print("adapter-store serve: --direct-reads-expiry must be 1 to 604800 seconds", file=sys.stderr)
        return 2
    try:
        settings.tls.credentials()  # a bad TLS setting fails here, with its flag named
    except TLSConfigError as exc:
        print(f"adapter-store serve: {exc}", file=sys.stderr)
        return 2
    keep_freed_buffers()  # shards are multi-megabyte messages (lora_common.malloc)
    asyncio.run(StoreServer(settings).serve_until_signalled())
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from .push import push_adapter
    from lora_common.validation import AdapterInvalid

    s3 = S3Store(args.bucket, make_client(args.s3_endpoint, args.region))
    try:
        pushed = push_adapter(args.dir, args.name, s3, normalize_prefix(args.prefix),
                              validate=not args.no_validate, progress=not args.no_progress,
                              max_weight_abs=args.max_weight_abs)
    except (AdapterInvalid, InvalidName) as exc:
        print(f"{args.prog}: refused: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # S3's own errors: one line with the fix, never a traceback
        reason = s3_failure(exc, args.s3_endpoint, args.bucket)
        if reason is None:
            raise
        print(f"{args.prog}: {reason}", file=sys.stderr)
        return 1
    spec = pushed.spec
    detail = f" (rank {spec.rank}, {', '.join(spec.target_modules)})" if spec else ""
    print(f"pushed {pushed.name} to s3://{args.bucket}/{normalize_prefix(args.prefix)}{pushed.name}/{detail}")
    return 0


def s3_failure(exc: BaseException, endpoint: str | None, bucket: str) -> str | None:
    """One line saying what went wrong with S3 and how to fix it; None for anything else."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import (BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError,
                                     PartialCredentialsError)

    where = endpoint or "AWS S3"
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return ("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the local stack prints "
                "them once up) or configure an AWS profile")
    if isinstance(exc, EndpointConnectionError):
        return f"cannot reach S3 at {where}: is it running? check --s3-endpoint"
    text = str(exc)
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
    elif isinstance(exc, S3UploadFailedError):
        code = next((c for c in ("NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")
                     if c in text), "")
    elif isinstance(exc, BotoCoreError):
        return f"S3 at {where} failed: {text}"
    else:
        return None
    if code == "NoSuchBucket":
        return f"bucket {bucket!r} does not exist at {where}: check --bucket"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
        return (f"S3 at {where} refused these credentials ({code}): check AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY")
    return f"S3 at {where} failed: {text.splitlines()[0] if text else type(exc).__name__}"


def cmd_ls(args: argparse.Namespace) -> int:
    if args.store:
        from .client import AdapterStoreClient, StoreError

        try:
            client = AdapterStoreClient(args.store, tls=client_tls_from_args(args, "store-tls"),
                                        token=args.store_token)
        except TLSConfigError as exc:
            print(f"{args.prog}: {exc}", file=sys.stderr)
            return 2
        with client:
            try:
                infos = client.list_adapters()
            except StoreError as exc:
                print(f"{args.prog}: the store at {args.store}: {exc}", file=sys.stderr)
                return 1
        rows = [{"name": i.name, "version": i.version, "rank": i.rank, "targets": ",".join(i.target_modules),
                 "base_model": i.base_model, "size": i.size_bytes, "updated": i.updated_at,
                 "status": "ok" if i.valid else f"INVALID: {i.invalid_reason}"} for i in infos]
    else:
        if not args.bucket:
            print(f"{args.prog}: give --store HOST:PORT (a running adapter store, e.g. 127.0.0.1:50061) or "
                  "--bucket NAME (list the bucket directly)", file=sys.stderr)
            return 2
        from .catalog import PICKLE_SUFFIXES
        from lora_common.names import split_key

        prefix = normalize_prefix(args.prefix)
        grouped: dict[str, dict] = {}
        try:
            objects = list(S3Store(args.bucket, make_client(args.s3_endpoint, args.region)).list(prefix))
        except Exception as exc:
            reason = s3_failure(exc.__cause__ or exc, args.s3_endpoint, args.bucket)
            if reason is None:
                raise
            print(f"{args.prog}: {reason}", file=sys.stderr)
            return 1
        for obj in objects:
            parts = split_key(prefix, obj.key)
            if parts is None:
                continue
            row = grouped.setdefault(parts[0], {"name": parts[0], "files": [], "size": 0, "updated": 0})
            row["files"].append(parts[1])
            row["size"] += obj.size
            row["updated"] = max(row["updated"], int(obj.last_modified))
        rows = [r | {"files": ",".join(sorted(r["files"]))} for _, r in sorted(grouped.items())
                if any(f.endswith((".json", ".safetensors") + PICKLE_SUFFIXES) for f in r["files"])]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        columns = list(rows[0]) if rows else ["name"]
        table = [[str(r[c]) if c != "updated" else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r[c]))
                  for c in columns] for r in rows]
        widths = [max([len(c)] + [len(t[i]) for t in table]) for i, c in enumerate(columns)]
        print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip())
        for t in table:
            print("  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip())
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "adapter-store",
         command_names: dict[str, str] | None = None) -> int:
    """prog and command_names: how errors name the command (lora-client forwards here)."""
    args = build_parser(prog, command_names).parse_args(argv)
    args.prog = f"{prog} {(command_names or {}).get(args.command, args.command)}"
    _logging(args.log_level)
    command = {"serve": cmd_serve, "push": cmd_push, "ls": cmd_ls}[args.command]
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
