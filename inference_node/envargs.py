"""argparse flags that can also be set by environment variables (for containers and stacks).

Flag `--max-loras` of program prefix `INFERENCE_NODE` reads `INFERENCE_NODE_MAX_LORAS`;
a flag given on the command line wins over the environment.
"""
from __future__ import annotations

import argparse
import os
from typing import Any


class EnvArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, env_prefix: str, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self.env_prefix = env_prefix

    def env_name(self, flag: str) -> str:
        return f"{self.env_prefix}_{flag.lstrip('-').replace('-', '_').upper()}"

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        flag = next((n for n in names if n.startswith("--")), None)
        if flag is not None and kwargs.get("action") not in ("help", "version"):
            env = self.env_name(flag)
            raw = os.environ.get(env)
            if raw is not None:
                if kwargs.get("action") == "store_true":
                    kwargs["default"] = raw.strip().lower() in ("1", "true", "yes", "on")
                else:
                    convert = kwargs.get("type", str)
                    kwargs["default"] = convert(raw)
                kwargs["required"] = False
            kwargs["help"] = (kwargs.get("help", "") + f" [env {env}]").strip()
        return super().add_argument(*names, **kwargs)
