"""Gates 1 to 5 of a guarded call (section 2.4 of the contract): the policy's tools, the
capabilities, a tool call id, the arguments keyed and their target named, and whether the call must
be approved (:mod:`guard.escalation` asks the approver). The first gate that refuses ends the call."""

from __future__ import annotations

from hashlib import sha256

from .approvals import ApprovalQueue
from .call import GuardedCall
from .canonical import NotCanonical, canonical_bytes
from .refusal import Refusal

__all__ = ["first_gates", "gates"]


def first_gates(call: GuardedCall, bind: bool = True) -> Refusal | None:
    """Gates 1-3, which do not look at the arguments; the first refusal ends the call."""
    policy, tool, eg = call.policy, call.tool, call.eg
    name = tool.name
    violation = policy.violation(name)
    if violation is not None:
        return call.refuse(
            "policy_violation",
            f"The tool {name!r} is {'denied' if violation == 'tool_denied' else 'not allowed'} "
            "by this agent's policy; it was not run.",
            bind=bind, violation_type=violation,
        )
    if tool.capabilities:
        missing = policy.missing_capabilities(tool.capabilities)
        if missing:
            return call.refuse(
                "capability_denied",
                f"The tool {name!r} needs the capabilities {', '.join(missing)}, which this agent "
                "has not been granted; it was not run.",
                bind=bind, missing_capabilities=missing,
            )
    if eg is not None and eg.require_tool_call_id and call.tool_call_id is None and not tool.reversible:
        return call.refuse(
            "tool_call_id_required",
            f"The tool {name!r} has side effects and this call carries no tool call id, so it cannot "
            "be run at most once; it was not run.",
            bind=bind,
        )
    return None


def gates(call: GuardedCall) -> Refusal | None:
    """Gates 1-4 and the decision whether to escalate (gate 5, whose approver is asked after); the
    first refusal ends the call. The arguments are keyed on the way (``call.key``, ``call.arguments``)."""
    policy, tool, eg = call.policy, call.tool, call.eg
    name = tool.name
    # Gates 1-3 cost nothing to pass when no policy list, capability or missing id is involved.
    if (policy.allowed_tools is not None or policy.denied_tools or tool.capabilities
            or (eg is not None and call.tool_call_id is None)):
        refusal = first_gates(call)
        if refusal is not None:
            return refusal
    bind_error: str | None = None
    try:
        bound, passed = tool.binder.bind(call.args, call.kwargs)
    except TypeError as e:
        bound, passed, bind_error = None, set(), str(e)
    else:
        try:
            arguments = canonical_bytes(bound)
        except NotCanonical as e:
            bind_error = f"an argument has no JSON form ({e})"
        else:
            # key_from_canonical's rule, written out: this is every guarded call's path.
            call.key = sha256(tool.key_prefix + arguments).hexdigest()
            call.arguments = arguments.decode()
    if eg is not None and eg.target_args and tool.irreversible:
        if bound is None:
            return _not_canonical(call, bind_error)
        if not any(n in passed and bound.get(n) not in (None, "") for n in eg.target_args):
            return call.refuse(
                "target_args_required",
                f"The tool {name!r} is irreversible and must name its target: pass a value for "
                f"{' or '.join(repr(n) for n in eg.target_args)}.",
                target_args=list(eg.target_args),
            )
    escalation = policy.escalation_reason(name) if policy.escalate_tools else None
    if escalation is None and eg is not None and eg.require_approval_for_irreversible and tool.irreversible:
        escalation = "every call to an irreversible tool needs approval"
    keyed = eg is not None and call.tool_call_id is not None
    if (escalation is not None or keyed) and call.key is None:
        return _not_canonical(call, bind_error)
    if escalation is not None:
        if policy.approver is None:
            return call.refuse(
                "escalation_required",
                f"The tool {name!r} needs a human's approval ({escalation}) and no approver is "
                "configured; it was not run.",
                escalation_reason=escalation,
            )
        call.escalation = escalation
        if isinstance(policy.approver, ApprovalQueue):
            if eg is None or call.call_id is None:
                return call.refuse(
                    "tool_call_id_required",
                    f"The tool {name!r} needs an operator's approval, which is kept under the call's "
                    "tool_call_id: call it with one.",
                )
            call.queue = policy.approver
    return None


def _not_canonical(call: GuardedCall, why: str | None) -> Refusal:
    return call.refuse(
        "arguments_not_canonical",
        f"The arguments to {call.tool.name!r} cannot be keyed: {why}; it was not run.",
    )
