"""`python -m interlace.train [train options]`: one rank of `interlace train` (what torchrun and
`interlace train --nproc N` start)."""

import sys

from interlace.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
