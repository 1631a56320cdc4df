"""``transpile inspect`` and ``transpile view``: read OUT back and show what the rewrite produced.

Reads OUT through the contract (contract/: plan.json's reader, the collectives' schema and the ALAP
cut rule) and onnx; imports neither ``transpiler`` nor ``runtime``. Modules, lowest first:
``model`` (facts about one graph), ``costs`` (collectives, traffic, segments), ``diff``,
``outdir`` (plan.json), ``report`` (the JSON-able report), ``render`` and ``draw`` (showing it),
``cli`` and ``view`` (the commands). Docs: docs/inspect.md.
"""
