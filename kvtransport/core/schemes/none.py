"""No repair: sources only, in utility order; whatever is lost stays lost."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtransport.core.schemes.base import OWED_NONE, RepairScheme, SenderRepair

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.core.policy_base import Policy
    from kvtransport.core.schemes.base import SenderView


class NoRepairSender(SenderRepair):
    """Sends nothing but sources and finishes once they are all out."""

    owed_model = OWED_NONE
    finishes_when_sent = True

    def tail_ok(self, left: int, esi: int, need: int) -> bool:
        return left >= need  # nothing is ever owed


class NoRepair(RepairScheme):
    name = "none"

    def sender(self, view: SenderView, policy: Policy) -> SenderRepair:
        return NoRepairSender(view, policy)


SCHEME = NoRepair()
