"""What a package writes for README-style prompts, greedy and sampled, side by side.

Each prompt is completed greedily and at one sampled setting (seeded, so the same command prints
the same text), with the package's draft: the text is the target's alone by construction.

    python benchmarks/demo_samples.py [PKG] [-n 96] [--temperature 0.7] [--top-p 0.95] [--seed 0]
"""

from __future__ import annotations

import argparse

PROMPTS = (
    "def fibonacci(n):",
    "def quicksort(items):",
    'def read_json(path):\n    """Return the object stored in the JSON file at path."""\n',
    "class Stack:\n",
    "import os\n\n\ndef list_files(directory):\n",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import edgespec
    from edgespec.models import demo_package

    pipe = edgespec.load(args.package or demo_package())
    sampled = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    for prompt in PROMPTS:
        for name, settings in (("greedy", {"temperature": 0}), (_describe(sampled), sampled)):
            result = pipe.generate(prompt, max_new_tokens=args.max_new_tokens, **settings)
            print(f"=== {prompt!r}, {name} ({result.stats.finish_reason}, "
                  f"acceptance {result.stats.acceptance_rate:.0%})")
            print(prompt + result.text)
            print()


def _describe(settings: dict) -> str:
    return ", ".join(f"{key} {value:g}" for key, value in settings.items())


if __name__ == "__main__":
    main()
