"""The contract between ``transpiler/`` and ``runtime/``: what OUT holds (docs/contracts.md).

The transpiler writes OUT, the runtime and ``inspection/`` read it; this package is the one place
that says what its names, fields and ops are, so writer and readers cannot drift apart. It imports
neither ``transpiler`` nor ``runtime`` (pyproject's ruff bans), and nothing heavier than onnx.

- ``contract.collectives``: the collective ops' domain, names, attributes and the ALAP cut rule.
- ``contract.ops``: the other ops of the step graphs (fused updates, Conv weight gradient).
- ``contract.names``: names the graphs use for their non-model values (lr input, state suffixes).
- ``contract.plan``: plan.json's format, fields and the validating reader.
"""
