"""argparse flags that environment variables can also set (for containers and stacks).

Flag `--s3-endpoint` reads `ADAPTER_STORE_S3_ENDPOINT`; the command line wins. The
inference node uses the same parser with the prefix `INFERENCE_NODE`.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

ENV_PREFIX = "ADAPTER_STORE"


def env_name(flag: str, prefix: str = ENV_PREFIX) -> str:
    return f"{prefix}_{flag.lstrip('-').replace('-', '_').upper()}"


class EnvArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, env_prefix: str = ENV_PREFIX, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        self.env_prefix = env_prefix
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: str, secret: bool = False,  # type: ignore[override]
                     **kwargs: Any) -> argparse.Action:
        """secret=True: a value from the environment is never shown (e.g. in --help)."""
        flag = next((n for n in names if n.startswith("--")), None)
        if flag is not None and kwargs.get("action") not in ("help", "version"):
            env = env_name(flag, self.env_prefix)
            raw = os.environ.get(env)
            if raw is not None:
                if kwargs.get("action") in ("store_true", "store_false"):
                    truthy = raw.strip().lower() in ("1", "true", "yes", "on")
                    # the variable means what the flag means: NO_X=1 acts as --no-x
                    kwargs["default"] = truthy if kwargs["action"] == "store_true" else not truthy
                else:
                    try:
                        kwargs["default"] = kwargs.get("type", str)(raw)
                    except (ValueError, argparse.ArgumentTypeError) as exc:
                        self.error(f"{env}={raw!r}: {exc}")  # as a bad flag is refused: usage, exit 2
                kwargs["required"] = False
            kwargs["help"] = (kwargs.get("help", "") + f" [env {env}]").strip()
            if secret:  # '%(default).0s' formats to nothing and stops the default being shown
                kwargs["help"] += "%(default).0s"
        return super().add_argument(*names, **kwargs)
