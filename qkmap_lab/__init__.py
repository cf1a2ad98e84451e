"""qkmap-lab: the research harness behind qkmap-hf's research pages.

It imports the plugin (``qkmap_hf``); the plugin never imports it. What it holds:

- the studies' reports: ``paper_claims`` (the paper's four claims on saved models), ``stability`` (learning-rate
  sweeps), ``task_report`` (accuracy on the synthetic tasks), ``task_probes`` (the probes on task sequences);
- the synthetic tasks (``synthetic``), offered to ``qkmap compare --task`` and ``qkmap analyze --task`` through the
  plugin's task-source entry point (``task_source``);
- the study drivers (``studies/*.sh``) and the lab notes (``notes/``).

``qkmap-lab COMMAND`` (or ``python -m qkmap_lab COMMAND``) runs a report: ``paper-claims``, ``stability``,
``task-report``.
"""
