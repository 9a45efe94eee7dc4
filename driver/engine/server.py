"""vLLM as an OpenAI-compatible server: launched here on 127.0.0.1 (driver/engine/launch.py), or
reached at rollout.server_url, one URL or several data-parallel servers (driver/engine/server_client.py:
timeouts, retries, round-robin).

Every sync hot-loads the adapter under a new name (/v1/load_lora_adapter) into every server and unloads
those older than the newest keep_versions (prefetched jobs may still sample with them); with
rollout.weight_sync = merged (and under full fine-tuning) it writes the merged (whole) weights into the
version's directory instead and every server reloads them in place (/collective_rpc reload_weights), one
version served at a time. Generation and the sync probe go through /v1/completions with token-id
prompts, so nothing is re-tokenized on the way and the sampled token ids come back exactly
("token_id:123" strings). The probe runs on every server, each checked against the trainer on its own.
"""

from __future__ import annotations

import copy
import functools
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch
from torch import nn

from driver.config import Config, SamplingConfig
from driver.engine.base import Completion, Request, SyncError, generate_by_stream
from driver.engine.launch import LaunchedServer, ServerError
from driver.engine.server_client import MAX_CONNECTIONS, ServerClient
from driver.engine.server_worker import EXTENSION, RELOAD_METHOD
from driver.engine.sync_check import SyncVerifier
from driver.engine.weight_sync import save_merged

MERGED_DIR = "merged"  # in a version's directory: the merged weights a server reloads
CLOSE_TIMEOUT_S = 10.0  # best-effort cleanup on a server we only connected to
TOKEN_ID_PREFIX = "token_id:"  # how return_tokens_as_token_ids spells a token
MODE_CHECK_TEMPERATURE = 2.0  # hot, so most sampled tokens are not the likeliest one
MODE_CHECK_TOKENS = 16
MODE_CHECK_MIN_GAP = 0.5  # nats between the likeliest and the sampled token: far above bf16 noise
ALREADY_LOADED = "has already been loaded"  # vLLM's answer (HTTP 400) to a second load under one name
# The server fills every sampling field a request leaves out from the model's generation_config.json
# (Qwen2.5 ships repetition_penalty 1.05, for one), which would silently change the distribution we
# sample from; the colocated engine uses these neutral values, so every request states them.
NEUTRAL_SAMPLING = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0)
TRL_SERVER_ROUTE = "/get_world_size/"  # TRL's vllm-serve answers it (and axolotl's, which mirrors it); vLLM's not

def server_sampling(sampling: SamplingConfig) -> dict:
    """The sampling fields of a /v1/completions request (vLLM's extra parameters beside OpenAI's), every
    penalty stated so that a server's own defaults cannot change the distribution sampled from."""
    body = {**NEUTRAL_SAMPLING, **sampling.engine_sampling()}
    if sampling.structured_outputs is not None:
        body["structured_outputs"] = dict(sampling.structured_outputs)
    return body


class ServerGenerator:
    def __init__(self, config: Config, model_dir: str, merge_from: nn.Module | None = None) -> None:
        """merge_from: the trainer's PEFT model, whose base + adapter every sync writes merged for the servers to
        reload (rollout.weight_sync = merged); None loads each adapter version (or, under full fine-tuning,
        reloads the whole model the trainer saved)."""
        self.config = config
        self.adapter_version = 0
        self._merge_from = merge_from
        # Full fine-tuning and merged weights: each sync reloads weights in place, one version served at a time
        # (and its directory is read during the sync: no older one is kept).
        self.full_weights = self.serves_one_version = config.model.adapter == "none" or merge_from is not None
        self.keep_versions = 1 if self.full_weights else 2
        self._roots: dict[str, str] = {}  # url -> the weights that server started with (merged: restored at close)
        self._merged_pushed = False
        self._reload_methods: dict[str, str] = {}  # url -> the worker method reloading its weights
        self._names: dict[int, str] = {}  # version -> adapter name, the newest keep_versions
        self._server: LaunchedServer | None = None
        self._client: ServerClient | None = None
        self._verifiers: dict[str, SyncVerifier] = {}  # url -> the probe check of that server
        self.sampling_body = server_sampling(config.rollout.sampling)
        try:
            urls = config.rollout.server_urls()
            if not urls:
                # Merged weights (auto's choice included): no LoRA slots.
                self._server = LaunchedServer(config, model_dir, lora=None if merge_from is None else False)
                urls = [self._server.url]
            self._client = ServerClient(urls, config.rollout, exit_note=self._exit_note)
            self._bases = {url: self._base_model_name(url) for url in urls}  # each server's name for its base
            for url in urls:
                self._check_processed_logprobs(url)
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> list[str]:
        return self._client.urls

    @property
    def url(self) -> str:
        """The first server's URL (the only one, unless rollout.server_url lists several)."""
        return self.urls[0]

    @property
    def base_model(self) -> str:
        return self._bases[self.url]

    def _json(self, url: str, method: str, path: str, payload: dict | None = None) -> dict:
        """One call (with the client's timeout and retries) and its JSON answer."""
        return self._client.request(url, method, path, payload).json()

    def _on_every_server(self, call) -> None:
        """call(url) on every server, at once when there are several; the first failure is raised."""
        if len(self.urls) == 1:
            call(self.url)
            return
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            for future in [pool.submit(call, url) for url in self.urls]:
                future.result()

    def _base_model_name(self, url: str) -> str:
        answer = self._client.request(url, "GET", "/v1/models", allowed=(404,))
        if answer.status_code == 404:
            raise ServerError(self._not_vllm(url))
        models = answer.json()["data"]
        bases = [model for model in models if not model.get("parent")]  # adapters name a parent
        if not bases:
            raise ServerError(f"the vLLM server at {url} lists no base model in /v1/models: {models}")
        if bases[0].get("root"):
            self._roots[url] = bases[0]["root"]
        return bases[0]["id"]

    def _not_vllm(self, url: str) -> str:
        """Why the server at url, which has no /v1/models, cannot serve this driver: most often it is TRL's."""
        try:
            trl = self._client.request(url, "GET", TRL_SERVER_ROUTE, allowed=(404,), retries=0).status_code == 200
        except ServerError:
            trl = False
        what = ("TRL's `trl vllm-serve` (or axolotl's, which mirrors it): it answers /get_world_size/ and speaks TRL's "
                "own API" if trl else "not vLLM's OpenAI server: it has no /v1/models")
        return (f"the server at {url} (rollout.server_url) is {what}, and this driver speaks vLLM's OpenAI API. Start "
                "`python -m driver.vllm_serve <this config>` there instead (the server the run would launch: "
                "docs/coming-from-trl.md), or leave rollout.server_url empty for the run to launch it")

    def _check_processed_logprobs(self, url: str) -> None:
        """Refuse a server that reports sampling logprobs before temperature (vLLM's default
        --logprobs-mode raw_logprobs): importance ratios would be silently wrong. Sample at temperature
        T, rescore the same tokens with prompt logprobs (always raw): only processed logprobs show the
        gap between the likeliest and the sampled token shrunk by 1/T."""
        prompt = list(range(4))  # any ids exist in any vocabulary
        request = dict(model=self._bases[url], prompt=prompt, max_tokens=MODE_CHECK_TOKENS, ignore_eos=True,
                       temperature=MODE_CHECK_TEMPERATURE, top_p=1.0, top_k=-1, logprobs=1, seed=0,
                       return_tokens_as_token_ids=True, **NEUTRAL_SAMPLING)
        sampled = self._json(url, "POST", "/v1/completions", request)["choices"][0]["logprobs"]
        tokens = [int(token[len(TOKEN_ID_PREFIX):]) for token in sampled["tokens"]]
        request = dict(model=self._bases[url], prompt=prompt + tokens, max_tokens=1, temperature=1.0, top_p=1.0,
                       top_k=-1, prompt_logprobs=1, **NEUTRAL_SAMPLING)
        rescored = self._json(url, "POST", "/v1/completions", request)["choices"][0]["prompt_logprobs"]
        for token, reported, raw in zip(tokens, sampled["top_logprobs"], rescored[len(prompt):]):
            raw_gap = max(entry["logprob"] for entry in raw.values()) - raw[str(token)]["logprob"]
            if raw_gap < MODE_CHECK_MIN_GAP:
                continue  # (near) the likeliest token: no gap to compare
            ratio = (max(reported.values()) - reported[f"{TOKEN_ID_PREFIX}{token}"]) / raw_gap
            if abs(ratio - 1 / MODE_CHECK_TEMPERATURE) < abs(ratio - 1):
                return
            raise ServerError(
                f"the vLLM server at {url} reports sampling logprobs before temperature scaling (the gap "
                f"to the likeliest token shrank by {ratio:.3f} at temperature {MODE_CHECK_TEMPERATURE:g}, "
                f"expected {1 / MODE_CHECK_TEMPERATURE:g}); start it with --logprobs-mode processed_logprobs")
        # No sampled token far from the likeliest (a near-deterministic model): nothing to tell apart.

    def _exit_note(self) -> str:
        return self._server.exit_note() if self._server is not None else ""

    def model_name(self, url: str, version: int) -> str:
        """The model a request to the server at `url` names for adapter `version`: the adapter (one name on
        every server), or that server's base (nothing synced yet, or full fine-tuning)."""
        return self._names.get(version) or self._bases[url]

    def sync(self, adapter_dir: Path, version: int) -> None:
        if self._merge_from is not None:
            # Its own directory: a server reloads every *.safetensors of the one it is given (not the adapter's).
            self._merged_pushed = True
            self._reload_weights(save_merged(self._merge_from, Path(adapter_dir) / MERGED_DIR), version)
            return
        if self.full_weights:
            self._reload_weights(adapter_dir, version)
            return
        # A fresh name per load: the server keys its adapter table and its prefix cache on the name
        # (and path), and a server we only connected to may still hold names from an earlier run.
        name = f"adapter-v{version}-{secrets.token_hex(4)}"
        path = str(Path(adapter_dir).resolve())

        def load(url: str) -> None:
            try:
                answer = self._client.request(url, "POST", "/v1/load_lora_adapter",
                                              {"lora_name": name, "lora_path": path}, allowed=(400,))
                if not answer.ok and ALREADY_LOADED not in answer.text:  # else: a retry after a lost answer
                    raise ServerError(f"POST /v1/load_lora_adapter to the vLLM server at {url} -> HTTP "
                                      f"{answer.status_code}: {answer.text}", answer.status_code)
            except ServerError as error:
                raise ServerError(f"loading adapter version {version} from {path} failed: {error}\nThe server must "
                                  "run with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and be able to "
                                  "read that directory.", error.status) from error

        self._on_every_server(load)
        self.adapter_version, self._names[version] = version, name
        for old in sorted(self._names)[:-self.keep_versions]:
            self._on_every_server(functools.partial(self._unload, name=self._names.pop(old)))

    def _reload_weights(self, model_dir: Path, version: int) -> None:
        """Full fine-tuning and merged weights: every server reloads every weight from model_dir in place
        (vLLM's reload_weights through /collective_rpc, a development endpoint), then drops its prefix cache,
        computed with the old weights."""
        path = str(Path(model_dir).resolve())

        def reload(url: str) -> None:
            try:
                self._reload_at(url, path)
            except ServerError as error:
                hint = (" The server has no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1 in its environment "
                        "(full fine-tuning and rollout.weight_sync = merged reload the weights through it)."
                        if error.status == 404 else "")
                raise ServerError(f"reloading the weights of version {version} from {path} failed: {error}.{hint} It "
                                  "must be able to read that directory.", error.status) from error

        self._on_every_server(reload)
        self.adapter_version = version

    def _reload_at(self, url: str, weights_path: str, **options) -> None:
        self._client.request(url, "POST", "/collective_rpc",
                             {"method": self._reload_method(url), "kwargs": {"weights_path": weights_path}}, **options)
        self._client.request(url, "POST", "/reset_prefix_cache", **options)

    def _reload_method(self, url: str) -> str:
        """The worker method that reloads that server's weights: our extension's where the server runs it (every
        server the driver starts does: driver/engine/server_worker.py), vLLM's reload_weights elsewhere, except
        for a mixture-of-experts model on CPU, whose experts vLLM's own reload corrupts."""
        if url not in self._reload_methods:
            try:
                config = self._json(url, "GET", "/server_info?config_format=json").get("vllm_config") or {}
            except ServerError as error:
                if error.status != 404:
                    raise
                config = {}  # no development endpoints: the reload itself fails and says how to enable them
            extension = (config.get("parallel_config") or {}).get("worker_extension_cls")
            if extension == EXTENSION:
                self._reload_methods[url] = RELOAD_METHOD
            elif self._moe_on_cpu():
                raise ServerError(f"the vLLM server at {url} reloads a mixture-of-experts model's weights on CPU with "
                                  "vLLM's reload_weights, which corrupts its experts (it skips their prepacking); "
                                  f"start it with --worker-extension-cls {EXTENSION}, as python -m driver.vllm_serve "
                                  "and the servers the driver launches do")
            else:
                self._reload_methods[url] = "reload_weights"
        return self._reload_methods[url]

    def _moe_on_cpu(self) -> bool:
        from driver.policy.model import is_moe

        model_config = getattr(self._merge_from, "config", None)
        return model_config is not None and is_moe(model_config) and not torch.cuda.is_available()

    def _unload(self, url: str, name: str, **options) -> None:
        # 404: already gone (e.g. unloaded by whoever runs the server, or by a retried call); nothing to free.
        self._client.request(url, "POST", "/v1/unload_lora_adapter", {"lora_name": name}, allowed=(404,), **options)

    def generate(self, prompts: list[list[int]], n: int, seed: int) -> list[list[Completion]]:
        return generate_by_stream(self, prompts, n, seed, self.config.rollout.sampling.max_tokens)

    def stream(self, requests: list[Request], version: int) -> Iterator[tuple[int, list[Completion]]]:
        if not requests:
            return
        if self._names and version not in self._names:
            raise ServerError(f"adapter version {version} is not loaded (kept: {sorted(self._names)})")
        if self.full_weights and version != self.adapter_version:
            raise ServerError(f"the server serves the weights of version {self.adapter_version}, not {version}")
        common = {"logprobs": 0, "return_tokens_as_token_ids": True, **self.sampling_body}

        def complete(request: Request) -> list[Completion]:
            url = self._client.next_url()  # the whole request (its n samples) on one server
            temperature = {} if request.temperature is None else {"temperature": request.temperature}
            body = self._json(url, "POST", "/v1/completions", {
                **common, "model": self.model_name(url, version), "prompt": request.token_ids, "n": request.n,
                "seed": request.seed, "max_tokens": request.max_tokens, **temperature})
            return _completions(body, request.n)

        workers = min(len(requests), MAX_CONNECTIONS * len(self.urls))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(complete, request): index for index, request in enumerate(requests)}
            for future in as_completed(futures):
                yield futures[future], future.result()

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """On the first server; verify_each probes them all."""
        return self._prompt_logprobs_at(self.url, token_ids)

    def _prompt_logprobs_at(self, url: str, token_ids: list[int]) -> list[float]:
        request = dict(model=self.model_name(url, self.adapter_version), prompt=token_ids, max_tokens=1,
                       temperature=1.0, top_p=1.0, top_k=-1, prompt_logprobs=0, **NEUTRAL_SAMPLING)
        entries = self._json(url, "POST", "/v1/completions", request)["choices"][0]["prompt_logprobs"]
        if entries is None or len(entries) != len(token_ids):
            raise ServerError(f"prompt_logprobs: sent {len(token_ids)} tokens, the server at {url} scored "
                              f"{None if entries is None else len(entries)} positions")
        # Keys are token ids as JSON strings; position 0 has no prefix and is null.
        return [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], token_ids[1:])]

    def verify_each(self, verifier: SyncVerifier, trainer: torch.Tensor, version: int) -> dict[str, float]:
        """The sync probe scored by every server, each checked against the trainer's by a verifier of its
        own (anchored at its own first sync: driver/engine/sync_check.py); a SyncError names the server.
        The metrics are the worst server's: the largest gap, verified only when every server is."""
        if not self._verifiers:
            self._verifiers = {url: verifier if i == 0 else copy.deepcopy(verifier) for i, url in enumerate(self.urls)}
        metrics: dict[str, float] = {}
        for url, check in self._verifiers.items():
            try:
                served = check.check(self._prompt_logprobs_at(url, check.probe_ids), trainer, version)
            except SyncError as error:
                raise SyncError(f"the vLLM server at {url}: {error}" if len(self.urls) > 1 else str(error)) from error
            if not metrics:
                metrics = served
                continue
            for key, worst in (("sync/probe_max_abs_diff", max), ("sync/probe_verified", min)):
                if key in served:
                    metrics[key] = worst(metrics.get(key, served[key]), served[key])
        return metrics

    def close(self) -> None:
        server, self._server = self._server, None
        client = self._client
        if server is not None:
            server.stop()
        elif client is not None and self._merged_pushed:
            # Servers we only connected to keep running: the weights they started with, not our merged ones.
            for url, root in self._roots.items():
                try:
                    self._reload_at(url, root, retries=0)
                except ServerError:
                    pass  # best effort: the server may be gone already
        elif client is not None:
            # Servers we only connected to keep running; free the adapters we loaded into them.
            for name in self._names.values():
                for url in client.urls:
                    try:
                        self._unload(url, name, timeout=CLOSE_TIMEOUT_S, retries=0)
                    except ServerError:
                        pass  # best effort: the server may be gone already
        self._names = {}
        if client is not None:
            client.close()


def _completions(body: dict, n: int) -> list[Completion]:
    choices = sorted(body["choices"], key=lambda choice: choice["index"])
    if len(choices) != n:
        raise ServerError(f"asked the server for {n} completions, got {len(choices)}")
    return [_completion(choice) for choice in choices]


def _completion(choice: dict) -> Completion:
    tokens, logprobs = choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
    if any(not token.startswith(TOKEN_ID_PREFIX) for token in tokens):
        raise ServerError(f"the server returned tokens as text ({tokens[:3]}...), not '{TOKEN_ID_PREFIX}<id>': "
                          "it ignores return_tokens_as_token_ids")
    token_ids = [int(token[len(TOKEN_ID_PREFIX):]) for token in tokens]
    return Completion(token_ids=token_ids, logprobs=[float(lp) for lp in logprobs],
                      finish_reason=choice["finish_reason"] or "length")
