"""
The parity matrix within an account group (issue 22): the client key is
bound to C{groups: {team: [bad, good]}} and a third, most preferred
account C{outsider} (priority 0) sits outside the group. Rows of the
matrix (L{tests.integration.test_parity_matrix}) must give the same
prescribed outcome, state and decisions on every entrypoint as without the
group, and C{outsider} must never see a request -- not as the first
choice, not as a failover target, not when the group is exhausted.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted

from tests.integration import parity as P
from tests.integration.harness import RELAY_KEY
from tests.integration.parity import BAD
from tests.integration.test_parity_matrix import DRIVERS, ROWS, checkRow, formatRow

OUTSIDER = "cred-outsider"

GROUP_ROWS = [r for r in ROWS if r.name in ("5xx", "5xx_exhausted", "429_rate_limit", "refused")]


async def runGroupCell(row, entrypoint: str):
    accounts = [dict(a) for a in row.accounts]
    if row.driver == "refused":
        accounts[0]["base_url"] = f"http://127.0.0.1:{P.closedPort()}/v1"
    members = [a["id"] for a in accounts]
    accounts.append({"id": "outsider", "credential": OUTSIDER, "priority": 0})
    keys = json.dumps([{"name": "test", "key": RELAY_KEY, "concurrency": 0, "group": "team"}])
    stack = await P.startParityStack(entrypoint, accounts, row.firstOutputTimeout, keys=keys,
                                     extra=f"groups: {{team: {json.dumps(members)}}}\n")
    clients = []
    try:
        fault = row.faultFor(entrypoint)
        if fault is not None and row.driver != "laterTurn":
            stack.emulator.setFault(BAD, dict(fault, transport=P.upstreamTransport(entrypoint)))
        cell = await DRIVERS[row.driver](stack, row, entrypoint, clients)
        reached = stack.emulator.requestsFor(OUTSIDER)
        return cell, len(reached)
    finally:
        await P.drain(stack, clients)


@pytest.mark.parametrize("row", GROUP_ROWS, ids=[r.name for r in GROUP_ROWS])
@pytest_twisted.ensureDeferred
async def test_parity_row_in_group(row):
    """
    R86 within a group: the row's prescribed outcome and state on every
    entrypoint, equal decisions, and no request to the account outside the
    key's group.
    """
    cells, outside = {}, {}
    for entrypoint in row.columns:
        cells[entrypoint], outside[entrypoint] = await runGroupCell(row, entrypoint)
    problems = checkRow(row, cells)
    problems += [f"{ep}: {n} request(s) reached the account outside the group"
                 for ep, n in outside.items() if n]
    table = formatRow(row, cells, problems)
    print("\n" + table)
    assert not problems, table + "\n   PROBLEMS:\n   " + "\n   ".join(problems)
