"""Subcommands of the ``qkmap`` CLI; each module is a thin layer over the library."""
