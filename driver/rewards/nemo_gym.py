"""NeMo Gym's single-turn environments as a reward (axolotl's reward_nemo_gym_verify): every completion
goes to a NeMo Gym resources server's POST /verify with its dataset row, and the `reward` the server
answers is the completion's reward. The server runs apart, in its own Python 3.12 venv (`make
nemo-gym`; `python -m driver.rewards.nemo_gym_server` starts one): docs/rewards.md "NeMo Gym".

Data. A NeMo Gym dataset is jsonl rows {"responses_create_params": {"input": [messages], ...}, <the
verifier's fields, e.g. expected_answer>}. `prompt_from_row`, as data.transform, makes those messages
the prompt and keeps every field, which the reward functions receive as columns.

The request (nemo_gym/base_resources_server.py BaseVerifyRequest, extended by each server with its
fields): the row's fields, its `responses_create_params`, and `response`, the completion as an OpenAI
Responses API response (one assistant message whose output_text is the completion). The answer is the
request echoed with `reward` (a float) and the server's own fields.

Rows loaded with `datasets` come back with every column any row has, null where a row had none (and,
in some of its versions, so do nested dicts: the messages). Null and absent mean the same in the
Responses API and to the servers' request models, where a null can fail validation (a Literal field
with a default), so nulls are left out of the request.

Standard library only: a reward worker that imports it loads no torch.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

from driver.data.conversation import completion_text

ROLES = {"developer": "system"}  # Responses API roles chat templates do not know -> theirs
TEXT_PARTS = ("input_text", "output_text", "text")  # content parts that carry text
RETRIED_STATUSES = (429, 500, 502, 503, 504)  # busy or restarting; any other error status is an answer
START_COMMAND = "python -m driver.rewards.nemo_gym_server <resources server>"


def prompt_from_row(row: dict) -> dict:
    """data.transform for NeMo Gym rows: `prompt` = the chat messages of responses_create_params
    (its `instructions` first, as a system message); every field stays for the verifier."""
    params = row.get("responses_create_params")
    if not isinstance(params, dict) or params.get("input") is None:
        raise ValueError(f"not a NeMo Gym row: no responses_create_params.input (columns: {sorted(row)})")
    row["prompt"] = input_messages(params)
    return row


def input_messages(params: dict) -> list[dict]:
    """Chat messages {role, content} from Responses API create params (input: text or messages)."""
    items = params["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    messages = [{"role": "system", "content": params["instructions"]}] if params.get("instructions") else []
    for item in items:
        kind = item.get("type")
        if kind not in (None, "message"):
            raise ValueError(f"responses_create_params.input holds a {kind!r} item: single-turn verify takes "
                             "messages only (tool calls and their outputs are multi-turn: NeMo Gym's agent /run)")
        messages.append({"role": ROLES.get(item["role"], item["role"]), "content": message_text(item["content"])})
    return messages


def message_text(content) -> str:
    if isinstance(content, str):
        return content
    other = sorted({str(part.get("type")) for part in content} - set(TEXT_PARTS))
    if other:
        raise ValueError(f"a message holds {', '.join(other)} content: only text prompts are supported")
    return "".join(part["text"] for part in content)


def without_nulls(value):
    """`value` with every null dict entry left out, recursively (see the module's docstring)."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def responses_api_response(text: str, model: str) -> dict:
    """A completion as the OpenAI Responses API response a NeMo Gym model server would return for it:
    one completed assistant message with the text as its output_text."""
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": time.time(), "model": model,
            "status": "completed", "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
            "output": [{"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}]}


def verify_request(row: dict, prompt, completion, model: str) -> dict:
    """The /verify body for one completion of a row. A row without responses_create_params (not NeMo
    Gym's data) sends its prompt as the input, as axolotl does."""
    params = row.get("responses_create_params")
    if params is None:
        params = {"input": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt}
    return without_nulls({**row, "responses_create_params": params,
                          "response": responses_api_response(completion_text(completion), model)})


class NemoGymUnavailable(RuntimeError):
    """The resources server did not answer (refused, timed out, or busy) after every retry."""


class NemoGymRequestFailed(RuntimeError):
    """The resources server answered, with an error (a bad row, a bug in the verifier): not retried."""


def verify(url: str, timeout: float = 30.0, retries: int = 3, backoff: float = 1.0, max_concurrency: int = 16,
           model: str = "policy") -> NemoGymVerify:
    """The reward (a rewards.functions entry with these as `kwargs`): POST {url}/verify per completion.

    url: the resources server (http://host:port). timeout: seconds one request may take (axolotl's
    nemo_gym_verify_timeout). retries: more tries of a request the server did not answer, or answered
    busy (429, 5xx), waiting backoff * 2**k seconds before the k-th. max_concurrency: requests in
    flight at once, per call (one call scores a group). model: the model name the response carries.

    The server must answer now (tried as a request is): a server that is down is a config error at
    start-up, naming the URL, rather than a failure at the first step."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url must be the resources server's http://host:port, got {url!r}")
    if not timeout > 0 or not isinstance(retries, int) or retries < 0 or not backoff >= 0:
        raise ValueError(f"need timeout > 0, retries >= 0 (an int), backoff >= 0; got {timeout!r}, {retries!r}, "
                         f"{backoff!r}")
    if not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ValueError(f"max_concurrency must be a positive int, got {max_concurrency!r}")
    reward = NemoGymVerify(url.rstrip("/"), float(timeout), retries, float(backoff), max_concurrency, model)
    try:
        reward.request("GET", "/")  # NeMo Gym servers' liveness route
    except (NemoGymUnavailable, NemoGymRequestFailed) as error:
        raise ValueError(error) from None
    return reward


class NemoGymVerify:
    """The reward verify() returns: a class, not a closure, so that it pickles."""

    __name__ = "reward_nemo_gym_verify"  # axolotl's: rewards/reward_nemo_gym_verify/* as in an axolotl run

    def __init__(self, url: str, timeout: float, retries: int, backoff: float, max_concurrency: int,
                 model: str) -> None:
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff
        self.max_concurrency, self.model = max_concurrency, model

    def __call__(self, prompts: list, completions: list, completion_ids: list | None = None, trainer_state=None,
                 **columns: list) -> list[float]:
        """One reward per completion, the server's; `columns` are the rows' fields, one list each."""
        del completion_ids, trainer_state  # the server scores the text (they are not the row's fields)
        bodies = [verify_request({key: values[i] for key, values in columns.items()}, prompts[i], completion,
                                 self.model) for i, completion in enumerate(completions)]
        if not bodies:
            return []
        with ThreadPoolExecutor(min(self.max_concurrency, len(bodies))) as pool:
            return list(pool.map(self.reward, bodies))

    def reward(self, body: dict) -> float:
        answer = self.request("POST", "/verify", body)
        reward = answer.get("reward") if isinstance(answer, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise NemoGymRequestFailed(f"{self.url}/verify answered without a numeric reward: {str(answer)[:300]}")
        return float(reward)

    def request(self, method: str, path: str, body: dict | None = None):
        """The JSON answer, after up to `retries` more tries of a request not answered (or answered 429/5xx)."""
        return json_request(self.url, method, path, body, self.timeout, self.retries, self.backoff)


def json_request(url: str, method: str, path: str, body: dict | None, timeout: float, retries: int, backoff: float,
                 server: str = "NeMo Gym resources server", start_hint: str = START_COMMAND):
    """The JSON answer of the `server` at url, after up to `retries` more tries of a request not answered (or
    answered 429/5xx), waiting backoff * 2**k seconds before the k-th. NemoGymUnavailable names the server and
    how to start one (start_hint); NemoGymRequestFailed carries its error answer."""
    data = None if body is None else json.dumps(body, default=str).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            request = urllib.request.Request(url + path, data=data, headers=headers, method=method)
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                text = reply.read()
            return json.loads(text or b"null")
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            if error.code not in RETRIED_STATUSES:
                raise NemoGymRequestFailed(f"{server} {url}: {method} {path} answered HTTP {error.code}: "
                                           f"{detail}") from None
            failure = f"HTTP {error.code}: {detail}"
        except urllib.error.URLError as error:  # refused, unknown host: the reason names it
            failure = str(error.reason)
        except (TimeoutError, ConnectionError, http.client.HTTPException) as error:
            failure = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        except json.JSONDecodeError:
            raise NemoGymRequestFailed(f"{server} {url}: {method} {path} answered something other than JSON: "
                                       f"{text[:200]!r}") from None
    raise NemoGymUnavailable(f"{server} {url} did not answer {method} {path} ({retries + 1} tries, each within "
                             f"{timeout:g} s; last: {failure}): is it running? ({start_hint})")
