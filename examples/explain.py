"""Capture a draft step, run the specpass passes on it, print the graph and what they did.

    python examples/explain.py            # the toy draft's catch-up step on CPU
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # models/ lives in the repo root

import specpass  # noqa: E402
from models.toy import ToyDraft  # noqa: E402
from specpass.testing import graph_str  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4, help="rows per request (spec_num_tokens)")
    parser.add_argument("--graphs", action="store_true", help="also print the graph before and after")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = ToyDraft(batch=args.batch).eval()
    tokens = torch.randint(0, 64, (args.batch, args.rows))
    positions = torch.arange(args.rows)
    with torch.no_grad():
        gm = specpass.capture(model, tokens, positions)
        result = specpass.rewrite(gm)
        if args.graphs:
            print("== captured ==\n" + graph_str(gm) + "\n== rewritten ==\n" + graph_str(result.graph_module))
        print(result.report)
        compiled = torch.compile(model, backend=specpass)
        model.k_cache.zero_()
        got = compiled(tokens, positions)
        model.k_cache.zero_()
        want = model(tokens, positions)
    print(f"compiled with specpass == eager: {torch.allclose(got, want, atol=1e-5)}")


if __name__ == "__main__":
    main()
