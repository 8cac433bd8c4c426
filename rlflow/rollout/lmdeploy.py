"""The ``lmdeploy`` rollout backend: sampling with LMDeploy's PyTorch engine behind its ``api_server``, as XTuner does.

Colocated (the default): every training rank starts its own ``lmdeploy serve api_server`` on its own GPU
(``tp`` 1, ``127.0.0.1``, port ``port + local_rank``) and generates its share of the prompts there. Remote: give
``server_url`` (one URL, or one per rank) of servers started elsewhere. Generation goes through ``POST
/generate`` from token ids with ``return_logprob``: one request per completion, sent concurrently so the engine
batches them. Sampling options map one-to-one (:func:`generate_payload`).

Weights: the optimizer step only marks the engine stale (:meth:`LMDeployRollout.sync_weights`); the next
:meth:`~LMDeployRollout.generate` pushes the policy's current weights before sampling (so several optimizer steps
between rollouts cost one push, and no rollout ever samples from old weights). The push walks the policy's
(FSDP2-sharded) ``state_dict`` in order, gathers each parameter (``full_tensor``, a collective every rank joins),
casts it to ``dtype`` and packs buckets of ``bucket_mb`` for ``POST /update_weights``: CUDA IPC handles
(``flattened_bucket``) when colocated, ``safetensors`` bytes to a remote server. LMDeploy takes new weights only
with its KV cache released, so a push is: sleep, wake the weights, update, wake the KV cache. Between rollouts
the engine sleeps at ``sleep_level`` (1: weights to host memory, KV cache freed; 2: both freed, since they are
replaced anyway) so training has the GPU memory.

Under ``model.lora`` the push sends merged weights (each adapted projection's ``W + scaling * B @ A`` under the base
model's names, :func:`rlflow.models.lora.merge_lora_tensors`), not the adapter: ``/update_weights`` replaces base
weights, and LMDeploy loads LoRA adapters only from disk at server start (``--adapters``), with no call that
replaces a running adapter's weights.

Simplifications: LMDeploy's ``raw_logprobs`` are log-softmax of the unscaled logits, so the returned
``rollout_logprobs`` follow rlflow's contract exactly only at temperature 1.0 (a warning says so otherwise);
colocated engines are single-GPU (``tp`` 1); the in-process ``pipeline`` API is not used because its token-id
generation signature changes between LMDeploy versions, while ``/generate`` is the schema XTuner relies on.
Vision-language prompts go as the rendered text (one placeholder per image) with the images as ``image_data``
data URIs, per ``/generate``'s ``GenerateReqInput`` schema; this path has not been run against a server (no GPU
here), and it relies on LMDeploy's processor expanding the placeholders as the trainer's processor does.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import json
import os
import queue
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rlflow.rollout.base import Completion, Progress, RolloutBackend, SamplingParams, UnsupportedModelError
from rlflow.rollout.hf import trim_at_stop
from rlflow.rollout.requests import DecodeRequest, RequestSource

PICKLE_ENV = "LMDEPLOY_ALLOW_PICKLE_UPDATE_PARAMS"  # lmdeploy's opt-in for same-node CUDA IPC weight updates
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LMDeployError(RuntimeError):
    """The LMDeploy server could not be started, or answered a request with an error."""


# ----------------------------------------------------------------------------------- request / response
def generate_payload(prompt_ids: list[int], params: SamplingParams, model_name: str | None = None) -> dict[str, Any]:
    """The ``POST /generate`` body for one completion of ``prompt_ids``: rlflow's sampling options one-to-one.

    Greedy (temperature 0) is sent as ``top_k=1`` at temperature 1, which every LMDeploy version reads as greedy.
    The stop tokens (EOS included) are kept in the output, as rlflow's contract wants.
    """
    if not prompt_ids:
        raise ValueError("lmdeploy: an empty prompt cannot be generated from (input_ids must not be empty)")
    if params.temperature > 2.0:
        raise ValueError(f"lmdeploy accepts temperatures in [0, 2]; data.sampling.temperature={params.temperature}")
    body: dict[str, Any] = {
        "input_ids": list(prompt_ids),
        "max_tokens": params.max_tokens,
        "temperature": 1.0 if params.greedy else params.temperature,
        "top_p": 1.0 if params.greedy else params.top_p,
        "top_k": 1 if params.greedy else params.top_k,
        "min_p": 0.0 if params.greedy else params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": False,
        "return_logprob": True,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "stream": False,
    }
    images = getattr(prompt_ids, "images", None)  # a vision-language prompt (rlflow.models.vision.ImagePrompt)
    if images:
        # LMDeploy's /generate takes images as ``image_data`` (data URIs) and expands their placeholders with the
        # model's own processor, so the prompt goes as the rendered text with one placeholder per image
        del body["input_ids"]
        body["prompt"] = prompt_ids.text
        body["image_data"] = [image_data_uri(ref) for ref in images]
    if model_name:
        body["model"] = model_name
    return body


def image_data_uri(ref: str | bytes) -> str:
    """One image for LMDeploy's ``image_data``: a ``data:image/png;base64,...`` URI of the decoded image."""
    import base64
    import io

    from rlflow.data.images import open_image

    buffer = io.BytesIO()
    open_image(ref).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def parse_generate_response(body: dict[str, Any], params: SamplingParams) -> Completion:
    """A :class:`Completion` from a ``/generate`` answer (``output_ids`` and ``meta_info.output_token_logprobs``).

    Checks that every output token has its log-prob and that the pairs name the same tokens; cuts after the
    first stop token or at ``max_tokens`` like the ``hf`` backend. An aborted request is an error.
    """
    if "output_ids" not in body or "meta_info" not in body:
        raise LMDeployError(f"lmdeploy /generate answered without output_ids/meta_info: {str(body)[:300]}")
    ids = [int(t) for t in body["output_ids"]]
    meta = body["meta_info"] or {}
    reason = meta.get("finish_reason")
    reason = reason.get("type") if isinstance(reason, dict) else reason  # {"type": "stop"} or a plain string
    if reason in ("abort", "error"):
        raise LMDeployError(f"lmdeploy aborted a generation (finish_reason={meta.get('finish_reason')!r})")
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise LMDeployError(
            "lmdeploy returned no output_token_logprobs: start the engine with logprobs_mode='raw_logprobs' "
            "(the backend's logprobs_mode option; for an external server: --logprobs-mode raw_logprobs)"
        )
    if len(pairs) != len(ids):
        raise LMDeployError(f"lmdeploy returned {len(pairs)} log-probs for {len(ids)} output tokens")
    logprobs = []
    for i, (pair, tok) in enumerate(zip(pairs, ids)):
        lp, pair_tok = pair[0], pair[1]
        if int(pair_tok) != tok:
            raise LMDeployError(f"lmdeploy log-prob {i} is for token {pair_tok}, the output token is {tok}")
        logprobs.append(float(lp))
    completion = trim_at_stop(ids, logprobs, set(params.stop_token_ids), params.max_tokens)
    if completion.finish_reason == "length" and reason == "stop" and len(ids) < params.max_tokens:
        completion.finish_reason = "stop"  # stopped by the engine's own EOS handling on a token not in stop_token_ids
    return completion


def sleep_params(level: int) -> dict[str, Any]:
    """Query of ``POST /sleep``: level 1 offloads weights to host memory and frees the KV cache, 2 frees both."""
    if level not in (1, 2):
        raise ValueError(f"lmdeploy sleep level must be 1 or 2, got {level}")
    return {"tags": ["weights", "kv_cache"], "level": level}


def wakeup_params(tags: list[str]) -> dict[str, Any]:
    """Query of ``POST /wakeup`` for ``weights`` and/or ``kv_cache``."""
    unknown = set(tags) - {"weights", "kv_cache"}
    if unknown:
        raise ValueError(f"lmdeploy wakeup tags are 'weights' and 'kv_cache', got {sorted(unknown)}")
    return {"tags": list(tags)}


def weight_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_bytes`` (a bigger tensor goes alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def update_weights_bodies(
    buckets: Iterable[list[tuple[str, torch.Tensor]]], serialize: Callable[[list[tuple[str, torch.Tensor]]], Any],
    load_format: str | None,
) -> Iterator[dict[str, Any]]:
    """``POST /update_weights`` bodies, one per bucket, ``finished`` on the last (an empty closing one if none)."""
    pending = None
    for bucket in buckets:
        if pending is not None:
            yield pending
        pending = {"serialized_named_tensors": serialize(bucket), "finished": False}
        if load_format:
            pending["load_format"] = load_format
    if pending is None:
        pending = {"serialized_named_tensors": {}, "finished": False}
    pending["finished"] = True
    yield pending


def server_command(model_path: str, port: int, tp: int, cache_max_entry_count: float, dtype: str,
                   session_len: int | None, max_batch_size: int | None, extra_args: list[str]) -> list[str]:
    """``lmdeploy serve api_server`` arguments for a PyTorch engine that returns raw log-probs."""
    cmd = [
        sys.executable, "-m", "lmdeploy", "serve", "api_server", model_path, "--backend", "pytorch",
        "--server-name", "127.0.0.1", "--server-port", str(port), "--tp", str(tp),
        "--cache-max-entry-count", str(cache_max_entry_count), "--dtype", dtype, "--logprobs-mode", "raw_logprobs",
    ]
    if session_len:
        cmd += ["--session-len", str(session_len)]
    if max_batch_size:
        cmd += ["--max-batch-size", str(max_batch_size)]
    return cmd + list(extra_args)


def full_named_tensors(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights by Hugging Face name, each gathered whole (DTensor ``full_tensor``) and cast to
    ``dtype``. Under ``model.lora`` each adapted projection is sent merged (``W + scaling * B @ A``, under the
    base model's names; :func:`rlflow.models.lora.merge_lora_tensors`): LMDeploy's ``update_weights`` replaces base
    weights, and its LoRA support loads adapters from disk at server start (``--adapters``), with no call to
    replace an adapter's weights in a running engine, so merged weights after every optimizer step are what keeps
    the engine on-policy (the push costs as much as a full model's, the training step far less)."""
    from rlflow.models.lora import merge_lora_tensors

    named = ((name, t.full_tensor() if hasattr(t, "full_tensor") else t) for name, t in model.state_dict().items())
    for name, full in merge_lora_tensors(model, named):
        yield name, full.detach().to(dtype)


# ------------------------------------------------------------------------------------------- the backend
class LMDeployRollout(RolloutBackend):
    """Generates with LMDeploy's PyTorch engine and keeps it in sync with the trained weights."""

    #: Generation reads the engine's copy of the weights, not the policy module: no unsharding needed.
    reads_policy_weights = False
    #: Prompts with images are sent as text + ``image_data`` (:func:`generate_payload`).
    accepts_images = True

    def __init__(
        self,
        model_path: str | None = None,
        server_url: str | list[str] | None = None,
        port: int = 23333,
        tp: int = 1,
        dtype: str = "bfloat16",
        cache_max_entry_count: float = 0.5,
        session_len: int | None = None,
        max_batch_size: int | None = None,
        sleep_level: int | None = 2,
        bucket_mb: int = 512,
        max_concurrency: int = 512,
        startup_timeout: float = 900.0,
        request_timeout: float = 3600.0,
        api_key: str | None = None,
        model_name: str | None = None,
        extra_server_args: list[str] | None = None,
        poll_interval: float = 0.005,
    ) -> None:
        """
        Args:
            model_path: Checkpoint the engine starts from; defaults to the policy's ``name_or_path``.
            server_url: Use already running servers instead of starting one per rank: one URL, or one per rank.
            port: Colocated servers listen on ``127.0.0.1:<port + local_rank>``.
            tp: Tensor parallel size of a colocated engine (1: one engine per training GPU).
            dtype: Dtype of the engine's weights; pushed weights are cast to it.
            cache_max_entry_count: Share of the GPU's free memory LMDeploy takes for the KV cache.
            session_len: Longest prompt + completion the engine accepts (default: the model's).
            max_batch_size: Most sequences the engine decodes at once (default: LMDeploy's).
            sleep_level: Between rollouts: 1 offloads the weights to host memory, 2 frees them (they are replaced
                anyway); null keeps the engine awake (only when it does not share GPUs with training).
            bucket_mb: Size of the weight buckets pushed after training, in MiB.
            max_concurrency: Most ``/generate`` requests in flight per rank.
            startup_timeout: Seconds to wait for a started server to answer ``/health``.
            request_timeout: Seconds one request may take.
            api_key: Bearer token of the servers, if they require one.
            model_name: ``model`` field of requests (servers serving several models).
            extra_server_args: More ``lmdeploy serve api_server`` arguments for started servers.
            poll_interval: Seconds between two looks for trajectories whose tools answered while requests are in
                flight (multi-turn rollouts, :meth:`serve`).
        """
        if tp != 1 and server_url is None:
            raise ValueError("lmdeploy: colocated engines run one per training GPU (tp=1); for tp>1 start servers "
                             "yourself and give their server_url")
        if dtype not in DTYPES:
            raise ValueError(f"lmdeploy dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if sleep_level is not None:
            sleep_params(sleep_level)
        self.model_path = model_path
        self.server_urls = [server_url] if isinstance(server_url, str) else list(server_url or [])
        self.port = port
        self.tp = tp
        self.dtype = dtype
        self.cache_max_entry_count = cache_max_entry_count
        self.session_len = session_len
        self.max_batch_size = max_batch_size
        self.sleep_level = sleep_level
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.max_concurrency = max_concurrency
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.api_key = api_key
        self.model_name = model_name
        self.extra_server_args = list(extra_server_args or [])
        self.poll_interval = poll_interval
        self.url: str | None = None
        self.process: subprocess.Popen | None = None
        self.weights_current = False  # the engine holds the policy's latest weights
        self.weights_awake = True  # the engine's weights are in GPU memory
        self.kv_awake = True  # the engine's KV cache is allocated
        self._warned_temperature = False

    # ------------------------------------------------------------------------------------------- wiring
    @property
    def colocated(self) -> bool:
        return not self.server_urls

    def bind(self, model: Any, tokenizer: Any) -> None:
        problem = self.colocated_problem()
        if problem is not None:  # before the first rollout step: one line, not a traceback mid-step
            raise UnsupportedModelError("lmdeploy", problem)
        super().bind(model, tokenizer)
        self.weights_current = False  # a new policy object: push before the first rollout

    def colocated_problem(self) -> str | None:
        """Why this machine cannot start a colocated lmdeploy engine (no CUDA GPU, lmdeploy not installed), or None
        (also None with ``server_urls``: the engines run elsewhere)."""
        if not self.colocated:
            return None
        if not torch.cuda.is_available():
            return "its engine runs on a CUDA GPU and none is visible"
        if shutil.which("lmdeploy") is None and importlib.util.find_spec("lmdeploy") is None:
            return "lmdeploy is not installed (pip install 'rlflow[lmdeploy]')"
        return None

    def sync_weights(self) -> None:
        """Called after every optimizer step: the engine's weights are now stale; the next rollout pushes them."""
        self.weights_current = False

    def _rank(self) -> tuple[int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return 0, 0

    def _ensure_server(self) -> None:
        if self.url is not None:
            return
        rank, local_rank = self._rank()
        if not self.colocated:
            self.url = self.server_urls[rank % len(self.server_urls)].rstrip("/")
            self._wait_healthy()
            return
        if not torch.cuda.is_available():
            raise LMDeployError("the lmdeploy rollout backend runs its engine on a CUDA GPU; none is visible "
                                "(use data.rollout=hf on CPU)")
        if shutil.which("lmdeploy") is None:
            try:
                import lmdeploy  # noqa: F401
            except ImportError as exc:
                raise LMDeployError("lmdeploy is not installed: pip install 'rlflow[lmdeploy]'") from exc
        model_path = self.model_path or getattr(getattr(self.model, "config", None), "name_or_path", None)
        if not model_path:
            raise LMDeployError("lmdeploy: set data.rollout.init_args.model_path (the policy has no name_or_path)")
        port = self.port + local_rank
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        device = torch.cuda.current_device()
        gpu = visible.split(",")[device] if visible else str(device)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, **{PICKLE_ENV: "1"})
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            env.pop(key, None)  # the engine is not a member of the training job
        cmd = server_command(model_path, port, self.tp, self.cache_max_entry_count, self.dtype, self.session_len,
                             self.max_batch_size, self.extra_server_args)
        self.process = subprocess.Popen(cmd, env=env)
        atexit.register(self.close)
        self.url = f"http://127.0.0.1:{port}"
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise LMDeployError(f"the lmdeploy server exited with code {self.process.returncode} while starting")
            try:
                self._request("GET", "/health", timeout=10)
                return
            except (urllib.error.URLError, ConnectionError, OSError) as err:
                if time.monotonic() > deadline:
                    raise LMDeployError(
                        f"no lmdeploy server answered at {self.url} within {self.startup_timeout:.0f} s"
                    ) from err
                time.sleep(2.0)

    def _request(
        self, method: str, path: str, body: Any = None, query: dict | None = None, timeout: float | None = None
    ) -> Any:
        from urllib.parse import urlencode

        url = f"{self.url}{path}" + (f"?{urlencode(query, doseq=True)}" if query else "")
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            raise LMDeployError(
                f"lmdeploy {method} {path} failed: HTTP {exc.code}: {exc.read().decode()[:500]}"
            ) from exc
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return text

    # ---------------------------------------------------------------------------------- sleep / weights
    def sleep(self, level: int) -> None:
        self._request("POST", "/sleep", query=sleep_params(level))
        self.weights_awake = self.kv_awake = False
        if level == 2:
            self.weights_current = False

    def wakeup(self, tags: list[str]) -> None:
        self._request("POST", "/wakeup", query=wakeup_params(tags))
        self.weights_awake = self.weights_awake or "weights" in tags
        self.kv_awake = self.kv_awake or "kv_cache" in tags

    def push_weights(self) -> None:
        """Send the policy's current weights to the engine (every rank joins the gathers; the engine's owner sends)."""
        import torch.distributed as dist

        sender = self.colocated or self._rank()[0] == 0
        if sender:
            if self.kv_awake:
                self.sleep(2)  # LMDeploy takes new weights only with the KV cache freed; the old weights go too
            if not self.weights_awake:
                self.wakeup(["weights"])
        named = full_named_tensors(self.model, DTYPES[self.dtype])
        if self.colocated:
            named = ((name, t.cuda()) for name, t in named)
            serialize, load_format = self._ipc_serializer()
        else:
            serialize, load_format = self._safetensors_serializer()
        if not sender:
            serialize = lambda bucket: None  # noqa: E731 - this rank only joins the gathers
        for body in update_weights_bodies(weight_buckets(named, self.bucket_bytes), serialize, load_format):
            if sender:
                self._request("POST", "/update_weights", body=body)
        if sender and not self.colocated:
            self.wakeup(["kv_cache"])
        if not self.colocated and dist.is_available() and dist.is_initialized():
            dist.barrier()  # a shared server: nobody samples before it holds the new weights
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.weights_current = True

    def _ipc_serializer(self) -> tuple[Callable, str | None]:
        from lmdeploy import utils

        if hasattr(utils, "FlattenedTensorBucket"):
            def flat(bucket):
                packed = utils.FlattenedTensorBucket(named_tensors=bucket)
                return utils.serialize_state_dict(
                    dict(flattened_tensor=packed.get_flattened_tensor(), metadata=packed.get_metadata()))
            return flat, "flattened_bucket"
        return (lambda bucket: utils.serialize_state_dict(dict(bucket))), None

    def _safetensors_serializer(self) -> tuple[Callable, str | None]:
        from lmdeploy import utils

        if not hasattr(utils, "serialize_named_tensors_safetensors"):
            raise LMDeployError("pushing weights to a remote lmdeploy server needs lmdeploy with safetensors updates")
        return (
            lambda bucket: utils.serialize_named_tensors_safetensors(dict((n, t.cpu()) for n, t in bucket))
        ), "safetensors"

    # ----------------------------------------------------------------------------------------- generate
    def _begin(self, params: SamplingParams) -> None:
        """Before a rollout call: the server up, the policy's weights pushed if stale, a sleeping engine woken."""
        if getattr(self, "model", None) is None:
            raise LMDeployError("bind() the policy first")
        if params.temperature not in (0.0, 1.0) and not self._warned_temperature:
            warnings.warn(f"lmdeploy returns log-probs of the unscaled logits; at temperature {params.temperature} the "
                          "rollout log-probs differ from the trainer's (rollout corrections compare them)",
                          stacklevel=3)
            self._warned_temperature = True
        self._ensure_server()
        if not self.weights_current:
            self.push_weights()
        asleep = [tag for tag, awake in (("weights", self.weights_awake), ("kv_cache", self.kv_awake)) if not awake]
        if asleep and self.colocated:
            self.wakeup(asleep)

    def _end(self) -> None:
        """After a rollout call: a colocated engine goes back to sleep, so training has the GPU memory."""
        if self.sleep_level is not None and self.colocated:
            self.sleep(self.sleep_level)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
                 progress: Progress | None = None) -> list[list[Completion]]:
        """``n`` completions per prompt, requested concurrently; ``progress`` is called once they all returned."""
        self._begin(params)
        bodies = [generate_payload(p, params, self.model_name) for p in prompts for _ in range(n)]
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(bodies)))) as pool:
            answers = list(pool.map(lambda b: self._request("POST", "/generate", body=b), bodies))
        flat = [parse_generate_response(a, params) for a in answers]
        if progress is not None:
            progress(len(flat), sum(len(c.token_ids) for c in flat))
        self._end()
        return [flat[i * n: (i + 1) * n] for i in range(len(prompts))]

    def next_call_key(self) -> int:
        """The server samples with its own generator: a request's row keys are not used here (always 0)."""
        return 0

    def serve(self, source: RequestSource, params: SamplingParams,
              progress: Progress | None = None) -> Iterator[tuple[DecodeRequest, list[Completion]]]:
        """Send the requests ``source`` hands over as they come (:mod:`rlflow.rollout.requests`; a multi-turn
        rollout's next turns, :meth:`rlflow.rollout.multiturn.MultiTurn.run_async`): each row is one ``/generate``
        request sent at once from a thread pool of ``max_concurrency`` (the server batches what is in flight), and
        ``(request, its completions)`` is yielded as soon as its rows answered. The engine is woken once before and
        (colocated) put to sleep once after the whole call, not per request. Between answers the source is polled
        every ``poll_interval`` seconds (it is waited on only when no request is in flight).

        The rows' ``keys`` are ignored: the server samples with its own generator, so seeded multi-turn rollouts
        on ``lmdeploy`` are not reproducible (neither are single-turn ones)."""
        self._begin(params)
        answers: queue.Queue = queue.Queue()  # (request number, row, the answer or the exception)
        requests: dict[int, tuple[DecodeRequest, SamplingParams, list[Completion | None]]] = {}  # in flight
        closed, number = False, 0

        def send(k: int, row: int, body: dict[str, Any]) -> None:
            try:
                answers.put((k, row, self._request("POST", "/generate", body=body)))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the serving thread
                answers.put((k, row, exc))

        with ThreadPoolExecutor(max_workers=max(1, self.max_concurrency)) as pool:
            while requests or not closed:
                if not closed:
                    new = source.poll(wait=not requests)
                    if new is None:
                        closed = True
                    for r in new or []:
                        turn = dataclasses.replace(params, max_tokens=r.limit(params.max_tokens))
                        body = generate_payload(r.ids, turn, self.model_name)
                        requests[number] = (r, turn, [None] * r.n)
                        for row in range(r.n):
                            pool.submit(send, number, row, body)
                        number += 1
                if not requests:
                    continue
                try:
                    k, row, answer = answers.get(timeout=self.poll_interval if not closed else None)
                except queue.Empty:
                    continue
                if isinstance(answer, BaseException):
                    raise answer
                r, turn, rows = requests[k]
                rows[row] = parse_generate_response(answer, turn)
                if all(c is not None for c in rows):
                    del requests[k]
                    if progress is not None:
                        progress(len(rows), sum(len(c.token_ids) for c in rows))
                    yield r, rows
        self._end()

    def close(self) -> None:
        """Stop a server this backend started."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None
