"""One module per `kvtransport` subcommand.

Each module defines:

- ``NAME``: the subcommand's name (``kvtransport NAME``);
- ``HELP``: one line for ``kvtransport --help``;
- ``DESCRIPTION`` (optional): the longer text of ``kvtransport NAME --help``;
- ``add_arguments(parser)``: declare the options (cheap: no heavy imports here);
- ``run(args) -> int``: do the work; import torch, transformers etc. inside, lazily.

The CLI discovers modules in this package, so a new subcommand is one new file.
"""
