"""``python -m edgec.runtime BUNDLE "PROMPT"``: generate on a machine that has only the runtime installed
(numpy, onnxruntime, tokenizers — no click, no torch)."""

from __future__ import annotations

import argparse
import sys

from edgec.errors import EdgecError, one_line
from edgec.runtime import GenerationStats, Model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgec.runtime", description=__doc__)
    parser.add_argument("bundle")
    parser.add_argument("prompt")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat format")
    parser.add_argument("--stop", action="append", default=[], help="end where this text appears (repeatable)")
    parser.add_argument("--repeat-penalty", type=float, default=1.0, help="> 1: seen tokens less likely (1 = off)")
    parser.add_argument(
        "--trust",
        action="append",
        metavar="PUBKEY",
        help="run only a bundle signed by this public key (repeat for several; needs 'edgec[trust]')",
    )
    args = parser.parse_args(argv)
    try:
        model = Model.load(args.bundle, trust=args.trust)
        stats = GenerationStats()
        for piece in model.generate(
            args.prompt,
            chat=args.chat,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            stop=args.stop,
            repeat_penalty=args.repeat_penalty,
            stats=stats,
            stream=True,
        ):
            print(piece, end="", flush=True)
        print()
        print(stats.line(), file=sys.stderr)
    except EdgecError as error:
        print(f"error: {one_line(error, 2000)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
