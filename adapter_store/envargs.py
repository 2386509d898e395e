"""argparse flags that environment variables can also set (for containers and stacks).

Flag `--s3-endpoint` reads `ADAPTER_STORE_S3_ENDPOINT`; the command line wins.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

ENV_PREFIX = "ADAPTER_STORE"


def env_name(flag: str) -> str:
    return f"{ENV_PREFIX}_{flag.lstrip('-').replace('-', '_').upper()}"


class EnvArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        flag = next((n for n in names if n.startswith("--")), None)
        if flag is not None and kwargs.get("action") not in ("help", "version"):
            env = env_name(flag)
            raw = os.environ.get(env)
            if raw is not None:
                if kwargs.get("action") in ("store_true", "store_false"):
                    kwargs["default"] = raw.strip().lower() in ("1", "true", "yes", "on")
                else:
                    kwargs["default"] = kwargs.get("type", str)(raw)
                kwargs["required"] = False
            kwargs["help"] = (kwargs.get("help", "") + f" [env {env}]").strip()
        return super().add_argument(*names, **kwargs)
