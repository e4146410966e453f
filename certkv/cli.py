"""Command line entry point ``certkv``."""

from __future__ import annotations

import argparse
import sys

from certkv.errors import CertKVError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="certkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="one certified decode step on synthetic data: dense vs "
                                       "naive vs certified, with the per-head certificate")
    demo.add_argument("--context", type=int, default=2048, help="cached tokens (default 2048)")
    demo.add_argument("--kv-heads", type=int, default=8)
    demo.add_argument("--group", type=int, default=4, help="query heads per kv head (GQA)")
    demo.add_argument("--head-dim", type=int, default=128)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        from certkv.demo import run_demo

        run_demo(args.context, args.kv_heads, args.group, args.head_dim, args.seed)
    except CertKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
