"""`kvtransport keygen`: make this host's identity (an X25519 key pair) for peer binding."""

from __future__ import annotations

import argparse

NAME = "keygen"
HELP = "make this host's identity (X25519 key pair) for transfers bound to their peers"
DESCRIPTION = """\
Write a new X25519 key pair: the private key (hex) to FILE, mode 0600 in a directory made
0700, and the public key (hex) to FILE.pub, mode 0644. An existing FILE is never replaced.
Only the .pub file goes to other hosts: a sender passes the receiver's as --peer-pub, a
receiver lists the senders' it allows with --allow-pub (a file, or a directory of *.pub
files). Transfers are then bound to both identities: a capture replayed to another
receiver opens nothing there, and a sender not allowed opens no session. A pre-shared key
is mixed in when one is also named (--key-file, --key-stdin, $KVT_KEY).

Examples:
  kvtransport keygen                       # ~/.config/kvtransport/identity(.pub)
  kvtransport keygen --identity rx.id      # rx.id and rx.id.pub
  kvtransport recv --allow-pub tx.id.pub --identity rx.id
  kvtransport send RX:9400 --peer-pub rx.id.pub --identity tx.id
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--identity", metavar="FILE",
                   help="where the private key goes (default "
                   "~/.config/kvtransport/identity; $XDG_CONFIG_HOME when set)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from kvtransport.core.keys import default_identity_path, generate_identity, public_path

    path = default_identity_path() if args.identity is None else args.identity
    public = generate_identity(path)
    print(f"identity {path} (mode 0600); public key {public_path(path)}: {public.hex()}")
    return 0
