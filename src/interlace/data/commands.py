"""`interlace data prepare` (text, JSON Lines and Parquet files, `datasets` folders → a shard
folder) and `interlace data verify` (a shard folder's sizes and hashes against its index)."""

import argparse
import os

from interlace.data.prepare import SHARD_TOKENS, prepare_shards
from interlace.data.shards import ShardIndex, verify_shards


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """Declare the `data` subcommands and their options on `parser`."""
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    prepare = sub.add_parser(
        "prepare",
        help="tokenize text, JSON Lines and Parquet files into token shards for `train --data DIR`",
        description=(
            "tokenize text, JSON Lines and Parquet files and Hugging Face datasets folders into "
            "token shards that `train --data DIR` streams"
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    prepare.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help=(
            "data files, or folders whose *.txt/*.md/*.rst files (each a document), *.jsonl "
            "files (each line a document) and *.parquet files (each row a document) are read, "
            "or a folder written by datasets' save_to_disk (each row a document)"
        ),
    )
    prepare.add_argument(
        "--tokenizer",
        required=True,
        metavar="NAME|PATH",
        help="byte, or the path of a Hugging Face tokenizer.json or of a folder holding one",
    )
    prepare.add_argument("--out", required=True, metavar="DIR", help="the shard folder to write")
    prepare.add_argument(
        "--val-fraction", type=float, default=0.05, help="share of tokens held out at the end"
    )
    prepare.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes"
    )
    prepare.add_argument(
        "--shard-tokens", type=int, default=SHARD_TOKENS, help="most token ids per shard file"
    )
    prepare.add_argument(
        "--text-field",
        "--text-column",
        dest="text_field",
        default="text",
        metavar="NAME",
        help="the field of each *.jsonl line, or the column of a Parquet file or datasets "
        "folder, that holds the document's text",
    )
    prepare.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out instead of refusing"
    )
    prepare.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar"
    )
    verify = sub.add_parser(
        "verify",
        help="check a shard folder's files against the sizes and sha256 in its index",
        description="check a shard folder's files against the sizes and sha256 in its index",
    )
    verify.add_argument("folder", metavar="DIR", help="a folder written by `data prepare`")


def run_data(args: argparse.Namespace) -> int:
    """Run the `data` subcommand in `args`; print one summary line; return the exit code 0."""
    if args.data_command == "prepare":
        index = prepare_shards(
            args.inputs,
            args.tokenizer,
            args.out,
            val_fraction=args.val_fraction,
            workers=args.workers,
            shard_tokens=args.shard_tokens,
            overwrite=args.overwrite,
            progress=args.progress,
            text_field=args.text_field,
        )
        print(f"prepared {_describe(index)} in {args.out}/")
    else:
        print(f"verified {_describe(verify_shards(args.folder))} in {args.folder}/")
    return 0


def _describe(index: ShardIndex) -> str:
    return (
        f"{index.num_tokens:,} tokens of {index.documents:,} documents in "
        f"{len(index.shards)} {index.dtype} shards (vocabulary {index.vocab_size:,})"
    )
