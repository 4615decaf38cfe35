"""The ``kernelplan`` command: ``bench`` and ``cache info|clear``."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernelplan", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="check and time every op on this machine's device")
    bench.add_argument("suite", nargs="?", default="all", help="which suite: all (default), or an op name")
    bench.add_argument("--device", default=None, help="cpu or cuda[:i]; default: cuda if present, else cpu")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")

    cache = sub.add_parser("cache", help="inspect or clear the persistent plan cache")
    cache.add_argument("action", choices=("info", "clear"))
    cache.add_argument("--json", action="store_true", help="print info as JSON")

    args = parser.parse_args(argv)
    if args.command == "cache":
        return _cache(args)
    from .bench import run_bench

    return run_bench(args.suite, device=args.device, json_path=args.json)


def _cache(args) -> int:
    from .cache import plan_cache

    cache = plan_cache()
    if args.action == "clear":
        n = cache.clear()
        print(f"cleared {n} entries from {cache.path}")
        return 0
    info = cache.info()
    if args.json:
        print(json.dumps(info))
    else:
        print(f"path:        {info['path']}")
        print(f"entries:     {info['entries']} (max {info['max_entries']})")
        print(f"size:        {info['size_bytes'] / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
