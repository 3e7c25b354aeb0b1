"""Structured output in the server: response_format json_object / json_schema constrain decoding on both engines,
streamed or not, greedy or sampled; bad formats are 400s naming response_format."""

import json
import threading

import httpx
import pytest
import torch
from standin_tokenizer import ByteTokenizer, tiny_model_config

pytest.importorskip("xgrammar")

from zero2all.infer import api, structured  # noqa: E402
from zero2all.infer.server import create_server  # noqa: E402
from zero2all.model.io import save_model  # noqa: E402
from zero2all.model.z2all import build_model  # noqa: E402

TOK = ByteTokenizer()
MODEL = "tiny-json"
# bounded, so that every output completes within the budget whatever a random model prefers
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "n", "name", "tags"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": -5, "maximum": 120},
                         "name": {"type": "string", "maxLength": 4},
                         "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bc"]}, "maxItems": 3}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


def valid(obj) -> bool:
    """SCHEMA checked by hand (no validator library needed)."""
    return (isinstance(obj, dict) and set(obj) == set(SCHEMA["required"]) and isinstance(obj["ok"], bool)
            and obj["color"] in ("red", "green", "blue") and type(obj["n"]) is int and -5 <= obj["n"] <= 120
            and isinstance(obj["name"], str) and len(obj["name"]) <= 4 and isinstance(obj["tags"], list)
            and len(obj["tags"]) <= 3 and all(t in ("a", "bc") for t in obj["tags"]))


def serve(tmp_path_factory, engine, device="cpu"):
    ckpt = tmp_path_factory.mktemp("srv") / MODEL
    save_model(build_model(tiny_model_config(max_seq_len=1024, initializer_range=0.3), seed=0), ckpt)
    httpd, app = create_server(ckpt, port=0, tokenizer=TOK, device=device, max_tokens_limit=200, max_queue=8,
                               quiet=True, engine_options={"engine": engine})
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    host, port = httpd.server_address[:2]
    return httpd, app, f"http://{host}:{port}"


@pytest.fixture(scope="module", params=["paged", "column"])
def server(request, tmp_path_factory):
    httpd, app, url = serve(tmp_path_factory, request.param)
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client, app
    httpd.shutdown()
    httpd.server_close()
    app.close()


def sse(response) -> list[dict]:
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def chat(client, stream=False, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "give me a thing"}], "max_tokens": 150,
            **extra}
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        chunks = sse(r)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return text, chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_validate(server, stream):
    client, _ = server
    for temperature, seed in ((0, None), (0.7, 1), (1.3, 2), (1.0, 3)):
        text, reason = chat(client, stream, response_format=FORMAT, temperature=temperature, seed=seed, top_k=0)
        assert reason == "stop", (temperature, text)
        assert valid(json.loads(text)), (temperature, text)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("engine", ["paged", "column"])
def test_on_cuda_json_schema_outputs_validate(tmp_path_factory, engine):
    """On the GPU (masks applied to CUDA logits, graphed decode steps, pipelined steps): every output parses and
    validates, greedy and sampled, streamed and not, and a batch of 4 beside each other."""
    httpd, app, url = serve(tmp_path_factory, engine, device="cuda")
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            for stream in (False, True):
                for temperature, seed in ((0, None), (0.7, 1), (1.3, 2)):
                    text, reason = chat(client, stream, response_format=FORMAT, temperature=temperature, seed=seed,
                                        top_k=0)
                    assert reason == "stop" and valid(json.loads(text)), (engine, stream, temperature, text)
            body = {"model": MODEL, "prompt": ["x", "{", "ab", "1"], "max_tokens": 150, "temperature": 0.9,
                    "seed": 5, "response_format": FORMAT}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert all(valid(json.loads(c["text"])) for c in r.json()["choices"])
    finally:
        httpd.shutdown()
        httpd.server_close()
        app.close()


def test_completions_json_object_and_batch(server):
    client, _ = server
    body = {"model": MODEL, "prompt": ["x", "{"], "max_tokens": 150, "temperature": 0.9, "seed": 5,
            "response_format": FORMAT}
    out = client.post("/v1/completions", json=body).json()
    for choice in out["choices"]:
        assert choice["finish_reason"] == "stop" and valid(json.loads(choice["text"]))
    # json_object: a JSON object (here an empty-ish one is as good as any: the random model decides)
    r = client.post("/v1/completions", json={**body, "prompt": "x", "temperature": 0,
                                            "response_format": {"type": "json_object"}})
    text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # out of tokens: what came is the start of an object
        assert reason == "length" and text.startswith("{")


def test_ignore_eos_still_stops_at_the_end_of_the_grammar(server):
    client, _ = server
    text, reason = chat(client, response_format=FORMAT, temperature=0, ignore_eos=True)
    assert reason == "stop" and valid(json.loads(text))


def test_without_the_mask_the_output_is_not_json(server, monkeypatch):
    """The planted bug: the mask computed but never applied. The same requests then give no valid JSON."""
    from zero2all.infer import scheduler

    client, _ = server
    monkeypatch.setattr(scheduler, "apply_masks", lambda logits, rows, constraints: logits)
    bad = 0
    for temperature, seed in ((0, None), (0.7, 1)):
        text, _ = chat(client, response_format=FORMAT, temperature=temperature, seed=seed, max_tokens=40)
        try:
            bad += not valid(json.loads(text))
        except ValueError:
            bad += 1
    assert bad == 2


@pytest.mark.parametrize("fmt, needle", [
    ({"type": "xml"}, "'type' is one of"),
    ({"type": "json_schema"}, "needs 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "must be a JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(unclosed"}}, "required": ["a"]}}}, "cannot be used"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}, "cannot be used"),
])
def test_bad_formats_are_400_naming_response_format(server, fmt, needle):
    client, _ = server
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                                  "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and needle in err["message"], err


def test_missing_package_is_a_400_naming_it(server, monkeypatch):
    client, app = server

    def unavailable():
        raise structured.GrammarUnavailable("structured output needs the 'xgrammar' package, which is not "
                                            "installed on this server")

    monkeypatch.setattr(structured, "_xgrammar", unavailable)
    monkeypatch.setattr(app, "grammars", structured.Grammars(TOK, app.scheduler.vocab, [256, 258]))
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                                  "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "'xgrammar'" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format"


def test_mask_unpacking_matches_the_bits():
    import torch

    bits = torch.tensor([[0b1011, -1 << 31]], dtype=torch.int32)   # tokens 0, 1, 3 and 63
    allowed = structured.unpack(bits, 64)[0].nonzero().flatten().tolist()
    assert allowed == [0, 1, 3, 63]


@pytest.mark.parametrize("backend", ["hf", "spm"])
def test_our_tokenizers_bytes_and_grammar(tmp_path, backend):
    """token_bytes agrees with encode for both tokenizer backends, and a random walk through the grammar's allowed
    tokens of a real vocabulary decodes to valid JSON."""
    import random

    import torch

    from zero2all.tokenizer import train_tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return {'a': 1, \"b\": [2, 3], 'ok': true}  # é 日本 red green\n" * 50)
    tok = train_tokenizer([str(corpus)], 400, tmp_path / "tok", backend=backend, log=lambda *a: None)
    table = tok.token_bytes()
    for sample in ["def f(x):\n    return {'a': 1}", "é 日本 zz\t", '{"k": [1, 2]}']:
        assert b"".join(table[i] for i in tok.encode(sample)) == sample.encode()
    V = tok.vocab_size
    grammars = structured.Grammars(tok, V, [tok.eos_id, tok.im_end_id])
    grammar = grammars.json_schema(SCHEMA)
    rng = random.Random(0)
    for _ in range(4):
        c, ids = grammar.start(), []
        while not c.done:
            logits = torch.zeros(1, V)
            structured.apply_masks(logits, [0], [c])
            allowed = (logits[0] == 0).nonzero().flatten().tolist()
            tok_id = rng.choice(allowed)
            assert c.accept(tok_id)
            ids.append(tok_id)
            assert len(ids) < 400
        assert ids[-1] in (tok.eos_id, tok.im_end_id)
        assert valid(json.loads(tok.decode(ids[:-1])))


def test_speculative_rows_with_a_grammar_draft_nothing():
    """Prompt-lookup drafting is off for constrained rows: the output still validates, and a free greedy row
    beside it keeps drafting."""
    from zero2all.infer.generate import Generator, SamplingParams
    from zero2all.infer.scheduler import Scheduler

    model = build_model(tiny_model_config(max_seq_len=256, initializer_range=0.3), seed=0).eval()
    sched = Scheduler(Generator(model, TOK), max_batch=2, engine="paged", speculative_ngram=4)
    try:
        grammar = structured.Grammars(TOK, sched.vocab, sorted(sched.default_stop_ids)).json_schema(SCHEMA)
        prompt = TOK.apply_chat_template([{"role": "user", "content": "abcabcabc"}], add_generation_prompt=True)
        free = sched.submit([prompt], SamplingParams(max_new_tokens=40, temperature=0, stop_token_ids=[]))
        ev = sched.generate([prompt], SamplingParams(max_new_tokens=150, temperature=0, grammar=grammar))
        list(free.events())
        assert ev[-1].finish_reason == "stop" and valid(json.loads("".join(e.text for e in ev)))
        assert sched.spec_drafted > 0  # the free row drafted
    finally:
        sched.stop()


# -- tools ------------------------------------------------------------------------------------------------------

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["a", "b"],
             "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                            "b": {"type": "boolean"}}}}}]


def valid_call(name, args) -> bool:
    if name == "get_weather":
        return set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo") and args["days"] in range(1, 8)
    return name == "add" and set(args) == {"a", "b"} and args["a"] in range(10) and isinstance(args["b"], bool)


def tool_reply(client, stream, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 120,
            "tools": TOOLS, **extra}
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        api.ChatCompletion.model_validate(r.json())   # the documented response shape
        choice = r.json()["choices"][0]
        return choice["message"], choice["finish_reason"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        chunks = sse(r)
    for c in chunks:
        api.ChatCompletionChunk.model_validate(c)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    content = "".join(d.get("content") or "" for d in deltas)
    return {"content": content or None, "tool_calls": calls or None}, chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_parse_and_validate(server, stream, choice):
    client, _ = server
    for temperature, seed in ((0, None), (0.8, 1), (1.4, 2)):
        message, reason = tool_reply(client, stream, tool_choice=choice, temperature=temperature, seed=seed)
        assert reason == "tool_calls" and message["content"] is None, message
        [call] = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        args = json.loads(call["function"]["arguments"])
        assert valid_call(call["function"]["name"], args), call
        if isinstance(choice, dict):
            assert call["function"]["name"] == "add"


def test_auto_streams_the_same_text_and_calls_go_back_in(server):
    """With tool_choice auto a random model answers in text: streamed (held back while it could be a call) it is
    the same text. A conversation holding a call and its result is accepted."""
    client, _ = server
    plain, reason = tool_reply(client, False, temperature=0, max_tokens=20)
    streamed, reason2 = tool_reply(client, True, temperature=0, max_tokens=20)
    assert plain["content"] == streamed["content"] and reason == reason2 and plain.get("tool_calls") is None
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 2}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    message, _ = tool_reply(client, False, messages=history, temperature=0, max_tokens=5)
    assert isinstance(message["content"], str)


def test_tool_call_reading():
    from zero2all.infer.server import _Job, tool_calls

    job = _Job(True, "x", [[1]], None, False, False, 0.0, frozenset({"f"}))
    text = ' <tool_call>{"name": "f", "arguments": {"x": [1, 2]}}</tool_call>\n<tool_call>{"name": "f"}</tool_call>'
    calls = tool_calls(job, text, "stop")
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": [1, 2]}, {}]
    assert tool_calls(job, text, "length") is None                        # cut off: text
    assert tool_calls(job, "sure: " + text, "stop") is None               # text before the blocks: text
    assert tool_calls(job, text.replace('"f"', '"g"'), "stop") is None    # a function not offered: text
    assert tool_calls(job, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "stop") is None
    from zero2all.data.tools import may_be_tool_call
    assert may_be_tool_call(" <tool") and may_be_tool_call("<tool_call>{") and not may_be_tool_call("hi <tool_call>")


@pytest.mark.parametrize("extra, param, needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools[1].function.parameters", "cannot be used"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "send one"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]", "content"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages[0].tool_calls", "not valid JSON"),
])
def test_bad_tool_requests_are_400_with_param(server, extra, param, needle):
    client, _ = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "tools": TOOLS, **extra}
    r = client.post("/v1/chat/completions", json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_openai_client_round_trip(server):
    openai = pytest.importorskip("openai")
    client, _ = server
    c = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="none", max_retries=0, timeout=60)
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=150,
                                    temperature=0, response_format=FORMAT)
    assert out.choices[0].finish_reason == "stop" and valid(json.loads(out.choices[0].message.content))
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=120,
                                    temperature=0.5, seed=3, tools=TOOLS, tool_choice="required")
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls"
    assert valid_call(call.function.name, json.loads(call.function.arguments))
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=120,
                                       temperature=0, tools=TOOLS, tool_choice="required", stream=True)
    pieces = [ch.choices[0] for ch in stream if ch.choices]
    calls = [tc for p in pieces for tc in p.delta.tool_calls or []]
    assert pieces[-1].finish_reason == "tool_calls" and len(calls) == 1
    assert valid_call(calls[0].function.name, json.loads(calls[0].function.arguments))


def test_generator_refuses_a_grammar_it_would_ignore():
    from zero2all.infer.generate import Generator, SamplingParams

    model = build_model(tiny_model_config(), seed=0).eval()
    grammar = structured.Grammars(TOK, 320, [256, 258]).json_object()
    with pytest.raises(ValueError, match="scheduler"):
        Generator(model, TOK).generate([[1, 2]], SamplingParams(max_new_tokens=2, grammar=grammar))
