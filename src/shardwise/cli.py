"""`shardwise <command> [args]`: a thin dispatcher; each command lives in shardwise.commands."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": "a real sharded training run (GPT on local text; `make run`)",
    "plan": "memory and time plan: will it fit, how fast",
    "bench": "side by side with PyTorch FSDP2, DDP and the no-communication bound",
    "explore": "the explorer: watch FSDP shard, gather, reduce and learn in the browser",
    "export": "a sharded checkpoint -> one consolidated safetensors file",
    "demo": "the FSDP hello-world: a 676-parameter MLP on 2 local processes",
}


def usage() -> str:
    lines = ["usage: shardwise <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, text in COMMANDS.items()]
    lines += ["", "`shardwise <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"shardwise {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"shardwise: error: unknown command {name!r}; choose one of: "
              f"{', '.join(COMMANDS)} (see `shardwise --help`)", file=sys.stderr)
        return 2
    module = importlib.import_module(f"shardwise.commands.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
