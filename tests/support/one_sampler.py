"""One fake vLLM, its sidecar and the one-group inventory naming them: the set-up several fault tests start from."""

from __future__ import annotations

from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.fake_engines import FakeVllm


async def one_sampler(token: str, job_id: str = "s0", group_id: str = "g"):
    """Returns ``(engine, address, sidecar, inventory)``; the sidecar is started. Stop both when done."""
    engine = FakeVllm().start()
    sidecar = SidecarServer({job_id: VllmBackend(engine.url, idle_timeout_s=1)}, port=0, token=token)
    await sidecar.start()
    addr = engine.url.removeprefix("http://")
    inv = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": group_id,
                    "samplers": [{"pool": "default", "address": addr, "sidecar": f"127.0.0.1:{sidecar.port}", "job_id": job_id}],
                }
            ]
        }
    )
    return engine, addr, sidecar, inv
