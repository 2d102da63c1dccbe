"""The analysis: paper tables and figures from a results tree, their W&B summary run and dashboard, the value study.

``load`` -> ``aggregate`` -> ``tables`` / ``figures`` -> ``report`` (``scripts/report.py``), ``wandb_summary`` (the
summary run), ``dashboard`` (``scripts/dashboard.py``); ``value_analysis`` / ``value_figures``
(``scripts/value_analysis.py``); ``diversity`` (kept-set overlap). It reads what the runs saved (``vase.run``) and
never the other way round. See docs/analysis.md.
"""
