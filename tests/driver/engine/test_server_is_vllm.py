"""rollout.server_url must be vLLM's OpenAI server (python -m driver.vllm_serve, or vllm serve): one that is not,
TRL's `trl vllm-serve` above all (a TRL user's server at hand), is refused at start with what it is and what to
start instead (driver/engine/server.py).

The servers are stand-ins (tests/json_stand_in.py): TRL is not installed here. TRL's answers GET /health/ and
/get_world_size/ as trl/scripts/vllm_serve.py does, and 404 (FastAPI's {"detail": "Not Found"}) to the rest."""

import pytest

from driver.engine.launch import ServerError
from driver.engine.server import ServerGenerator
from tests.driver.engine.test_server_retries import make_config
from tests.json_stand_in import ScriptedJSONServer

NOT_FOUND = (404, {"detail": "Not Found"})
TRL_ROUTES = {"/health/": {"status": "ok"}, "/get_world_size/": {"world_size": 1}}


@pytest.fixture
def stand_in(request):
    server = ScriptedJSONServer(lambda body: NOT_FOUND[1], get=lambda path: request.param.get(path, NOT_FOUND))
    yield server
    server.stop()


@pytest.mark.parametrize("stand_in, message", [
    (TRL_ROUTES, "is TRL's `trl vllm-serve` (or axolotl's, which mirrors it): it answers /get_world_size/"),
    ({}, "is not vLLM's OpenAI server: it has no /v1/models"),
], indirect=["stand_in"], ids=["trl-vllm-serve", "another-server"])
def test_a_server_that_is_not_vllms_is_named_and_what_to_start_instead(stand_in, message):
    with pytest.raises(ServerError) as error:
        ServerGenerator(make_config(stand_in.url), "unused")
    assert message in str(error.value) and "python -m driver.vllm_serve" in str(error.value)
    assert stand_in.url in str(error.value)
