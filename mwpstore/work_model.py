"""The work model: every transition of ``WORK_MODEL.md`` beyond groups and missions.

Importing this module registers the kinds (the registry imports it on first use):

    memberships  membership.add, membership.change, membership.remove, session.replace
    workitems    workitem.create, workitem.claim, workitem.start, lease.renew,
                 workitem.checkpoint, workitem.publish, workitem.block, workitem.resolve,
                 workitem.submit, workitem.fail, workitem.reassign, workitem.cancel,
                 workitem.charge, lease.expire
    approvals    approval.request, approval.decide

and re-exports the pure functions other components use: the keys of ``work_keys``, the Work
Contract's :func:`backoff_ms`, and :func:`lapsed_workitems` for the engine's lease sweep. The table
of transitions (who, body fields, rejections, effects) is in ``docs/work-model.md``.
"""

from __future__ import annotations

from . import approvals, memberships, workitems  # noqa: F401  (register the kinds)
from .approvals import approval_key
from .contracts import backoff_ms, parse_contract
from .leases import lapse_reason, lapsed_workitems, lease_is_live, workitem_key
from .work_keys import attempt_key, external_idempotency_key, lease_id_for
from .workitems import retry_outcome

WORK_MODEL_KINDS = (
    "membership.add",
    "membership.change",
    "membership.remove",
    "session.replace",
    "workitem.create",
    "workitem.claim",
    "workitem.start",
    "lease.renew",
    "workitem.checkpoint",
    "workitem.publish",
    "workitem.block",
    "workitem.resolve",
    "workitem.submit",
    "workitem.fail",
    "workitem.reassign",
    "workitem.cancel",
    "workitem.charge",
    "lease.expire",
    "approval.request",
    "approval.decide",
)

__all__ = [
    "WORK_MODEL_KINDS",
    "approval_key",
    "attempt_key",
    "backoff_ms",
    "external_idempotency_key",
    "lapse_reason",
    "lapsed_workitems",
    "lease_id_for",
    "lease_is_live",
    "parse_contract",
    "retry_outcome",
    "workitem_key",
]
