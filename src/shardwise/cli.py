"""`shardwise <command> [args]`: a thin dispatcher; each command lives in shardwise.commands."""

from __future__ import annotations

import difflib
import importlib
import sys

COMMANDS = {
    "train": "a real sharded training run (GPT on local text; `make run`)",
    "plan": "memory and time plan: will it fit, how fast",
    "bench": "side by side with PyTorch FSDP2, DDP and the no-communication bound",
    "explore": "the explorer: watch FSDP shard, gather, reduce and learn in the browser",
    "export": "a sharded checkpoint -> consolidated safetensors, or a Hugging Face folder",
    "generate": "sample text from a run's checkpoint or an export folder",
    "demo": "the FSDP hello-world: a 676-parameter MLP on 2 local processes",
}


def usage() -> str:
    lines = ["usage: shardwise <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, text in COMMANDS.items()]
    lines += ["", "`shardwise <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a command is required: the list on stderr, a usage error's status
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"shardwise {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        near = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        print(f"shardwise: error: unknown command {name!r}; {hint}choose one of: "
              f"{', '.join(COMMANDS)} (see `shardwise --help`)", file=sys.stderr)
        return 2
    module = importlib.import_module(f"shardwise.commands.{name}")
    try:
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:
        # A command without its own handling: one line, the shell's status for SIGINT.
        print(f"shardwise {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from .launch import Interrupted, WorkerFailure

        if isinstance(e, Interrupted):
            print(f"shardwise {name}: interrupted ({e})", file=sys.stderr)
            return e.exit_code
        if isinstance(e, WorkerFailure):
            if e.traceback:
                print(f"shardwise {name}: rank {e.rank} crashed:\n{e.traceback.rstrip()}",
                      file=sys.stderr)
            print(f"shardwise {name}: error: rank {e.rank}: {e.message}", file=sys.stderr)
            return e.exit_code
        raise


if __name__ == "__main__":
    sys.exit(main())
