"""Every target of the attack suite opens, and its policy has the privilege it claims."""

from __future__ import annotations

import os

import pytest

from runtimes import open_runtime

from .conftest import Hostile

pytestmark = pytest.mark.anyio


@pytest.mark.attack(0)
async def test_target_privilege_is_what_the_suite_claims(hostile: Hostile) -> None:
    async with open_runtime(hostile.config) as rt:
        uid = (await rt.exec(["id", "-u"], user=hostile.user)).stdout.strip()
    if hostile.privilege == "host":
        assert uid == str(os.getuid())
    else:
        assert (uid == "0") == (hostile.privilege == "root"), (hostile.id, uid)
