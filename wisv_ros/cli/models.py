"""List the registry models or prepare their weights: locate the GGUF file (llama_cpp backend) and,
unless --gguf-only, convert it once into a Hugging Face folder (torch backend).

    python -m wisv_ros.cli.models list
    python -m wisv_ros.cli.models prepare qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct
    python -m wisv_ros.cli.models prepare --gguf-only qwen2.5-coder-1.5b-instruct
"""
from __future__ import annotations

import argparse
import sys
import time

from wisv_ros.sd.models import REGISTRY, MissingModelError, cache_dir, gguf_path, resolve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.models", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="registry names, licences and install commands")
    prep = sub.add_parser("prepare", help="locate and convert weights into the cache (idempotent)")
    prep.add_argument("names", nargs="+", help="registry names, HF folders or .gguf files")
    prep.add_argument("--gguf-only", action="store_true",
                      help="only locate (join) the GGUF files: what the llama_cpp backend runs; no conversion")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for name, src in REGISTRY.items():
            print(f"{name}\n  licence: {src.licence}\n  install: {src.install}")
        print(f"conversion cache: {cache_dir()}")
        return 0
    for name in args.names:
        t0 = time.perf_counter()
        try:
            folder = gguf_path(name) if args.gguf_only else resolve(name)
        except MissingModelError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"models: {name}: {folder} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
