"""argparse flags that environment variables can also set (for containers and stacks).

Flag `--s3-endpoint` reads `ADAPTER_STORE_S3_ENDPOINT`; the command line wins. The
inference node uses the same parser with the prefix `INFERENCE_NODE`. A repeatable flag
(action="append") reads its variable as whitespace-separated values, given before the
command line's.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

ENV_PREFIX = "ADAPTER_STORE"


def env_name(flag: str, prefix: str = ENV_PREFIX) -> str:
    return f"{prefix}_{flag.lstrip('-').replace('-', '_').upper()}"


def with_env(names: tuple[str, ...], kwargs: dict[str, Any], prefix: str, secret: bool = False) -> dict[str, Any]:
    """add_argument's keywords with the flag's environment variable as its default (and named
    in its help). secret=True: a value from the environment is never shown (e.g. in --help)."""
    flag = next((n for n in names if n.startswith("--")), None)
    if flag is None or kwargs.get("action") in ("help", "version"):
        return kwargs
    kwargs = dict(kwargs)
    env = env_name(flag, prefix)
    raw = os.environ.get(env)
    if raw is not None:
        action, parse = kwargs.get("action"), kwargs.get("type", str)
        if action in ("store_true", "store_false"):
            truthy = raw.strip().lower() in ("1", "true", "yes", "on")
            # the variable means what the flag means: NO_X=1 acts as --no-x
            kwargs["default"] = truthy if action == "store_true" else not truthy
        elif action == "append":
            kwargs["default"] = [parse(item) for item in raw.split()]
        else:
            kwargs["default"] = parse(raw)
        kwargs["required"] = False
    if kwargs.get("help") != argparse.SUPPRESS:
        kwargs["help"] = (kwargs.get("help", "") + f" [env {env}]").strip()
        if secret:  # '%(default).0s' formats to nothing and stops the default being shown
            kwargs["help"] += "%(default).0s"
    return kwargs


class EnvArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, env_prefix: str = ENV_PREFIX, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        self.env_prefix = env_prefix
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: str, secret: bool = False,  # type: ignore[override]
                     **kwargs: Any) -> argparse.Action:
        return super().add_argument(*names, **with_env(names, kwargs, self.env_prefix, secret))

    def add_argument_group(self, *args: Any, **kwargs: Any) -> argparse._ArgumentGroup:
        """A group whose flags read the environment too."""
        group = super().add_argument_group(*args, **kwargs)
        add, prefix = group.add_argument, self.env_prefix

        def add_argument(*names: str, secret: bool = False, **options: Any) -> argparse.Action:
            return add(*names, **with_env(names, options, prefix, secret))

        group.add_argument = add_argument  # type: ignore[method-assign]
        return group
