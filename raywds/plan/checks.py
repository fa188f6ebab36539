"""A plan's verdict: settings that would hang or lose data are refused before any step, with
the fix; the rest are warnings and notes.

    raywds plan --data shards/ --nodes 4 --gpus-per-node 8 --workers 8 --batch-size 256 --mode split
"""

from __future__ import annotations

import logging

from raywds.data.manifest import Manifest
from raywds.errors import ConfigError
from raywds.plan.epoch import EpochPlan, Finding

log = logging.getLogger(__name__)


def check(plan: EpochPlan, *, num_shards: int) -> list[Finding]:
    """The common findings, then the mode's own."""
    found: list[Finding] = []
    share = plan.num_samples / plan.num_ranks
    if plan.batch_size > share and not plan.resumed:
        found.append(
            Finding(
                "warn",
                (
                    f"batch {plan.batch_size} per rank is more than a rank's share of the data "
                    f"({plan.num_samples} samples / {plan.num_ranks} ranks = {share:.0f}): "
                    f"every epoch is {plan.max_batches} step(s) per rank"
                    + (" of a partial batch" if plan.mode.exact else ", so samples repeat within each batch")
                    + f"; use --batch-size {max(int(share), 1)} or less"
                ),
            )
        )
    return found + plan.mode.findings(plan, num_shards=num_shards)


def refusals(findings: list[Finding]) -> list[str]:
    return [f.text for f in findings if f.level == "refuse"]


def verdict(findings: list[Finding]) -> str:
    refused = refusals(findings)
    if refused:
        return "REFUSED: " + refused[0]
    warned = [f.text for f in findings if f.level == "warn"]
    return "OK, but " + warned[0] if warned else "OK"


def check_plan(plan: EpochPlan, manifest: Manifest) -> None:
    """Refuse, before any step, a plan that would hang or lose data; log its warnings."""
    findings = check(plan, num_shards=len(manifest.shards("train")))
    refused = refusals(findings)
    if refused:
        raise ConfigError(refused[0])
    for finding in findings:
        if finding.level == "warn":
            log.warning("%s", finding.text)
