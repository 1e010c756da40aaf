"""`kvtransport card inspect`: summarize a cache card and verify its blocks."""

from __future__ import annotations

import argparse
import json

from kvtransport.bounds import int_arg

NAME = "card"
HELP = "inspect cache cards (model, geometry, precisions, block table, checksums)"
DESCRIPTION = """\
Work with cache cards written by `kvtransport prefill`.

  kvtransport card inspect FILE [--json] [--blocks N]

prints the card's model, geometry, block size, precisions, stream and manifest sizes,
the first blocks of the stream with their utilities, creation info, and verifies every
block's CRC-32 (exit status 1 when a block is corrupted; 2 when the file is not a
readable card).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="card_command", metavar="ACTION", required=True)
    p = sub.add_parser(
        "inspect",
        help="print a card's summary and verify its checksums",
        description="Print a cache card's summary and verify every block's CRC-32.",
    )
    p.add_argument("file", metavar="FILE", help="the cache card")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--blocks",
        type=int_arg(0, 1 << 31),
        default=8,
        metavar="N",
        help="list the first N blocks (default 8)",
    )


def run(args: argparse.Namespace) -> int:
    from kvtransport.kvformat import blocks, card

    stored = card.read_card(args.file)
    info = card.summary(stored, args.file)
    m = stored.manifest
    n = max(0, min(args.blocks, m.num_blocks))
    table = [
        {
            "stream_index": i,
            "layer": int(m.layer[i]),
            "tokens": [int(m.token_start[i]), int(m.token_start[i] + m.token_count[i])],
            "precision": blocks.PRECISIONS[int(m.precision[i])],
            "offset": int(m.offset[i]),
            "length": int(m.length[i]),
            "crc32": f"{int(m.checksum[i]):08x}",
            "utility": float(m.utility[i]),
        }
        for i in range(n)
    ]
    if args.json:
        print(json.dumps({**info, "first_blocks": table}))
    else:
        _print_text(info, table)
    return 1 if info["corrupted_blocks"] else 0


def _print_text(info: dict, table: list[dict]) -> None:
    prec = ", ".join(f"{k} x{v}" for k, v in info["precisions"].items())
    lines = [
        f"card        {info['path']}",
        f"model       {info['model_id']} ({info['dtype']})",
        f"geometry    {info['layers']} layers x {info['kv_heads']} kv heads x "
        f"{info['tokens']} tokens x {info['head_dim']} head_dim",
        f"blocks      {info['blocks']} of {info['blocks_in_geometry']} "
        f"({info['block_tokens']} tokens each; quant groups: int4 {info['group_size']} "
        f"(keys per {info['int4_keys']}), int8 {info['int8_group_size']})",
        f"precisions  {prec}",
        f"stream      {info['stream_bytes']:,} bytes ({info['compression']}x compression vs "
        f"{info['dtype']}); manifest {info['manifest_bytes']:,} bytes",
        f"utility     {info['utility_held']} of the cache held; token ids {info['token_ids']}",
        f"created     {json.dumps(info['created'], sort_keys=True)}",
    ]
    bad = info["corrupted_blocks"]
    lines.append(
        f"checksums   {len(bad)} corrupted block(s): {bad[:10]}" if bad else "checksums   all ok"
    )
    lines.append("first blocks of the stream:")
    lines.append("   #  layer  tokens       prec   offset       bytes     crc32     utility")
    for b in table:
        t0, t1 = b["tokens"]
        lines.append(
            f"{b['stream_index']:4d}  {b['layer']:5d}  {t0:5d}-{t1:<5d}  {b['precision']:5s}  "
            f"{b['offset']:11,d}  {b['length']:8,d}  {b['crc32']}  {b['utility']:.6f}"
        )
    print("\n".join(lines))
