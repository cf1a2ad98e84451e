"""Serving helpers that run next to a folder's own remote code: the vLLM plugin (``vllm_plugin``) and the
``transformers serve`` launcher (``transformers_serve``).

A package of its own, not ``qkmap_hf.*``: importing ``qkmap_hf`` registers ``model_type: qkmap`` with the Auto
classes, and transformers then prefers the installed package's classes over the folder's code; these helpers must
leave the folder's code in charge. They import neither ``qkmap_hf`` nor anything beyond the standard library at
import time.
"""
