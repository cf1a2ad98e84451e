"""``transformers serve`` for a folder with remote code: ``python -m qkmap_hf_serving.transformers_serve FOLDER ...``.

Why: transformers' serve (5.24) loads a causal LM as ``getattr(transformers, config.architectures[0])``, which
only finds architectures built into transformers, so a remote-code folder fails with ``module transformers has no
attribute QKMapForCausalLM`` even under ``--trust-remote-code``. This launcher loads the folder's own class (its
remote code, as ``trust_remote_code=True`` does) and makes it reachable under that name, then runs transformers'
own CLI with the arguments unchanged. Where transformers can already load it, nothing is added.

From 5.25 transformers serve loads the model in a child process started with ``spawn``, which imports this module
again (as ``__mp_main__``) before it loads: the folder travels in ``FOLDER_VARIABLE`` and the child exposes the
architecture too, so both processes can name it.
"""

from __future__ import annotations

import os
import sys

FOLDER_VARIABLE = "QKMAP_SERVE_FOLDER"


def expose_folder_architecture(folder: str) -> str | None:
    """Make ``transformers.<architecture>`` the folder's remote class; return its name (None: nothing to do)."""
    import transformers
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    auto_map = getattr(config, "auto_map", None) or {}
    if architecture is None or hasattr(transformers, architecture) or "AutoModelForCausalLM" not in auto_map:
        return None
    model_class = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], folder)
    # Loading remote code can leave another module object under sys.modules["transformers"]: name it on both.
    for module in {
        id(transformers): transformers,
        id(sys.modules["transformers"]): sys.modules["transformers"],
    }.values():
        setattr(module, architecture, model_class)
    return architecture


def main(argv: list[str] | None = None) -> int:
    """``transformers serve FOLDER ARGS...`` with the folder's architecture exposed first."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print(
            "usage: python -m qkmap_hf_serving.transformers_serve FOLDER [transformers serve options]", file=sys.stderr
        )
        return 2
    expose_folder_architecture(argv[0])
    os.environ[FOLDER_VARIABLE] = argv[0]  # for the model's spawned process (the module docstring says why)
    from transformers.cli.transformers import main as transformers_main

    sys.argv = ["transformers", "serve", *argv]
    return transformers_main() or 0


if __name__ == "__mp_main__" and os.environ.get(FOLDER_VARIABLE):
    expose_folder_architecture(os.environ[FOLDER_VARIABLE])
elif __name__ == "__main__":
    sys.exit(main())
