#!/usr/bin/env python
"""Convert a Llama-style checkpoint to QK-MAP attention: the same as ``qkmap convert SRC DST ...``.

    python conversion/convert_llama_to_qkmap.py SRC DST [--init exact|native] [--num-frequencies F]
        [--dtype bfloat16|float32] [--gguf-file NAME] [--verify TEXTFILE] [--overwrite]

All logic lives in ``qkmap_hf`` (``qkmap_hf.packaging.convert_checkpoint``); this script only hands its arguments to the
command's parser.
"""

import sys

from qkmap_hf.commands.convert import main

if __name__ == "__main__":
    sys.exit(main(prog="convert_llama_to_qkmap.py"))
