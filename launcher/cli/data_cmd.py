"""`launcher data prepare | show | verify`: tokenized datasets (docs/data.md).

  launcher data prepare FILE... -o DIR [--tokenizer F] [--vocab-size N] [--glob PAT] ...
  launcher data show DIR [--json]        tokens, documents, unigram entropy per split; tokenizer, shards
  launcher data verify DIR [--sizes]     every file against the manifest; exit 1 naming each bad one

Thin over launcher.data.prepare and launcher.data.manifest, imported inside the commands (so
`launcher --help` pays for neither, nor for `tokenizers`).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List


def add_parser(sub) -> None:
    d = sub.add_parser("data", help="tokenized datasets: prepare, show, verify", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    dsub = d.add_subparsers(dest="data_cmd", required=True)

    s = dsub.add_parser("prepare", help="tokenize text files (plain text, JSONL) into a dataset directory",
                        description="Tokenize text files into DIR: a tokenizer (byte-level BPE trained on the inputs, "
                        "or --tokenizer), content-hashed token shards per split (train, val) and a manifest. Each "
                        "plain-text file is one document; each line of a .jsonl file is one (its --text-field). "
                        "Every input is checked before anything is written; an existing dataset in DIR is "
                        "replaced whole.")
    s.add_argument("files", nargs="+", metavar="FILE", help="text or .jsonl files; directories with --glob")
    s.add_argument("-o", "--out", required=True, metavar="DIR", help="the dataset directory (new, empty, or a "
                   "dataset to replace)")
    s.add_argument("--tokenizer", metavar="FILE", help="a Hugging Face tokenizer.json to use (copied into DIR) "
                   "instead of training one")
    s.add_argument("--vocab-size", type=int, metavar="N", help="vocabulary of the trained tokenizer "
                   "(default 4096; at least 257)")
    s.add_argument("--text-field", default="text", metavar="K", help="the key of a JSONL line's text (default: text)")
    s.add_argument("--val-fraction", type=float, default=0.01, metavar="F",
                   help="share of documents in the val split, chosen by a hash of their content (default 0.01)")
    s.add_argument("--workers", type=int, metavar="N", help="processes encoding (default: every core)")
    s.add_argument("--glob", metavar="PAT", action="append", help="take the files matching PAT (e.g. '*.py') "
                   "under each directory given, recursively; repeat for several patterns")
    s.add_argument("--shard-tokens", type=int, metavar="N", help="tokens per shard before the next one "
                   "starts (at a document boundary; default 33554432)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar (none anyway when stderr is not "
                   "a terminal)")
    s.set_defaults(fn=cmd_prepare)

    s = dsub.add_parser("show", help="summary of a dataset: tokens, documents and unigram entropy per split, "
                        "tokenizer, shards")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--json", action="store_true", help="the manifest as JSON")
    s.set_defaults(fn=cmd_show)

    s = dsub.add_parser("verify", help="check every file of a dataset against its manifest (exit 1 naming "
                        "each missing or changed file)")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--sizes", action="store_true", help="sizes only (fast: reads no file)")
    s.set_defaults(fn=cmd_verify)


def _fail(args, e: Exception) -> int:
    print(f"launcher data {args.data_cmd}: {e}", file=sys.stderr)
    return 2


def cmd_prepare(args) -> int:
    from launcher.data import prepare
    from launcher.data.manifest import DEFAULT_SHARD_TOKENS, DatasetError

    try:
        m = prepare.prepare(args.files, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                            text_field=args.text_field, val_fraction=args.val_fraction, workers=args.workers,
                            shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS, glob=args.glob,
                            progress=not args.no_progress)
    except DatasetError as e:
        return _fail(args, e)
    except OSError as e:  # the dataset could not be written (a full disk, a read-only parent): nothing was put in place
        return _fail(args, f"cannot write {args.out}: {e}; nothing was changed there")
    size = sum(i.size for i in m.inputs)
    tokens = sum(s.tokens for s in m.splits.values())
    print(f"prepared {m.dir}: {len(m.inputs)} file(s), {size / 1e6:.1f} MB, "
          f"{sum(s.documents for s in m.splits.values()):,} documents -> {tokens:,} tokens "
          f"(train {m.split('train').tokens:,}, val {m.split('val').tokens:,}) in {m.prepare.seconds:.1f} s, "
          f"{m.prepare.tokens_per_s:,.0f} tokens/s, {m.prepare.workers} worker(s)")
    return 0


def cmd_show(args) -> int:
    from launcher.data.manifest import DatasetError, Manifest
    from launcher.data.stats import unigram_entropy

    try:
        m = Manifest.load(args.dir)
    except DatasetError as e:
        return _fail(args, e)
    if args.json:
        print(json.dumps(m.to_json(), indent=2))
        return 0
    t = m.tokenizer
    rows: List[List[str]] = [["split", "documents", "tokens", "longest", "shards", "entropy"]]
    for name, s in m.splits.items():
        try:  # reads the split's shards (the manifest alone has no token counts)
            h = unigram_entropy(m, name)
        except (OSError, ValueError) as e:  # missing, or cut short of a whole token
            return _fail(args, f"{m.dir}: a {name} shard cannot be read ({e}); `launcher data verify` names it")
        rows.append([name, f"{s.documents:,}", f"{s.tokens:,}", f"{s.longest_document:,}", str(len(s.shards)),
                     "-" if h is None else f"{h:.3f}"])
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    print(f"dataset    {m.dir}  ({m.format})")
    source = f" from {t.source}" if t.source else ""
    print(f"tokenizer  {t.kind}{source}, vocab {t.vocab_size:,}, eos id {t.eos_id}, {m.dtype}"
          + (f"  ({t.file} sha256 {t.sha256[:16]})" if t.file and t.sha256 else ""))
    print(f"inputs     {len(m.inputs)} file(s), {sum(i.size for i in m.inputs) / 1e6:.1f} MB; "
          f"val fraction {m.val_fraction}; text field {m.text_field!r}")
    print(f"prepared   in {m.prepare.seconds:.1f} s, {m.prepare.tokens_per_s:,.0f} tokens/s, "
          f"{m.prepare.workers} worker(s)")
    for r in rows:
        print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print("  (entropy: the unigram entropy of the split's tokens, nats per token: the loss of the best "
          "model that ignores context)")
    for s in m.splits.values():
        for sh in s.shards:
            print(f"  {sh.bin}  {sh.documents:,} documents, {sh.tokens:,} tokens")
    return 0


def cmd_verify(args) -> int:
    from launcher.data.manifest import verify

    problems = verify(args.dir, hashes=not args.sizes)
    for line in problems:
        print(f"launcher data verify: {line}", file=sys.stderr)
    if problems:
        print(f"launcher data verify: {len(problems)} problem(s); prepare the dataset again "
              "(launcher data prepare) or restore the files", file=sys.stderr)
        return 1
    print(f"{args.dir}: intact ({'sizes' if args.sizes else 'sizes and sha256'} of every file match the manifest)")
    return 0
