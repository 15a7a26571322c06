"""Scale-out on Ray Serve, on a local Ray instance on this machine: two CPU replicas of a tiny
model behind the OpenAI-compatible ingress, the official ``openai`` client against it, results
equal to a single runtime, policies pinned to their own replica group, and a replica killed
mid-run (new calls are served; calls in flight finish or fail with a clear error; nothing hangs).
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import openai
import pytest
from conftest import make_model, make_tokenizer
from live_server import KEY_FILE, KEYS, free_port

from specagent import RuntimeOptions, SpecRuntime, shipped_policies
from specagent.call import Call
from specagent.server.ray_app import (
    build_app,
    conversation_key,
    rank_replicas,
    write_config,
)

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

# A deployment that cannot be placed fails, not hangs; a local Ray instance takes a while: the
# full suite's.
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROMPTS = [[{"role": "user", "content": f"Hello world {i}"}] for i in range(6)]


def test_rendezvous_ranking_keeps_conversations_home_and_moves_few() -> None:
    replicas = [f"replica-{i}" for i in range(4)]
    turns = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Where is my order?"},
        ],
    ]
    assert conversation_key(turns[0]) == conversation_key(turns[1])  # one conversation
    homes = {rank_replicas(conversation_key(t), replicas)[0] for t in turns}
    assert len(homes) == 1
    keys = [conversation_key([{"role": "user", "content": f"q{i}"}]) for i in range(400)]
    before = {k: rank_replicas(k, replicas)[0] for k in keys}
    assert len(set(before.values())) == 4  # conversations spread over every replica
    after = {k: rank_replicas(k, replicas[:3])[0] for k in keys}  # replica-3 is gone
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "replica-3" for k in moved)  # only its conversations move


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict]:
    """A local Ray instance with the app deployed: two default replicas (half a CPU each) and
    a one-replica group for the legal and medical policies."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        tokenizer = make_tokenizer()
        make_model(len(tokenizer), seed=3, max_positions=4096).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        key_file = Path(tmp) / "keys.yaml"
        key_file.write_text(KEY_FILE)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(
            str(model_dir),
            replicas=2,
            groups={"sensitive": ["legal-drafting", "medical-summary"]},
            cpus_per_replica=0.5,
            key_file=str(key_file),
            runtime_options={"dtype": "float32"},
        )
        serve.run(app, name="specagent", route_prefix="/")
        alone = SpecRuntime.from_pretrained(
            str(model_dir),
            policies=shipped_policies(),
            dtype="float32",
            options=RuntimeOptions(probe_store=None),
        )
        try:
            yield {"url": f"http://127.0.0.1:{port}/v1", "alone": alone, "dir": model_dir}
        finally:
            alone.close()
            serve.shutdown()
            ray.shutdown()


def api(cluster: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster["url"], api_key=KEYS["full"], max_retries=0, timeout=60)


def test_replicas_answer_as_one_runtime_would(cluster: dict) -> None:
    client = api(cluster)
    for prompt in PROMPTS:
        reply = client.chat.completions.create(
            model="tiny", messages=prompt, max_tokens=10, temperature=0
        )
        alone = cluster["alone"].generate_sync(prompt, max_new_tokens=10, temperature=0)
        assert reply.choices[0].message.content == alone.text
    streamed = client.chat.completions.create(
        model="tiny", messages=PROMPTS[0], max_tokens=10, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == cluster["alone"].generate_sync(PROMPTS[0], max_new_tokens=10, temperature=0).text
    # keys and policies are the ingress's, as on one server
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(
            base_url=cluster["url"], api_key=KEYS["customer"], max_retries=0
        ).chat.completions.create(model="tiny:internal-summary", messages=PROMPTS[0], max_tokens=2)
    pinned = client.chat.completions.create(
        model="tiny:legal-drafting", messages=PROMPTS[1], max_tokens=4, temperature=0
    )
    assert pinned.model_extra["speculative_decoding_stats"]["policy"] == "legal-drafting"


def test_the_responses_api_through_the_ingress_stores_and_chains(cluster: dict) -> None:
    """``/v1/responses`` runs on the replicas as a chat call does; the ingress keeps the
    stored responses, so a chain continues whichever replica serves it."""
    client = api(cluster)
    first = client.responses.create(
        model="tiny", input=PROMPTS[0][-1]["content"], max_output_tokens=6, temperature=0
    )
    alone = cluster["alone"].generate_sync(PROMPTS[0][-1:], max_new_tokens=6, temperature=0)
    assert first.output_text == alone.text
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, input="More", max_output_tokens=4
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(
            base_url=cluster["url"], api_key=KEYS["customer"], max_retries=0
        ).responses.retrieve(first.id)


def test_replicas_take_calls_from_the_ingress_only(cluster: dict) -> None:
    """Any Ray client can get a replica's handle: without the application's token it cannot
    run a call (which would skip keys, limits and tenants)."""
    handle = serve.get_deployment_handle("spec-default", app_name="specagent")

    async def direct(**extra):
        call = Call(PROMPTS[0], max_new_tokens=2)
        response = handle.options(stream=True).stream.remote(call, **extra)
        return [chunk async for chunk in response]

    for extra in ({}, {"ingress_token": "guessed"}):
        with pytest.raises(PermissionError, match="ingress only"):
            anyio.run(lambda extra=extra: direct(**extra))
    ready = httpx.get(
        cluster["url"].removesuffix("/v1") + "/ready",
        headers={"Authorization": f"Bearer {KEYS['full']}"},  # queue figures: a full key's
        timeout=60,
    )
    assert ready.json()["running"] == 0  # the replicas' own report, not a constant
    assert "measured" in ready.json()


def test_a_replicas_error_reaches_the_client_without_its_internals(cluster: dict) -> None:
    """A replica's ContextLengthError arrives wrapped by Ray (its traceback, file paths, pid,
    address and actor id): the client gets the error's own message, nothing of the wrapping."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello world " * 6000}],
        "max_tokens": 2,
    }
    response = httpx.post(
        cluster["url"] + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEYS['full']}"},
        timeout=120,
    )
    assert response.status_code == 400
    text = response.text
    assert "context window" in text
    for leak in ("Traceback", ".py", "pid=", "ip=", "actor", "Ray", "/root", "/home"):
        assert leak not in text, leak


def test_a_killed_replica_does_not_hang_anything(cluster: dict) -> None:
    client = api(cluster)

    def call(i: int) -> str:
        try:
            reply = client.chat.completions.create(
                model="tiny", messages=PROMPTS[i % 6], max_tokens=200, temperature=1.0, seed=i
            )
            return "ok" if reply.choices[0].finish_reason in {"stop", "length"} else "odd"
        except openai.APIError as exc:  # a clear error, in OpenAI's shape
            return f"error: {exc.message}"

    actors = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "spec-default" in a["name"] and "REPLICA" in a["name"].upper()
    ]
    assert len(actors) == 2
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(call, i) for i in range(16)]
        time.sleep(0.3)
        ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]))
        outcomes = [f.result(timeout=120) for f in futures]  # nothing hangs
    errors = [o for o in outcomes if o != "ok"]
    assert all(o.startswith("error: ") and len(o) > len("error: ") for o in errors), errors
    # new calls are served (by the survivor, and by the replacement Serve starts)
    for i in range(4):
        assert call(100 + i) == "ok"


@serve.deployment(ray_actor_options={"num_cpus": 0})
class _RefusesItsInput:
    """A replica whose runtime refuses every call's input with a plain ``ValueError`` (a
    library's complaint), counting the calls it was sent."""

    def __init__(self) -> None:
        self.calls = 0

    async def stream(self, call: Call, *, streaming: bool = True, ingress_token: str = ""):
        self.calls += 1
        raise ValueError("a library's complaint about this input, with /internal/paths")
        yield  # an async generator, as SpecReplica.stream

    def count(self) -> int:
        return self.calls


def test_a_call_refused_for_its_input_is_not_retried(cluster: dict) -> None:
    """Another replica would refuse the same input: the ingress answers as a single server
    does (422, the text in its log), and sends the call once. Only a replica that died is
    worth another."""
    from specagent.calls import CallSpec, run_call
    from specagent.server.errors import as_api_error
    from specagent.server.ray_app import RemoteBackend

    serve.run(_RefusesItsInput.bind(), name="refusing", route_prefix=None)
    handle = serve.get_deployment_handle("_RefusesItsInput", app_name="refusing")
    backend = RemoteBackend("tiny", shipped_policies(), {"default": handle})
    spec = CallSpec.build(PROMPTS[0], max_tokens=2)

    async def run() -> None:
        async for _ in run_call(backend, spec):
            pass

    with pytest.raises(ValueError, match="complaint") as refused:
        anyio.run(run)
    error = as_api_error(refused.value)
    assert error.status == 422
    assert "internal" not in str(error)
    assert handle.count.remote().result() == 1
    serve.delete("refusing")


def test_a_serve_config_for_a_cluster(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "serve.yaml",
        target="/models/Qwen2.5-7B-Instruct",
        draft="/models/Qwen2.5-0.5B-Instruct",
        replicas=4,
        gpus_per_replica=1,
        groups={"sensitive": ["legal-drafting", "medical-summary"]},
        key_file="/etc/specagent/keys.yaml",
    )
    import yaml

    assert path.stat().st_mode & 0o777 == 0o600  # it may hold a database URL's password
    config = yaml.safe_load(path.read_text())
    assert config["http_options"]["host"] == "127.0.0.1"  # exposed only when told to
    application = config["applications"][0]
    assert application["import_path"] == "specagent.server.ray_app:app_builder"
    assert application["args"]["groups"] == {"sensitive": ["legal-drafting", "medical-summary"]}
