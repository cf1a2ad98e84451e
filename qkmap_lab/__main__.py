"""``python -m qkmap_lab COMMAND``."""

from .cli import main

raise SystemExit(main())
